"""Tile coordinates from other tools: TRIDENT's and CLAM's .h5, CSV and parquet, checked,
and a round trip through `export-h5` that gives the same tiles and embeddings."""

from __future__ import annotations

import logging

import h5py
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ChannelGrid, embed_one

from slidesnake import export_h5, load_embeddings
from slidesnake.embed.settings import EmbedSettings
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.imported import CoordsError
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams

SIZE = 448  # level-0 px of the 224 px tiles at 0.5 µm/px on the 0.25 µm/px rect slide


@pytest.fixture(scope="module")
def rect_run(tmp_path_factory, rect_slide):
    """The rect slide masked, tiled on the grid and embedded with the informative model."""
    out = tmp_path_factory.mktemp("grid")
    make_tissue_mask(rect_slide, "rect", out / "mask.png", out / "qc.png", TissueParams())
    tile(rect_slide, out, out / "tiles.parquet")
    model = out / "grid.pt"
    torch.jit.save(torch.jit.script(ChannelGrid()), str(model))
    embed(rect_slide, out / "tiles.parquet", out / "embeddings.zarr", model)
    return out


def tile(slide, out, tiles_path, coords=None):
    make_tile_coords(
        slide, "rect", out / "mask.png", out / "qc.png", tiles_path,
        tiles_path.with_suffix(".png"), TileParams(), coords_path=coords,
    )  # fmt: skip
    return read_tiles(tiles_path)


def embed(slide, tiles_path, zarr_path, model):
    settings = EmbedSettings(model="custom", checkpoint=str(model), precision="fp32",
                             workers=1, output_dtype="float32")  # fmt: skip
    embed_one(slide, "rect", tiles_path, zarr_path, zarr_path.with_suffix(".json"), settings)


def test_coordinates_exported_then_imported_give_the_same_tiles_and_embeddings(
    rect_slide, rect_run, tmp_path
):
    export_h5(rect_run / "embeddings.zarr", tmp_path / "rect.h5")
    tiles, geometry = tile(rect_slide, rect_run, tmp_path / "tiles.parquet", tmp_path / "rect.h5")
    grid, _ = read_tiles(rect_run / "tiles.parquet")
    np.testing.assert_array_equal(tiles[["x", "y"]], grid[["x", "y"]])
    np.testing.assert_allclose(tiles["tissue_fraction"], grid["tissue_fraction"], atol=1e-6)
    assert geometry.coords_source == str((tmp_path / "rect.h5").resolve())
    embed(rect_slide, tmp_path / "tiles.parquet", tmp_path / "e.zarr", rect_run / "grid.pt")
    features, coords, attrs = load_embeddings(tmp_path / "e.zarr")
    expected, expected_coords, _ = load_embeddings(rect_run / "embeddings.zarr")
    np.testing.assert_array_equal(coords, expected_coords)
    np.testing.assert_array_equal(features, expected)
    assert attrs["tile_coords_source"].endswith("rect.h5")


def test_clams_h5_gives_its_tile_size_from_patch_level_and_size(rect_slide, rect_run, tmp_path):
    grid, _ = read_tiles(rect_run / "tiles.parquet")
    with h5py.File(tmp_path / "clam.h5", "w") as f:
        dataset = f.create_dataset("coords", data=grid[["x", "y"]].to_numpy()[::-1])
        dataset.attrs.update({"patch_level": 1, "patch_size": SIZE // 4})  # level 1: 4x
    tiles, _ = tile(rect_slide, rect_run, tmp_path / "tiles.parquet", tmp_path / "clam.h5")
    np.testing.assert_array_equal(tiles[["x", "y"]], grid[["x", "y"]].to_numpy()[::-1])


def test_duplicates_are_dropped_with_a_warning(rect_slide, rect_run, tmp_path, caplog):
    pd.DataFrame({"x": [2240, 2688, 2240], "y": [1792, 1792, 1792]}).to_csv(
        tmp_path / "c.csv", index=False
    )
    with caplog.at_level(logging.WARNING):
        tiles, _ = tile(rect_slide, rect_run, tmp_path / "tiles.parquet", tmp_path / "c.csv")
    assert list(tiles["x"]) == [2240, 2688] and "1 duplicate tiles" in caplog.text
    grid = read_tiles(rect_run / "tiles.parquet")[0].set_index(["x", "y"])["tissue_fraction"]
    expected = [grid[(2240, 1792)], grid[(2688, 1792)]]  # the grid's own fractions
    np.testing.assert_allclose(tiles["tissue_fraction"], expected, atol=1e-6)


@pytest.mark.parametrize(
    ("x", "y", "attrs", "message"),
    [
        ([0, 9000], [0, 0], {}, "1 of 2 tiles lie outside the slide"),
        ([0.5], [0], {}, "not whole level-0 pixels"),
        ([0], [0], {"patch_size_level0": 512}, "tiles are 512 level-0 px but .* give 448 px"),
    ],
)
def test_coordinates_that_do_not_fit_fail_the_slide_with_its_line(
    rect_slide, rect_run, tmp_path, x, y, attrs, message
):
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        f.create_dataset("coords", data=np.stack([x, y], axis=1)).attrs.update(attrs)
    with pytest.raises(CoordsError, match=message) as error:
        tile(rect_slide, rect_run, tmp_path / "tiles.parquet", tmp_path / "bad.h5")
    assert str(error.value).startswith("slide 'rect' (") and "Fix: " in str(error.value)
