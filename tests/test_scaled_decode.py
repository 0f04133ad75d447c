"""loader.decode: scaled: a 40x level's JPEG tiles decoded at the model's scale inside
libjpeg-turbo agree with the exact path's pixels within a documented bound, the method
is recorded and kept per cohort, and what cannot be decoded scaled is read exactly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_tile_loader import slide_40x, tiled  # noqa: F401

from slidesnake.cohort.decode_method import cohort_decode
from slidesnake.cohort.rule_params import embedding_params
from slidesnake.loader.batches import ReadPlan, TileBatches
from slidesnake.models.embedder import resize_tiles
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import random_blobs, write_slide
from slidesnake.tiling.grid import TileGeometry
from slidesnake.tiling.tile_table import read_tiles

# How far a scaled tile may be, in grey levels, from the exact read's 2x2 means (what
# decoding at half size approximates) and from the tile the exact path gives the model
# (the 448 px read resized to 224 px, antialiased bilinear: a triangle filter, itself
# 1.9 mean and 16 at the 99th percentile from the 2x2 means), on the synthetic 40x
# slide, whose blob edges and noise are harder than natural H&E (docs/benchmarks.md).
BOX_MEAN, BOX_P99 = 1.5, 8
MODEL_MEAN, MODEL_P99 = 3.0, 20
# JPEG 2000 at reduced resolution is the wavelet's low-pass band, sharper than either
# filter: on the same slide's noise, 3.3 mean and 37 at the 99th percentile from the
# exact path's tiles.
J2K_MEAN, J2K_P99 = 4.5, 45
SHARED_SLIDES = Path(__file__).resolve().parents[2] / "shared/slides"
REAL_RGB_SLIDE = SHARED_SLIDES / "CMU-1-Small-Region.svs"
REAL_J2K_SLIDE = SHARED_SLIDES / "tcga-cr-7395-01a-01-ts1.svs"


def tiles_of(slide: Path, tiles_path: Path, decode: str, coords=None) -> tuple:
    table, geometry = read_tiles(tiles_path)
    coords = table[["x", "y"]].to_numpy(np.int64) if coords is None else coords
    dataset = TileBatches(slide, "s", coords, geometry, 16, decode=decode)
    got = {}
    for rows, pixels in dataset.stream(0, 2):
        got |= {row: tile.copy() for row, tile in zip(rows.tolist(), pixels, strict=True)}
    return dataset, np.stack([got[row] for row in range(len(coords))])


def as_the_model_gets_it(tiles: np.ndarray, size: int) -> np.ndarray:
    x = torch.from_numpy(tiles).permute(0, 3, 1, 2).float()
    return resize_tiles(x, size).round().clamp(0, 255).permute(0, 2, 3, 1).numpy()


def test_scaled_tiles_agree_with_the_exact_path(tmp_path, slide_40x):  # noqa: F811
    tiles_path = tiled(slide_40x, tmp_path)
    exact_set, exact = tiles_of(slide_40x, tiles_path, "exact")
    scaled_set, scaled = tiles_of(slide_40x, tiles_path, "scaled")
    assert exact.shape[1:] == (448, 448, 3) and scaled.shape[1:] == (224, 224, 3)
    assert exact_set.read_attributes == {"decode": "exact", "decode_shrink": 1}
    assert scaled_set.read_attributes == {"decode": "scaled", "decode_shrink": 2}
    means = exact.reshape(len(exact), 224, 2, 224, 2, 3).mean(axis=(2, 4))
    for reference, mean, p99 in [
        (means, BOX_MEAN, BOX_P99),
        (as_the_model_gets_it(exact, 224), MODEL_MEAN, MODEL_P99),
    ]:
        difference = np.abs(reference - scaled)
        assert difference.mean() <= mean and np.percentile(difference, 99) <= p99
    # The same tile from each, not a neighbour: a shifted grid differs by far more.
    shifted = np.abs(as_the_model_gets_it(exact[1:], 224) - scaled[:-1]).mean()
    assert shifted > 4 * difference.mean()


@pytest.fixture(scope="module")
def slide_40x_j2k(tmp_path_factory) -> Path:
    """slide_40x's tissue as Aperio's RGB JPEG 2000 tiles."""
    path = tmp_path_factory.mktemp("slides") / "forty_j2k.svs"
    shapes = random_blobs(8000, 6000, count=12, seed=3)
    return write_slide(path, 8000, 6000, shapes, mpp=0.25, levels=3, seed=3, codec="JPEG 2000")


def test_jpeg_2000_tiles_decode_at_reduced_resolution(tmp_path, slide_40x_j2k):
    tiles_path = tiled(slide_40x_j2k, tmp_path)
    _, exact = tiles_of(slide_40x_j2k, tiles_path, "exact")
    scaled_set, scaled = tiles_of(slide_40x_j2k, tiles_path, "scaled")
    assert scaled_set.read_attributes == {"decode": "scaled", "decode_shrink": 2}
    assert scaled.shape[1:] == (224, 224, 3)
    model_input = as_the_model_gets_it(exact, 224)
    difference = np.abs(model_input - scaled)
    assert difference.mean() <= J2K_MEAN and np.percentile(difference, 99) <= J2K_P99
    # The same colours, within a grey level or two (1.5 in blue here: the full picture's
    # noise is clipped at 0 and 255, its low-pass band less so).
    colours = model_input.mean(axis=(0, 1, 2)) - scaled.mean(axis=(0, 1, 2))
    assert np.abs(colours).max() <= 2.0
    shifted = np.abs(model_input[1:] - scaled[:-1]).mean()
    assert shifted > 4 * difference.mean()


def test_what_cannot_be_decoded_scaled_is_read_exactly(tmp_path, slide_40x):  # noqa: F811
    tiles_path = tiled(slide_40x, tmp_path)
    table = read_tiles(tiles_path)[0]
    odd = table[["x", "y"]].to_numpy(np.int64)[:20] + 1  # off the half-resolution grid
    dataset, tiles = tiles_of(slide_40x, tiles_path, "scaled", odd)
    assert dataset.plan.shrink == 1 and tiles.shape[1:] == (448, 448, 3)
    assert dataset.read_attributes == {"decode": "scaled", "decode_shrink": 1}


@pytest.mark.parametrize(
    ("tile_px", "size", "shrink"),
    [(448, 224, 2), (896, 224, 4), (1792, 224, 8), (900, 224, 4), (446, 224, 1), (224, 224, 1)],
)
def test_the_plan_shrinks_as_far_as_the_model_allows(tile_px, size, shrink):
    geometry = replace(GEOMETRY, size=size, size_level0=tile_px)
    plan = ReadPlan.from_geometry(geometry, "scaled")
    assert plan.shrink == shrink and plan.tile_px == tile_px // shrink
    assert plan.exact() == ReadPlan.from_geometry(geometry) == ReadPlan(0, 1.0, tile_px)


@pytest.mark.real_slides
@pytest.mark.skipif(not REAL_RGB_SLIDE.is_file(), reason="needs ../shared/slides")
def test_aperio_rgb_tiles_keep_their_colours_and_a_guess_gone_wrong_is_refused(monkeypatch):
    """Aperio's photometric-RGB JPEG tiles decode scaled with their colours (the Adobe
    marker); without it libjpeg-turbo would take them for YCbCr, and the level's probe
    then refuses the scaled path."""
    from slidesnake.slides import jpeg_streams

    with Slide(REAL_RGB_SLIDE) as slide:
        exact, scaled = slide.tiled_level(0), slide.tiled_level(0, 2)
        full, small = exact.read(480, 480, 480, 480), scaled.read(240, 240, 240, 240)
    means = full.reshape(240, 2, 240, 2, 3).mean(axis=(1, 3))
    assert np.abs(small - means).mean() < 0.5
    monkeypatch.setattr(jpeg_streams, "_ADOBE_RGB", b"")
    with Slide(REAL_RGB_SLIDE) as slide:
        assert slide.tiled_level(0, 2) is None and slide.tiled_level(0) is not None


@pytest.mark.real_slides
@pytest.mark.skipif(not REAL_J2K_SLIDE.is_file(), reason="needs ../shared/slides")
def test_a_real_jpeg_2000_scan_keeps_its_colours_at_reduced_resolution():
    with Slide(REAL_J2K_SLIDE, mpp=0.25) as slide:
        full = slide.tiled_level(0).read(1024, 1024, 1024, 1024)
        small = slide.tiled_level(0, 2).read(512, 512, 512, 512)
    means = full.reshape(512, 2, 512, 2, 3).mean(axis=(1, 3))
    assert np.abs(means.mean(axis=(0, 1)) - small.mean(axis=(0, 1))).max() < 0.5
    assert np.corrcoef(means.ravel(), small.ravel())[0, 1] > 0.98


def store(folder: Path, attributes: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "zarr.json").write_text(json.dumps({"attributes": attributes}))


def test_a_cohort_keeps_the_method_its_embeddings_were_read_with(tmp_path):
    slides = tmp_path / "results" / "slides"
    assert cohort_decode(None, slides) == "scaled"  # a new cohort
    store(slides / "a" / "embeddings.zarr", {"slide_id": "a"})  # before the method existed
    assert cohort_decode(None, slides) == "exact"
    assert cohort_decode("scaled", slides) == "scaled"  # the config always wins
    other = tmp_path / "other" / "slides"
    store(other / "b" / "uni" / "embeddings.zarr", {"decode": "scaled"})  # several models
    assert cohort_decode(None, other) == "scaled"


def test_only_a_scaled_method_enters_the_params(tmp_path):
    config = {"model": {"name": "timm:test_vit"}, "loader": {"decode": "exact"}}
    assert "decode" not in embedding_params(config)
    config["loader"]["decode"] = "scaled"
    assert embedding_params(config)["decode"] == "scaled"


GEOMETRY = TileGeometry(
    slide_mpp=0.25, target_mpp=0.5, size=224, stride=224, size_level0=448, stride_level0=448,
    read_level=0, read_downsample=1.0, mask_threshold=0.5, slide_width=8000, slide_height=6000,
)  # fmt: skip


def test_a_scaled_mask_is_the_exact_mask_and_says_how_it_was_read(tmp_path, slide_40x):  # noqa: F811
    from slidesnake.tiling.mask_file import load_mask, mask_decode
    from slidesnake.tiling.stages import make_tissue_mask
    from slidesnake.tiling.tissue import TissueParams

    masks = {}
    for decode in ("exact", "scaled"):
        path = tmp_path / decode / "tissue_mask.png"
        path.parent.mkdir()
        make_tissue_mask(slide_40x, "s", path, tmp_path / decode / "qc.png", TissueParams(),
                         decode=decode)  # fmt: skip
        masks[decode] = load_mask(path)
        assert mask_decode(path) == masks[decode].decode == decode
    exact, scaled = masks["exact"], masks["scaled"]
    assert exact.geometry() == scaled.geometry()
    assert (exact.mask == scaled.mask).mean() > 0.99 and exact.mask.any()
    # A cohort masked but not yet embedded keeps its masks' method, exact for a mask
    # written before the method was recorded.
    (tmp_path / "exact" / "tissue_mask.png").unlink()
    assert cohort_decode(None, tmp_path) == "scaled"
    old = tmp_path / "scaled" / "tissue_mask.png"
    Image.open(old).save(old)  # pixels kept, text chunks dropped
    assert cohort_decode(None, tmp_path) == "exact"


def test_a_scaled_method_enters_the_mask_params_only_when_scaled():
    from slidesnake.cohort.rule_params import tissue_params

    config = {"tissue": {}, "artefacts": {}, "loader": {"decode": None}}
    assert "decode" not in tissue_params(config)
    config["loader"]["decode"] = "scaled"
    assert tissue_params(config)["decode"] == "scaled"
