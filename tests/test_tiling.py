import logging

import numpy as np
import pandas as pd
import pytest
from conftest import RECT_SLIDE, RECT_TILES, RECT_TISSUE

from slidesnake.slides.synthetic import write_slide
from slidesnake.tiling.grid import TileParams, tissue_fractions
from slidesnake.tiling.mask_file import TissueMask, load_mask
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams


def tile(slide, out, **params):
    """Mask (once) and tile a slide into `out`; return the table and its geometry."""
    if not (out / "tissue_mask.png").exists():
        make_tissue_mask(
            slide, slide.stem, out / "tissue_mask.png", out / "qc_mask.png", TissueParams()
        )
    name = "tiles-" + "-".join(f"{k}{v}" for k, v in params.items())
    make_tile_coords(
        slide,
        slide.stem,
        out / "tissue_mask.png",
        out / "qc_mask.png",
        out / f"{name}.parquet",
        out / f"{name}.png",
        TileParams(**params),
    )
    return read_tiles(out / f"{name}.parquet")


@pytest.fixture(scope="module")
def rect_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rect")


@pytest.fixture(scope="module")
def blob_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("blobs")


def test_tile_count_on_a_known_rectangle_is_analytic(rect_slide, rect_dir):
    tiles, geometry = tile(rect_slide, rect_dir)
    assert geometry.size_level0 == geometry.stride_level0 == 448  # 224 px at 0.5 from 0.25
    cols, rows = RECT_TILES
    assert len(tiles) == cols * rows
    expected_x = RECT_TISSUE.x0 + 448 * np.arange(cols)
    expected_y = RECT_TISSUE.y0 + 448 * np.arange(rows)
    assert tiles["x"].tolist() == np.tile(expected_x, rows).tolist()  # row-major
    assert tiles["y"].tolist() == np.repeat(expected_y, cols).tolist()
    assert tiles["tissue_fraction"].min() > 0.95


def test_coordinates_lie_inside_the_slide(blob_slide, blob_dir):
    tiles, geometry = tile(blob_slide, blob_dir, mask_threshold=0.0)
    assert tiles["x"].dtype == np.int64 and tiles["y"].dtype == np.int64
    assert (tiles["x"] >= 0).all() and (tiles["y"] >= 0).all()
    assert (tiles["x"] + geometry.size_level0 <= geometry.slide_width).all()
    assert (tiles["y"] + geometry.size_level0 <= geometry.slide_height).all()
    full_grid = (6000 // 224) * (4500 // 224)  # threshold 0 keeps every whole tile
    assert len(tiles) == full_grid


def test_stride_smaller_than_size_overlaps_by_the_difference(rect_slide, rect_dir):
    tiles, geometry = tile(rect_slide, rect_dir, stride=112, mask_threshold=0.9)
    assert geometry.stride_level0 == 224 and geometry.size_level0 == 448
    # whole tiles inside the 4480 x 3584 rectangle, starting every 224 level-0 px
    cols, rows = (4480 - 448) // 224 + 1, (3584 - 448) // 224 + 1
    assert len(tiles) == cols * rows
    first_row = tiles[tiles["y"] == tiles["y"].min()]["x"].to_numpy()
    assert (np.diff(first_row) == 224).all()


def test_raising_the_threshold_never_adds_tiles(blob_slide, blob_dir):
    previous = None
    for threshold in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0):
        tiles, _ = tile(blob_slide, blob_dir, mask_threshold=threshold)
        kept = set(zip(tiles["x"], tiles["y"], strict=True))
        if previous is not None:
            assert kept <= previous
        previous = kept
    assert 0 < len(previous) < (6000 // 224) * (4500 // 224)


def test_slide_without_tissue_gives_an_empty_table_and_a_warning(tmp_path, caplog):
    slide = write_slide(tmp_path / "glass.svs", 4096, 3072, [], mpp=0.25, levels=3)
    with caplog.at_level(logging.WARNING):
        tiles, geometry = tile(slide, tmp_path)
    assert tiles.empty and list(tiles.columns) == ["x", "y", "tissue_fraction"]
    assert tiles["x"].dtype == np.int64
    assert geometry.read_level == 0
    assert "no tile reaches mask_threshold" in caplog.text


def test_geometry_is_stored_with_the_table(rect_slide, rect_dir):
    _, geometry = tile(rect_slide, rect_dir, mpp=1.0, size=256)
    assert (geometry.slide_mpp, geometry.target_mpp) == (0.25, 1.0)
    assert (geometry.size, geometry.stride) == (256, 256)
    assert (geometry.size_level0, geometry.read_level) == (1024, 1)
    assert geometry.read_downsample == pytest.approx(4.0)
    assert geometry.mask_threshold == 0.5
    assert (geometry.slide_width, geometry.slide_height) == (
        RECT_SLIDE["width"],
        RECT_SLIDE["height"],
    )


def test_mask_records_its_resolution(rect_slide, rect_dir):
    tile(rect_slide, rect_dir)
    mask = load_mask(rect_dir / "tissue_mask.png")
    assert mask.mpp == pytest.approx(8.0)
    assert mask.read_level == 2  # the 4 µm/px level, never level 0
    assert mask.mask.shape == (RECT_SLIDE["height"] // 32, RECT_SLIDE["width"] // 32)


def test_fractions_are_exact_areas_at_fractional_scales():
    rng = np.random.default_rng(0)
    pixels = rng.random((40, 50)) > 0.5
    mask = TissueMask(pixels, 3.3, 3.3, 3.3, 1.0, 165, 132, 0)
    xs, ys = np.array([0, 7, 40, 120]), np.array([0, 13, 99])
    got = tissue_fractions(mask, xs, ys, size=33)
    # brute force: upsample the mask 10x, so that 3.3 level-0 px = 33 fine px
    fine = np.repeat(np.repeat(pixels, 33, axis=0), 33, axis=1)
    for i, y in enumerate(ys):
        for j, x in enumerate(xs):
            block = fine[y * 10 : (y + 33) * 10, x * 10 : (x + 33) * 10]
            assert got[i, j] == pytest.approx(block.mean(), abs=1e-9)


def test_tile_table_round_trips_through_parquet(rect_slide, rect_dir):
    tiles, _ = tile(rect_slide, rect_dir)
    assert isinstance(tiles, pd.DataFrame)
    assert tiles.dtypes.to_dict() == {
        "x": np.dtype("int64"),
        "y": np.dtype("int64"),
        "tissue_fraction": np.dtype("float32"),
    }
