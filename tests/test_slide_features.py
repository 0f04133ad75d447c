"""Slide-level features, the slide encoder hook and the embedding map, on stores the tests
write themselves and on the rect slide's real tiles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openslide
import pandas as pd
import pytest
import torch
from conftest import ChannelGrid, embed_one

from slidesnake.aggregate.cohort_projection import draw_cohort_projection
from slidesnake.aggregate.embedding_map import RANDOM_WEIGHTS_NOTE, draw_embedding_map
from slidesnake.aggregate.encoder import encode_slide
from slidesnake.aggregate.pooling import POOLINGS, pool_features
from slidesnake.aggregate.slide_table import slide_features
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.errors import ConfigError, ModelError
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.mask_file import load_mask
from slidesnake.tiling.qc import load_picture
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams


def write_store(path: Path, features: np.ndarray, coords=None, dtype="float32", **attrs) -> Path:
    coords = np.zeros((len(features), 2), np.int64) if coords is None else coords
    writer = EmbeddingWriter(path, coords, features.shape[1], dtype, chunk_rows=7)
    if len(features):
        writer.put(np.arange(len(features)), features)
    writer.finish({"model": "test", **attrs})
    return path


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pooled_features_are_numpys_over_the_stored_features(tmp_path, dtype):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(50, 9)).astype(dtype)  # 50 rows: chunks of 7, the last short
    weights = rng.uniform(0.5, 1.0, 50)
    store = write_store(tmp_path / "e.zarr", features, dtype=dtype)
    pooled = pool_features(store, POOLINGS, weights)
    stored = features.astype(np.float64)
    expected = {
        "mean": stored.mean(0),
        "max": stored.max(0),
        "median": np.median(stored, 0),
        "sum": stored.sum(0),
        "tissue_weighted_mean": (weights[:, None] * stored).sum(0) / weights.sum(),
    }
    for name, value in expected.items():
        assert pooled[name].dtype == np.float32
        np.testing.assert_allclose(pooled[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def test_an_unknown_pooling_is_a_config_error(tmp_path):
    store = write_store(tmp_path / "e.zarr", np.ones((3, 2), np.float32))
    with pytest.raises(ConfigError, match=r"slide.pooling \['mode'\] unknown"):
        pool_features(store, ["mean", "mode"])


def test_a_slide_without_tiles_gets_rows_with_its_count_and_no_features(tmp_path):
    store = write_store(tmp_path / "e.zarr", np.zeros((0, 4), np.float32))
    table = slide_features("empty", store, tmp_path / "unused.parquet", ["mean", "max"])
    assert list(table["pooling"]) == ["mean", "max"] and list(table["tiles"]) == [0, 0]
    assert table.filter(regex=r"^f\d+$").isna().all().all()
    assert list(table.columns[-4:]) == ["f0000", "f0001", "f0002", "f0003"]


class SlideEncoder(torch.nn.Module):
    """A stand-in for a slide encoder: attention-free, but it uses both inputs."""

    def forward(self, features: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        centre = coords.mean(dim=0)
        return torch.cat([features.max(dim=0).values, centre / 1000.0])


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("encoder") / "encoder.pt"
    torch.jit.save(torch.jit.script(SlideEncoder()), str(path))
    return path


def test_the_slide_encoder_hook_gives_the_programs_output(tmp_path, encoder):
    rng = np.random.default_rng(1)
    features = rng.normal(size=(20, 5)).astype(np.float32)
    coords = rng.integers(0, 50_000, size=(20, 2))
    store = write_store(tmp_path / "e.zarr", features, coords)
    expected = np.concatenate([features.max(0), coords.mean(0) / 1000.0])
    np.testing.assert_allclose(encode_slide(encoder, store), expected, rtol=1e-5)
    table = slide_features("s", store, tmp_path / "unused.parquet", ["mean"], encoder)
    assert list(table["pooling"]) == ["mean", "encoder"]
    vectors = table.filter(regex=r"^f\d+$").to_numpy()
    np.testing.assert_allclose(vectors[1], expected, rtol=1e-5)
    np.testing.assert_allclose(vectors[0, :5], features.mean(0), rtol=1e-5)
    assert np.isnan(vectors[0, 5:]).all()  # the mean is narrower than the encoder's vector


def test_a_slide_encoder_that_does_not_take_coordinates_fails_with_what_it_must_take(tmp_path):
    path = tmp_path / "one-input.pt"
    torch.jit.save(torch.jit.script(torch.nn.Identity()), str(path))
    store = write_store(tmp_path / "e.zarr", np.ones((3, 2), np.float32))
    with pytest.raises(ModelError, match=r"fails on .* it must take both"):
        encode_slide(path, store)


@pytest.fixture(scope="module")
def rect_stage(tmp_path_factory, rect_slide) -> Path:
    out = tmp_path_factory.mktemp("rect-map")
    args = (rect_slide, "rect", out / "tissue_mask.png", out / "qc_mask.png")
    make_tissue_mask(*args, TissueParams())
    make_tile_coords(*args, out / "tiles.parquet", out / "qc_tiles.png", TileParams())
    return out


def test_the_embedding_map_colours_two_kinds_of_tile_apart(tmp_path, rect_stage):
    """Tiles on the left half get features near one vector, on the right near another: the
    map must paint the halves in clearly different colours, and leave glass faded."""
    tiles, geometry = read_tiles(rect_stage / "tiles.parquet")
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    left = coords[:, 0] < np.median(coords[:, 0])
    rng = np.random.default_rng(2)
    features = rng.normal(0, 0.05, size=(len(coords), 16)).astype(np.float32)
    features[left, 0] += 3.0
    store = write_store(tmp_path / "e.zarr", features, coords, weights="random")
    out = tmp_path / "embedding_map.png"
    draw_embedding_map(
        store, rect_stage / "tiles.parquet", rect_stage / "tissue_mask.png",
        rect_stage / "qc_mask.png", out,
    )  # fmt: skip
    picture = load_picture(out).astype(int)
    thumbnail = load_picture(rect_stage / "qc_mask.png")
    assert picture.shape == thumbnail.shape
    mask = load_mask(rect_stage / "tissue_mask.png")
    centres = (coords + geometry.size_level0 // 2) / [mask.scale_x, mask.scale_y]
    centres = centres.astype(int)
    colours = picture[centres[:, 1], centres[:, 0]]
    gap = np.abs(colours[left].mean(0) - colours[~left].mean(0)).max()
    assert gap > 150  # the first component separates the halves: opposite ends of a channel
    assert colours[left].std(0).max() < 40 and colours[~left].std(0).max() < 40
    assert picture[-1, -1].min() > 150  # glass, away from the tiles: faded, light
    assert (picture[2:12, :40] == [190, 30, 30]).all(axis=-1).any()  # the random-weights note
    assert RANDOM_WEIGHTS_NOTE.startswith("RANDOM")


def test_a_slide_table_holds_the_real_tiles_tissue_weighted_mean(tmp_path, rect_stage):
    tiles, _ = read_tiles(rect_stage / "tiles.parquet")
    rng = np.random.default_rng(3)
    features = rng.normal(size=(len(tiles), 6)).astype(np.float32)
    store = write_store(tmp_path / "e.zarr", features, tiles[["x", "y"]].to_numpy(np.int64))
    table = slide_features("rect", store, rect_stage / "tiles.parquet", ["tissue_weighted_mean"])
    weights = tiles["tissue_fraction"].to_numpy(np.float64)
    expected = (weights[:, None] * features).sum(0) / weights.sum()
    np.testing.assert_allclose(table.filter(regex=r"^f\d+$").iloc[0], expected, rtol=1e-5)
    assert isinstance(table, pd.DataFrame) and table.loc[0, "tiles"] == len(tiles)


def test_the_embedding_map_of_a_real_slide_colours_stains_apart(tmp_path, shared_slides):
    """CMU-1-Small-Region (real H&E skin) embedded with the informative test model: tiles
    of purple (nuclei-dense) and of pink (stroma) tissue get clearly different colours."""
    slide = shared_slides / "CMU-1-Small-Region.svs"
    model = tmp_path / "channel_grid.pt"
    torch.jit.save(torch.jit.script(ChannelGrid()), str(model))
    args = (slide, "cmu", tmp_path / "tissue_mask.png", tmp_path / "qc_mask.png")
    make_tissue_mask(*args, TissueParams())
    make_tile_coords(*args, tmp_path / "tiles.parquet", tmp_path / "qc_tiles.png", TileParams())
    settings = EmbedSettings(model="custom", checkpoint=str(model), precision="fp32", workers=1)
    store = tmp_path / "embeddings.zarr"
    embed_one(slide, "cmu", tmp_path / "tiles.parquet", store, tmp_path / "m.json", settings)
    draw_embedding_map(
        store, tmp_path / "tiles.parquet", tmp_path / "tissue_mask.png",
        tmp_path / "qc_mask.png", tmp_path / "embedding_map.png",
    )  # fmt: skip

    tiles, geometry = read_tiles(tmp_path / "tiles.parquet")
    size = geometry.size_level0
    with openslide.OpenSlide(str(slide)) as reader:
        stain = np.array([
            np.asarray(reader.read_region((x, y), 0, (size, size)).convert("RGB"), float)
            .mean((0, 1)) @ [1.0, 0.0, -1.0]  # red minus blue: pink high, purple low
            for x, y in tiles[["x", "y"]].itertuples(index=False)
        ])  # fmt: skip
    mask = load_mask(tmp_path / "tissue_mask.png")
    centres = (tiles[["x", "y"]].to_numpy() + size // 2) / [mask.scale_x, mask.scale_y]
    picture = load_picture(tmp_path / "embedding_map.png").astype(float)
    colours = picture[centres[:, 1].astype(int), centres[:, 0].astype(int)]
    purple, pink = stain <= np.quantile(stain, 0.25), stain >= np.quantile(stain, 0.75)
    distance = np.linalg.norm(colours[purple].mean(0) - colours[pink].mean(0))
    spread = np.linalg.norm(colours[purple].std(0)) + np.linalg.norm(colours[pink].std(0))
    assert len(tiles) >= 20 and distance > 60 and distance > spread / 2, (distance, spread)


def test_the_cohort_projection_puts_two_kinds_of_slide_apart(tmp_path):
    rng = np.random.default_rng(4)
    features = rng.normal(0, 0.1, size=(8, 12))
    features[:4, 0] += 5.0  # slides a0..a3 differ from b0..b3 along one direction
    table = pd.DataFrame(features, columns=[f"f{i:04d}" for i in range(12)])
    table.insert(0, "slide_id", [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(4)])
    table.insert(1, "pooling", "mean")
    path = tmp_path / "pca.png"
    assert draw_cohort_projection(table, path)
    picture = load_picture(path)
    dots = np.argwhere((picture == [40, 90, 200]).all(axis=-1))
    columns = np.unique(dots[:, 1])
    gaps = np.diff(columns)
    assert gaps.max() > 0.5 * picture.shape[1]  # two groups of dots, far apart in x
    assert not draw_cohort_projection(table.head(2), tmp_path / "two.png")
    assert not (tmp_path / "two.png").exists()
