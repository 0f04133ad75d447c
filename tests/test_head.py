"""Prediction heads over tile embeddings: by hand against known weights, the checks that
stop a head that does not fit, and the workflow's head rule."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import jobs_run
from safetensors.torch import save_file
from test_slide_features import write_store

from slidesnake.aggregate.head import check_head_fits, load_head, predict_slide
from slidesnake.errors import ConfigError, ModelError

WEIGHT = torch.tensor([[1.0, -1.0, 0.5], [0.0, 2.0, -1.0]])  # 2 classes of 3-d features
BIAS = torch.tensor([0.1, -0.2])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.fixture
def linear_head(tmp_path):
    path = tmp_path / "head.safetensors"
    save_file({"weight": WEIGHT, "bias": BIAS}, str(path))
    return path


def test_a_linear_head_gives_the_predictions_computed_by_hand(tmp_path, linear_head):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(20, 3)).astype(np.float32)
    coords = np.arange(40).reshape(20, 2) * 224
    store = write_store(tmp_path / "e.zarr", features, coords)
    head = load_head(linear_head, ["tumour", "stroma"], "softmax")
    tiles, slide = predict_slide(head, store)
    expected = softmax(features.astype(np.float64) @ WEIGHT.numpy().T + BIAS.numpy())
    assert list(tiles.columns) == ["x", "y", "tumour", "stroma"]
    np.testing.assert_array_equal(tiles[["x", "y"]].to_numpy(), coords)
    np.testing.assert_allclose(tiles[["tumour", "stroma"]], expected, rtol=1e-5)
    slide = slide.set_index("method")
    np.testing.assert_allclose(slide.loc["mean_of_tiles"], expected.mean(0), rtol=1e-5)
    of_mean = softmax(features.mean(0, keepdims=True) @ WEIGHT.numpy().T + BIAS.numpy())[0]
    np.testing.assert_allclose(slide.loc["head_of_mean"], of_mean, rtol=1e-5)


def test_an_mlp_head_is_read_from_its_shapes_with_relu_between(tmp_path):
    path = tmp_path / "mlp.pt"
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 4))
    torch.save(mlp.state_dict(), path)
    features = np.random.default_rng(1).normal(size=(6, 3)).astype(np.float32)
    head = load_head(path, None, "sigmoid")
    assert head.in_dim == 3 and head.classes == ["class_0", "class_1", "class_2", "class_3"]
    with torch.no_grad():
        expected = mlp(torch.from_numpy(features)).sigmoid().numpy()
    np.testing.assert_allclose(head(features), expected, rtol=1e-6)


def test_heads_that_do_not_fit_are_config_errors(tmp_path, linear_head):
    with pytest.raises(ConfigError, match="takes 3-d features but the model gives 64-d"):
        check_head_fits({"checkpoint": str(linear_head)}, 64)
    with pytest.raises(ConfigError, match=r"head.classes names 3 classes but head .* 2 outputs"):
        check_head_fits({"checkpoint": str(linear_head), "classes": ["a", "b", "c"]}, 3)
    with pytest.raises(ConfigError, match="does not exist"):
        check_head_fits({"checkpoint": str(tmp_path / "missing.pt")}, 3)
    broken = tmp_path / "broken.safetensors"
    save_file({"0.weight": torch.zeros(4, 3), "1.weight": torch.zeros(2, 5)}, str(broken))
    with pytest.raises(
        ModelError, match=r"'1\.weight' takes 5 inputs but the layer before gives 4"
    ):
        load_head(broken, None, "none")


@pytest.mark.workflow
def test_the_head_rule_runs_after_the_embeddings_and_alone_when_the_head_changes(
    workflow, rect_slide, tmp_path
):
    path = tmp_path / "head.safetensors"
    torch.manual_seed(0)
    save_file({"weight": torch.randn(3, 64), "bias": torch.zeros(3)}, str(path))
    workflow.sheet([("rect", rect_slide)])
    head = f"head={{checkpoint: {path}, classes: [a, b, c]}}"
    first = workflow.run("--config", head)
    assert jobs_run(first, "predict_tiles") == ["rect"]
    tiles = pd.read_parquet(workflow.result("rect", "predictions.parquet"))
    assert list(tiles.columns) == ["x", "y", "a", "b", "c"] and len(tiles) == 80
    np.testing.assert_allclose(tiles[["a", "b", "c"]].sum(axis=1), 1.0, rtol=1e-5)
    cohort = pd.read_csv(workflow.dir / "results" / "slide_predictions.tsv", sep="\t")
    assert list(cohort["method"]) == ["mean_of_tiles", "head_of_mean"]
    assert set(cohort["slide_id"]) == {"rect"}
    assert workflow.result("rect", "heatmaps.png").stat().st_size > 0

    renamed = workflow.run("--config", f"head={{checkpoint: {path}, classes: [x1, x2, x3]}}")
    assert jobs_run(renamed, "predict_tiles") == ["rect"]
    for rule in ("make_tile_coords", "embed_tiles", "pool_slide", "draw_embedding_map"):
        assert jobs_run(renamed, rule) == []


@pytest.mark.workflow
def test_a_head_of_another_width_stops_the_run_before_any_job(workflow, rect_slide, linear_head):
    workflow.sheet([("rect", rect_slide)])
    config = yaml.safe_load((workflow.dir / "config" / "config.yaml").read_text())
    config["model"] |= {"name": "h0-mini", "weights": "random"}
    config["head"]["checkpoint"] = str(linear_head)
    (workflow.dir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    result = workflow.run(check=False)
    assert result.returncode != 0
    assert "takes 3-d features but the model gives 768-d" in result.stderr
    assert not (workflow.dir / "results" / "slides").exists()
