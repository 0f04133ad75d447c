"""Artefact filters: a synthetic slide with a marker line and a blurred area loses exactly
those tiles, and only with its filter on; real ink is found, real H&E is not ink; the mask
keeps its pen layer; the workflow re-runs only what a filter changes and counts drops."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import RECT_SLIDE, RECT_TISSUE, REPO, jobs_run
from PIL import Image

from slidesnake.cli import main
from slidesnake.cohort.rule_params import tile_params, tissue_params
from slidesnake.slides.lowres import bin_pixels
from slidesnake.slides.synthetic import Blur, PenStroke, Rect, write_slide
from slidesnake.tiling.artefacts import ArtefactError, ArtefactParams
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.mask_file import load_mask, save_mask
from slidesnake.tiling.pen import detect_pen
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_dropped, read_tiles
from slidesnake.tiling.tissue import TissueParams

T = 448  # level-0 px of a 224 px tile at 0.5 µm/px on the 0.25 µm/px rect slide
EVERY = {(c, r) for c in range(5, 15) for r in range(4, 12)}  # the rect slide's 80 tiles
INKED = {(c, 6) for c in range(5, 15)}  # under the marker line
BLURRED = {(c, r) for c in range(10, 14) for r in range(8, 11)}


@pytest.fixture(scope="module")
def artefact_slide(tmp_path_factory):
    """The rect slide with a green marker line across tile row 6 and an out-of-focus area
    (sigma 4 µm) over BLURRED; both lie on the tile grid."""
    path = tmp_path_factory.mktemp("artefacts") / "artefacts.svs"
    line = PenStroke(5 * T + 128, 6 * T + 224, 15 * T - 128, 6 * T + 224, width=256)
    blur = Blur(Rect(10 * T, 8 * T, 14 * T, 11 * T), sigma=16)
    return write_slide(path, shapes=[RECT_TISSUE], levels=3, marks=[line], blurs=[blur],
                       **RECT_SLIDE)  # fmt: skip


@pytest.fixture(scope="module")
def pen_mask(tmp_path_factory, artefact_slide):
    out = tmp_path_factory.mktemp("artefact-mask")
    make_tissue_mask(
        artefact_slide, "a", out / "mask.png", out / "qc.png", TissueParams(), pen=True
    )
    return out


def tiles_with(slide, mask_dir, tmp_path, artefacts: ArtefactParams) -> pd.DataFrame:
    make_tile_coords(
        slide, "a", mask_dir / "mask.png", mask_dir / "qc.png", tmp_path / "tiles.parquet",
        tmp_path / "qc_tiles.png", TileParams(), artefacts=artefacts,
    )  # fmt: skip
    tiles, _ = read_tiles(tmp_path / "tiles.parquet")
    return tiles.assign(cell=list(zip(tiles["x"] // T, tiles["y"] // T, strict=True)))


def test_a_marker_line_loses_the_tiles_under_it_and_keeps_the_rest(
    artefact_slide, pen_mask, tmp_path
):
    off = tiles_with(artefact_slide, pen_mask, tmp_path, ArtefactParams())
    assert set(off["cell"]) == EVERY and "pen_fraction" not in off
    assert read_dropped(tmp_path / "tiles.parquet") == {}

    on = tiles_with(artefact_slide, pen_mask, tmp_path, ArtefactParams(max_pen_fraction=0.1))
    assert set(on["cell"]) == EVERY - INKED
    assert on["pen_fraction"].max() == 0
    assert read_dropped(tmp_path / "tiles.parquet") == {"pen": len(INKED)}


def test_a_blurred_area_loses_its_tiles_only_when_min_focus_is_set(
    artefact_slide, pen_mask, tmp_path
):
    scored = tiles_with(artefact_slide, pen_mask, tmp_path, ArtefactParams(min_focus=0))
    assert set(scored["cell"]) == EVERY
    blurred = scored["cell"].isin(BLURRED)
    sharpest_blurred, least_sharp = scored["focus"][blurred].max(), scored["focus"][~blurred].min()
    assert 10 * sharpest_blurred < least_sharp

    threshold = float(np.sqrt(sharpest_blurred * least_sharp))
    kept = tiles_with(artefact_slide, pen_mask, tmp_path, ArtefactParams(min_focus=threshold))
    assert set(kept["cell"]) == EVERY - BLURRED
    assert read_dropped(tmp_path / "tiles.parquet") == {"focus": len(BLURRED)}
    qc = np.asarray(Image.open(tmp_path / "qc_tiles.png")).astype(int)
    mask = load_mask(pen_mask / "mask.png")
    red, blue = (qc[int((r + 0.5) * T / mask.scale_y), int((c + 0.5) * T / mask.scale_x)]
                 for c, r in ((11, 9), (6, 9)))  # fmt: skip
    assert red[0] > red[2] and blue[2] > blue[0]  # dropped tiles red, kept ones blue


def test_both_filters_count_a_tile_once(artefact_slide, pen_mask, tmp_path):
    both = ArtefactParams(max_pen_fraction=0.1, min_focus=1e9)  # every tile is blurred
    assert tiles_with(artefact_slide, pen_mask, tmp_path, both).empty
    dropped = read_dropped(tmp_path / "tiles.parquet")
    assert dropped == {"pen": len(INKED), "focus": len(EVERY - INKED)}


def test_the_pen_filter_on_a_mask_without_pen_layer_fails_with_the_fix(artefact_slide, tmp_path):
    make_tissue_mask(artefact_slide, "a", tmp_path / "mask.png", tmp_path / "qc.png",
                     TissueParams())  # fmt: skip
    assert load_mask(tmp_path / "mask.png").pen is None
    with pytest.raises(ArtefactError, match=r"no pen layer.*Fix: re-run the mask stage"):
        tiles_with(artefact_slide, tmp_path, tmp_path, ArtefactParams(max_pen_fraction=0.1))


def test_the_pen_layer_survives_the_mask_file_and_keeps_the_tissue(pen_mask, tmp_path):
    mask = load_mask(pen_mask / "mask.png")
    assert 0 < mask.pen.mean() < 0.05 and mask.pen.shape == mask.mask.shape
    rows = np.flatnonzero(mask.pen.any(axis=1)) * mask.scale_y
    assert rows.min() >= 6 * T and rows.max() < 7 * T  # the line, within its tile row
    save_mask(mask, tmp_path / "again.png")
    again = load_mask(tmp_path / "again.png")
    assert (again.mask == mask.mask).all() and (again.pen == mask.pen).all()


def test_real_h_and_e_has_no_ink(shared_slides, tmp_path):
    for name in ("CMU-1-Small-Region.svs", "tcga-cr-7395-01a-01-ts1.svs"):
        make_tissue_mask(shared_slides / name, "real", tmp_path / "m.png", tmp_path / "qc.png",
                         TissueParams(), sheet_mpp=0.5, pen=True)  # fmt: skip
        mask = load_mask(tmp_path / "m.png")
        assert mask.tissue_fraction > 0.2 and not mask.pen.any(), name


def test_real_green_and_blue_marker_ink_is_found(shared_slides):
    """pathml's DICOM (H&E crossed by green and blue ink), which OpenSlide cannot open: its
    frames side by side, read with pydicom, binned 8 x 8 (it records no resolution)."""
    pydicom = pytest.importorskip("pydicom")
    imagecodecs = pytest.importorskip("imagecodecs")
    ds = pydicom.dcmread(shared_slides / "unsupported" / "pathml-small_dicom.dcm")
    frames = pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=ds.NumberOfFrames)
    pixels = np.concatenate([imagecodecs.jpeg8_decode(frame) for frame in frames], axis=1)
    pixels[pixels.max(axis=-1) < 8] = 255  # the edge frames' padding: OpenSlide gives white
    ink = detect_pen(bin_pixels(pixels, 8), 8.0)
    assert 0.02 < ink.mean() < 0.2  # ink crosses a fifth of the frames, a few % of the area


def test_filters_that_are_off_leave_the_rules_params_as_they_were():
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert "pen" not in tissue_params(config)
    assert set(tile_params(config)) == {"mpp", "size", "stride", "mask_threshold"}
    config["artefacts"] |= {"max_pen_fraction": 0, "min_focus": 300}
    assert tissue_params(config)["pen"] is True
    assert tile_params(config)["min_focus"] == 300.0 and tile_params(config)["focus_mpp"] == 2.0


@pytest.mark.workflow
def test_the_workflow_reruns_what_a_filter_changes_and_counts_what_it_drops(
    workflow, artefact_slide
):
    workflow.sheet([("a", artefact_slide)])
    workflow.run("--config", "artefacts={max_pen_fraction: 0.1}")
    cohort = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t").iloc[0]
    assert cohort["tiles"] == len(EVERY - INKED) and cohort["dropped_pen"] == len(INKED)
    assert pd.isna(cohort["dropped_focus"])

    both = workflow.run("--config", "artefacts={max_pen_fraction: 0.1, min_focus: 300}")
    assert jobs_run(both, "make_tissue_mask") == [] and jobs_run(both, "make_tile_coords") == ["a"]
    cohort = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t").iloc[0]
    assert cohort["tiles"] == len(EVERY - INKED - BLURRED)
    assert (cohort["dropped_pen"], cohort["dropped_focus"]) == (len(INKED), len(BLURRED))
    assert "dropped (focus)" in (workflow.dir / "results" / "cohort.html").read_text()
    tiles, _ = read_tiles(workflow.result("a", "tiles.parquet"))
    assert {"pen_fraction", "focus"} <= set(tiles.columns)


def test_the_command_line_runs_the_filters(artefact_slide, tmp_path):
    main(["mask", str(artefact_slide), str(tmp_path), "--pen"])
    main(["tiles", str(artefact_slide), str(tmp_path), "--max-pen-fraction", "0.1",
          "--min-focus", "0"])  # fmt: skip
    tiles, _ = read_tiles(tmp_path / "tiles.parquet")
    assert len(tiles) == len(EVERY - INKED) and {"pen_fraction", "focus"} <= set(tiles)
