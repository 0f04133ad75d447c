"""Hostile outputs: networks that answer NaN, infinities or impossible shapes, and cohort
tables that must describe the current sheet. Nothing non-finite or stale is ever written
as a finished result."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ChannelGrid, embed_one, write_sheet

from slidesnake.aggregate.encoder import encode_slide
from slidesnake.aggregate.head import load_head, predict_slide
from slidesnake.aggregate.pooling import pool_features
from slidesnake.atomic import output_set
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.errors import ModelError, NonFiniteError
from slidesnake.slides.synthetic import Rect, write_slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tissue import TissueParams


class Scaled(torch.nn.Module):
    """The informative test model times a constant: NaN, or large enough for fp16 to
    overflow."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.grid = ChannelGrid()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grid(x) * self.factor


@pytest.fixture(scope="module")
def tiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiled")
    slide = write_slide(out / "s.svs", 2048, 2048, [Rect(448, 448, 1792, 1792)], mpp=0.5)
    make_tissue_mask(slide, "s", out / "mask.png", out / "qc.png", TissueParams())
    make_tile_coords(slide, "s", out / "mask.png", out / "qc.png", out / "tiles.parquet",
                     out / "qc_tiles.png", TileParams())  # fmt: skip
    return slide, out


@pytest.mark.parametrize(
    ("factor", "dtype", "count"),
    [(float("nan"), "float32", "NaN or infinite values in 36 rows"),
     (1e6, "float16", "NaN or infinite values in 36 rows")],
)  # fmt: skip
def test_a_model_giving_non_finite_features_fails_its_slide(tmp_path, tiled, factor, dtype, count):
    slide, out = tiled
    model = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(Scaled(factor)), str(model))
    settings = EmbedSettings(model="custom", checkpoint=str(model), precision="fp32",
                             workers=1, output_dtype=dtype)  # fmt: skip
    zarr_path = tmp_path / "embeddings.zarr"
    with pytest.raises(NonFiniteError) as raised:
        embed_one(slide, "s", out / "tiles.parquet", zarr_path, tmp_path / "m.json", settings)
    message = str(raised.value)
    assert f"the model's tile features ({dtype}) hold" in message and count in message, message
    assert "output.dtype float32" in message
    assert not zarr_path.exists() and not (tmp_path / "m.json").exists()
    assert list(tmp_path.glob(".embeddings.zarr*")) == []


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "embeddings.zarr"
    writer = EmbeddingWriter(path, np.array([[0, 0], [224, 0], [448, 0]]), 8, "float32")
    writer.put(np.arange(3), np.arange(24, dtype=np.float32).reshape(3, 8) / 24)
    writer.finish({"model": "test"})
    return path


def test_a_head_with_a_nan_weight_is_refused_on_loading(tmp_path):
    weight = torch.ones(2, 8)
    weight[1, 3] = float("nan")
    torch.save({"weight": weight, "bias": torch.zeros(2)}, tmp_path / "head.pt")
    with pytest.raises(ModelError, match="the weight of layer 'weight' holds NaN or infinite"):
        load_head(tmp_path / "head.pt", ["a", "b"], "softmax")


class NanHead(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x[:, :2] - 1)  # NaN for features below 1


def test_a_program_head_giving_nan_writes_no_predictions(tmp_path, store):
    torch.jit.save(torch.jit.script(NanHead()), str(tmp_path / "head.pt"))
    head = load_head(tmp_path / "head.pt", ["a", "b"], "none")
    with pytest.raises(NonFiniteError, match=r"head .*head.pt's predictions hold 6 NaN"):
        predict_slide(head, store)


def test_a_head_of_too_many_classes_is_refused_before_predicting(tmp_path):
    torch.save({"weight": torch.zeros(100_000, 8)}, tmp_path / "head.pt")
    with pytest.raises(ModelError, match="100000 outputs, more than the 1000 classes"):
        load_head(tmp_path / "head.pt", None, "softmax")


class Encoder(torch.nn.Module):
    def __init__(self, width: int, value: float) -> None:
        super().__init__()
        self.width, self.value = width, value

    def forward(self, features: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
        return torch.full((self.width,), self.value) + features.mean() * 0


@pytest.mark.parametrize(
    ("width", "value", "error", "message"),
    [
        (16, float("nan"), NonFiniteError, "vector hold 16 NaN or infinite values"),
        (16, float("inf"), NonFiniteError, "vector hold 16 NaN or infinite values"),
        (38_000_000, 0.0, ModelError, "returns shape (38000000,); it must return one vector "
                                      "per slide, of at most 65536 values"),
    ],
)  # fmt: skip
def test_a_slide_encoder_giving_non_finite_or_huge_vectors_is_refused(
    tmp_path, store, width, value, error, message
):
    program = tmp_path / "encoder.pt"
    torch.jit.save(torch.jit.script(Encoder(width, value)), str(program))
    with pytest.raises(error) as raised:
        encode_slide(program, store)
    assert message in str(raised.value) and str(program) in str(raised.value)


def test_tissue_weights_that_are_all_zero_fail_that_pooling(store):
    with pytest.raises(NonFiniteError, match="tissue fractions sum to 0, so the weighted mean"):
        pool_features(store, ["tissue_weighted_mean"], np.zeros(3))
    assert pool_features(store, ["tissue_weighted_mean"], np.ones(3))["tissue_weighted_mean"].shape


def test_an_output_set_is_replaced_together_or_not_at_all(tmp_path):
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.html", tmp_path / "c.png"
    for path in (a, b, c):
        path.write_text("old")
    with pytest.raises(RuntimeError), output_set([a, b, c]) as outputs:
        outputs.path(a).write_text("new")
        raise RuntimeError("killed while writing b")
    assert [p.read_text() for p in (a, b, c)] == ["old", "old", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tsv", "b.html", "c.png"]
    with output_set([a, b, c]) as outputs:
        outputs.path(a).write_text("new")
        outputs.path(b).write_text("new")
    assert [a.read_text(), b.read_text(), c.exists()] == ["new", "new", False]  # c: not now


# --- the cohort files describe the current sheet, whatever it holds -------------------


def cohort(workflow) -> pd.DataFrame:
    return pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t", dtype={"slide_id": str})


@pytest.mark.workflow
def test_the_cohort_files_follow_the_sheet_even_with_nothing_to_do(workflow, tmp_path):
    glass = write_slide(tmp_path / "glass.svs", 2048, 2048, [], mpp=0.5)  # no tissue, no tile
    ids = ["g1", "g2", "g3"]
    workflow.sheet([(slide_id, glass) for slide_id in ids])
    workflow.run()  # a cohort without a tile: its summary, not an IndexError
    results = workflow.dir / "results"
    table = cohort(workflow)
    assert list(table["slide_id"]) == ids and set(table["status"]) == {"done"}
    assert list(table["tiles"]) == [0, 0, 0]
    assert not (results / "slide_features_pca.png").exists()
    assert len(pd.read_parquet(results / "slide_features.parquet")) == 3
    # A slide removed from the sheet: every other output is current, yet the table follows.
    workflow.sheet([(slide_id, glass) for slide_id in ids[:2]])
    workflow.run()
    assert list(cohort(workflow)["slide_id"]) == ids[:2]
    assert list(pd.read_parquet(results / "slide_features.parquet")["slide_id"]) == ids[:2]
    assert "<b>2</b> of 2 slides done" in (results / "cohort.html").read_text()
    # A summary killed half-way (its list of slides is written last) is written again.
    (results / ".cohort_slides.txt").unlink()
    (results / "cohort.tsv").write_text("slide_id\tstatus\ng3\tdone\n")
    workflow.run()
    assert list(cohort(workflow)["slide_id"]) == ids[:2]
    assert "Nothing to be done" in workflow.run().stderr
    # An emptied sheet: empty tables, no stale rows.
    write_sheet(workflow.dir / "config" / "samples.tsv", [])
    workflow.run()
    assert cohort(workflow).empty
    assert pd.read_parquet(results / "slide_features.parquet").empty
    assert "<b>0</b> of 0 slides done" in (results / "cohort.html").read_text()
