"""The embedding stage against the model itself, and the store it writes.

The reference reads every tile on its own, with one OpenSlide read_region, and applies the
resize and normalisation written out here; the pipeline reads supertiles in worker
processes and preprocesses batches. The model is informative: the mean of each colour
channel over a 4 x 4 grid of the tile, so a wrong pixel, position, tile, row order or
channel order changes the features.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from pathlib import Path

import h5py
import numpy as np
import openslide
import pytest
import torch
import torch.nn.functional as F
from conftest import ChannelGrid, embed_one

from slidesnake import ModelError, export_h5, load_embeddings
from slidesnake.embed.progress import Progress
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.loader.batches import ReadPlan
from slidesnake.slides.synthetic import random_blobs, write_slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles, write_tiles
from slidesnake.tiling.tissue import TissueParams

# embed_slide runs on CUDA where there is one: the reference follows its resize path.
ON_CPU = not torch.cuda.is_available()
MEAN = (0.6, 0.5, 0.7)
STD = (0.2, 0.25, 0.15)


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "channel_grid.pt"
    torch.jit.save(torch.jit.script(ChannelGrid()), str(path))
    return str(path)


def settings(grid_model: str, **overrides) -> EmbedSettings:
    values = {
        "model": "custom",
        "checkpoint": grid_model,
        "mean": MEAN,
        "std": STD,
        "precision": "fp32",
        "output_dtype": "float32",
        "workers": 2,
        "batch_size": 7,  # odd: batches straddle supertiles
        "block": 3,
        **overrides,
    }
    return EmbedSettings(**values)


def tile_slide(slide, out, sheet_mpp=None):
    out.mkdir(parents=True, exist_ok=True)
    make_tissue_mask(
        slide, "s", out / "mask.png", out / "qc_mask.png", TissueParams(), sheet_mpp=sheet_mpp
    )
    make_tile_coords(
        slide,
        "s",
        out / "mask.png",
        out / "qc_mask.png",
        out / "tiles.parquet",
        out / "qc_tiles.png",
        TileParams(),
    )
    return out / "tiles.parquet"


def embed(slide, tiles, out, embed_settings):
    metrics = embed_one(
        slide, "s", tiles, out / "embeddings.zarr", out / "metrics.json", embed_settings
    )
    return (*load_embeddings(out / "embeddings.zarr"), metrics)


def reference(slide_path, tiles_path, rows, channels=(0, 1, 2), cpu=ON_CPU) -> torch.Tensor:
    """The model on tiles read one by one, resized and normalised as written here: on a
    CPU the resize runs on uint8 pixels, on a GPU on floats."""
    tiles, geometry = read_tiles(tiles_path)
    plan = ReadPlan.from_geometry(geometry)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    out = []
    with openslide.OpenSlide(str(slide_path)) as osr:
        for x, y in tiles[["x", "y"]].to_numpy()[rows]:
            region = osr.read_region((int(x), int(y)), plan.level, (plan.tile_px, plan.tile_px))
            rgb = np.asarray(region.convert("RGB"))[..., list(channels)]
            pixels = torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None]
            size = (geometry.size, geometry.size)
            pixels = pixels if cpu else pixels.float()
            pixels = F.interpolate(pixels, size, mode="bilinear", antialias=True).float()
            out.append(ChannelGrid()((pixels / 255 - mean) / std))
    return torch.cat(out)


def check_against_reference(slide, tiles_path, features, coords, count=12, cpu=ON_CPU):
    tiles, geometry = read_tiles(tiles_path)
    np.testing.assert_array_equal(coords, tiles[["x", "y"]].to_numpy())
    rows = np.random.default_rng(0).choice(len(tiles), size=min(count, len(tiles)), replace=False)
    expected = reference(slide, tiles_path, rows, cpu=cpu)
    # At a level whose downsample is not a whole number (2.0005 in the TCGA slide), a tile
    # starts between two pixels. read_region then resamples the tile at that sub-pixel
    # offset, while a supertile is cut at the nearest whole pixel: up to half a pixel of
    # shift, ~0.004 here. A tile out of place or a channel swap is over 0.05.
    atol = 2e-5 if float(geometry.read_downsample).is_integer() else 0.01
    torch.testing.assert_close(torch.from_numpy(features[rows]), expected, atol=atol, rtol=1e-5)
    # The check can fail: tiles differ from each other, and so do R and B.
    assert expected.std(dim=0).mean() > 0.05
    swapped = reference(slide, tiles_path, rows, channels=(2, 1, 0), cpu=cpu)
    assert (torch.from_numpy(features[rows]) - swapped).abs().max() > 0.05


@pytest.fixture(scope="module")
def blob_40x(tmp_path_factory) -> Path:
    """A 0.25 µm/px Aperio slide: 0.5 µm/px tiles are read at level 0 and resized 2x."""
    path = tmp_path_factory.mktemp("slides") / "blobs-40x.svs"
    shapes = random_blobs(8000, 6000, count=4, seed=3)
    return write_slide(path, 8000, 6000, shapes, mpp=0.25, levels=3, seed=3)


@pytest.mark.parametrize(("slide", "tile_px"), [("blob_40x", 448), ("blob_slide", 224)])
def test_pipeline_equals_the_model_on_tiles_read_one_by_one(
    request, tmp_path, grid_model, slide, tile_px
):
    slide = request.getfixturevalue(slide)
    tiles_path = tile_slide(slide, tmp_path)
    features, coords, _, _ = embed(slide, tiles_path, tmp_path, settings(grid_model))
    assert ReadPlan.from_geometry(read_tiles(tiles_path)[1]).tile_px == tile_px
    assert features.shape == (len(coords), 48) and features.dtype == np.float32
    assert len(coords) > 20
    check_against_reference(slide, tiles_path, features, coords)


@pytest.mark.real_slides
@pytest.mark.parametrize(
    ("name", "sheet_mpp", "level"),
    [
        ("CMU-1-Small-Region.svs", None, 0),  # JPEG, 0.499 µm/px: no resize
        ("tcga-cr-7395-01a-01-ts1.svs", 0.25, 1),  # JPEG 2000, read from level 1
    ],
)
def test_real_slides_equal_the_model_on_tiles_read_one_by_one(
    tmp_path, shared_slides, grid_model, name, sheet_mpp, level
):
    slide = shared_slides / name
    tiles_path = tile_slide(slide, tmp_path, sheet_mpp)
    assert read_tiles(tiles_path)[1].read_level == level
    features, coords, _, _ = embed(slide, tiles_path, tmp_path, settings(grid_model))
    check_against_reference(slide, tiles_path, features, coords)


@pytest.fixture(scope="module")
def blob_tiles(tmp_path_factory, blob_slide) -> Path:
    return tile_slide(blob_slide, tmp_path_factory.mktemp("blob-tiles"))


def test_rows_do_not_depend_on_workers_batches_or_blocks(
    tmp_path, blob_slide, blob_tiles, grid_model
):
    one = embed(blob_slide, blob_tiles, tmp_path / "a", settings(grid_model, workers=0))
    many = embed(
        blob_slide,
        blob_tiles,
        tmp_path / "b",
        settings(grid_model, workers=2, batch_size=5, block=2),
    )
    np.testing.assert_array_equal(one[0], many[0])


def test_float16_features_are_the_float32_ones_rounded(
    tmp_path, blob_slide, blob_tiles, grid_model
):
    full = embed(blob_slide, blob_tiles, tmp_path / "a", settings(grid_model))[0]
    half = embed(
        blob_slide, blob_tiles, tmp_path / "b", settings(grid_model, output_dtype="float16")
    )
    assert half[0].dtype == np.float16
    np.testing.assert_array_equal(half[0], full.astype(np.float16))


def test_store_records_where_its_rows_came_from(tmp_path, blob_slide, blob_tiles, grid_model):
    features, coords, attrs, metrics = embed(blob_slide, blob_tiles, tmp_path, settings(grid_model))
    _, geometry = read_tiles(blob_tiles)
    assert attrs["slide_id"] == "s"
    assert attrs["slide_path"] == str(blob_slide.resolve())
    assert attrs["slide_bytes"] == blob_slide.stat().st_size
    assert attrs["tile_size"] == 224 and attrs["target_mpp"] == 0.5
    assert attrs["patch_size_level0"] == geometry.size_level0
    assert attrs["model"] == "custom" and attrs["embedding_dim"] == 48
    assert len(attrs["weights_sha256"]) == 64
    assert attrs["precision"] == "float32"
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    assert metrics["tiles"] == len(coords) == len(features)
    assert metrics["tiles_per_s"] == pytest.approx(len(coords) / metrics["wall_s"], rel=0.01)
    assert 0 <= metrics["loader_wait_fraction"] <= 1
    assert metrics["peak_host_mb"] > 0 and metrics["device"] == ("cpu" if ON_CPU else "cuda")
    assert not list(tmp_path.glob("*.tmp*")), "no temporary output is left behind"
    # The fixed cost, from the process's start: this test process began before the test.
    parts = [metrics[k] for k in ("model_build_s", "weights_load_s", "to_device_s", "width_s")]
    assert metrics["startup_s"] > metrics["imports_s"] > 0 and min(parts) >= 0
    assert metrics["width_s"] > 0  # a program's width: one tile through it
    assert metrics["startup_s"] >= metrics["imports_s"] + metrics["first_batch_after_model_s"]
    assert metrics["job_s"] > metrics["startup_s"]
    # The model's own time (CUDA events on a GPU): inside the loop, a share of the job.
    assert 0 < metrics["model_s"] <= metrics["wall_s"]
    assert metrics["model_busy_fraction"] == pytest.approx(
        metrics["model_s"] / metrics["job_s"], abs=1e-3
    )
    assert attrs["timings"]["startup_s"] == pytest.approx(metrics["startup_s"], abs=1e-3)


def test_export_gives_the_h5_layout_trident_and_clam_read(
    tmp_path, blob_slide, blob_tiles, grid_model
):
    features, coords, _, _ = embed(blob_slide, blob_tiles, tmp_path, settings(grid_model))
    export_h5(tmp_path / "embeddings.zarr", tmp_path / "s.h5")
    with h5py.File(tmp_path / "s.h5") as f:
        np.testing.assert_array_equal(f["features"][:], features)
        np.testing.assert_array_equal(f["coords"][:], coords)
        assert f["coords"].attrs["patch_size_level0"] == 224


def test_a_slide_without_tiles_gives_a_valid_empty_store(
    tmp_path, blob_slide, blob_tiles, grid_model
):
    tiles, geometry = read_tiles(blob_tiles)
    write_tiles(tiles.iloc[:0], geometry, tmp_path / "none.parquet")
    features, coords, attrs, metrics = embed(
        blob_slide, tmp_path / "none.parquet", tmp_path, settings(grid_model)
    )
    assert features.shape == (0, 48) and coords.shape == (0, 2)
    assert attrs["slide_id"] == "s" and metrics["tiles"] == 0


def test_a_bad_checkpoint_fails_the_job_with_its_own_error_and_stops_the_loader(
    tmp_path, blob_slide, blob_tiles
):
    """The loader workers start while the model loads; a model that cannot load still
    fails the job with the checkpoint's error, stops the workers and writes nothing."""
    broken = tmp_path / "model.safetensors"
    broken.write_bytes(b"\x00" * 100)
    with pytest.raises(ModelError, match="corrupt or truncated"):
        embed(
            blob_slide,
            blob_tiles,
            tmp_path,
            EmbedSettings(model="timm:test_vit", checkpoint=str(broken), workers=2),
        )
    assert not (tmp_path / "embeddings.zarr").exists()
    assert multiprocessing.active_children() == []


def test_the_writer_assembles_rows_that_arrive_out_of_order(tmp_path):
    rng = np.random.default_rng(0)
    expected = rng.normal(size=(23, 4)).astype(np.float32)
    writer = EmbeddingWriter(
        tmp_path / "e.zarr", np.zeros((23, 2), np.int64), 4, "float32", chunk_rows=5
    )
    order = rng.permutation(23)
    for rows in np.array_split(order, 4):
        writer.put(rows, expected[rows])
    writer.finish({"k": 1})
    features, _, attrs = load_embeddings(tmp_path / "e.zarr")
    np.testing.assert_array_equal(features, expected)
    assert attrs == {"k": 1}


def test_the_writer_refuses_to_finish_with_rows_missing(tmp_path):
    writer = EmbeddingWriter(
        tmp_path / "e.zarr", np.zeros((10, 2), np.int64), 4, "float32", chunk_rows=4
    )
    writer.put(np.arange(9), np.zeros((9, 4), np.float32))
    with pytest.raises(RuntimeError, match="only 8 of 10"):
        writer.finish({})


def test_the_watchdog_says_what_is_stuck(caplog):
    caplog.set_level(logging.INFO)
    with Progress(total=100, every_s=0.1, watchdog_s=0.3) as progress:
        progress.advance(10)
        progress.state("waiting for the loader")
        time.sleep(0.8)
    assert "10/100 tiles" in caplog.text
    assert "no batch has finished for" in caplog.text
    assert "the model loop is waiting for the loader" in caplog.text
