"""Several models from one read: each model's embeddings equal a run of that model alone,
each tile is decoded once, and a job embeds only the models whose outputs are not current.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import timm
import torch
import yaml
from conftest import ChannelGrid, embed_one
from safetensors.torch import save_file

from slidesnake import load_embeddings
from slidesnake.cohort.rule_params import embedding_params
from slidesnake.cohort.summary import write_cohort_summary
from slidesnake.embed.job import embed_slide
from slidesnake.embed.local_run import weights_bytes
from slidesnake.embed.model_list import check_memory
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.embed.settings import EmbedSettings, RemoteSettings
from slidesnake.errors import ConfigError, ModelError, ModelsFailedError
from slidesnake.models.registry import check_model_config, model_input, model_spec
from slidesnake.remote.served_run import ServedRun
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles, write_tiles
from slidesnake.tiling.tissue import TissueParams

LOADER = {"workers": 1, "batch_size": 16, "precision": "fp32", "output_dtype": "float32"}


@pytest.fixture(scope="module")
def grid_program(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("model") / "channel_grid.pt"
    torch.jit.save(torch.jit.script(ChannelGrid()), str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiled(rect_slide, tmp_path_factory) -> Path:
    """The rect slide's tile table: 224 px tiles at 0.5 µm/px, read at 0.25 µm/px."""
    out = tmp_path_factory.mktemp("tiled")
    make_tissue_mask(rect_slide, "rect", out / "mask.png", out / "qc_mask.png", TissueParams())
    make_tile_coords(
        rect_slide, "rect", out / "mask.png", out / "qc_mask.png", out / "tiles.parquet",
        out / "qc_tiles.png", TileParams(),
    )  # fmt: skip
    return out / "tiles.parquet"


def two_models(grid_program: str) -> dict[str, EmbedSettings]:
    """A 48-wide model that sees the whole tile at 112 px (1.0 µm/px: a resize), and a
    64-wide ViT that sees its centre at 112 px (0.5 µm/px: a crop)."""
    return {
        "grid": EmbedSettings(model="custom", checkpoint=grid_program, input_size=112, **LOADER),
        "vit": EmbedSettings(
            model="timm:test_vit", weights="random", input_size=112, input_mpp=0.5, **LOADER
        ),
    }


def params(settings: dict[str, EmbedSettings]) -> dict[str, dict]:
    return {key: embedding_params(config(s)) for key, s in settings.items()}


def config(settings: EmbedSettings) -> dict:
    """The config sections that give `settings`."""
    model = {
        "name": settings.model, "weights": settings.weights, "checkpoint": settings.checkpoint,
        "mean": settings.mean, "std": settings.std, "precision": settings.precision,
        "batch_size": settings.batch_size, "input_size": settings.input_size,
        "input_mpp": settings.input_mpp,
    }  # fmt: skip
    return {"model": model, "output": {"dtype": settings.output_dtype}}


def outputs(folder: Path, keys) -> dict[str, ModelOutputs]:
    return {k: ModelOutputs(folder / k / "e.zarr", folder / k / "metrics.json") for k in keys}


def test_each_model_of_one_read_equals_its_own_run_and_tiles_are_decoded_once(
    rect_slide, tiled, grid_program, tmp_path
):
    # A third model takes the same input as grid: the two share its crop and resize.
    whole = replace(two_models(grid_program)["vit"], input_mpp=None)
    models = two_models(grid_program) | {"whole": whole}
    out = outputs(tmp_path / "all", models)
    metrics = embed_slide(rect_slide, "rect", tiled, out, models, params(models))
    assert set(metrics) == {"grid", "vit", "whole"}
    alone = tmp_path / "whole_alone"
    embed_one(rect_slide, "rect", tiled, alone / "e.zarr", alone / "m.json", whole)
    np.testing.assert_array_equal(
        load_embeddings(out["whole"].zarr)[0], load_embeddings(alone / "e.zarr")[0]
    )

    # The whole-tile model: a run of its own over the same tiles.
    alone = tmp_path / "grid_alone"
    own = embed_one(rect_slide, "rect", tiled, alone / "e.zarr", alone / "m.json", models["grid"])
    grid, coords, attrs = load_embeddings(out["grid"].zarr)
    expected, expected_coords, _ = load_embeddings(alone / "e.zarr")
    assert grid.shape == (80, 48) and attrs["model_key"] == "grid"
    np.testing.assert_array_equal(coords, expected_coords)
    np.testing.assert_array_equal(grid, expected)

    # The centre model: a run of its own over tiles of its size at the centres.
    tiles, geometry = read_tiles(tiled)
    offset = geometry.size_level0 // 4
    centres = tiles.assign(x=tiles["x"] + offset, y=tiles["y"] + offset)
    small = replace(geometry, size=112, size_level0=geometry.size_level0 // 2)
    write_tiles(centres, small, tmp_path / "centres.parquet")
    alone = tmp_path / "vit_alone"
    vit_alone = replace(models["vit"], input_size=None, input_mpp=None)
    embed_one(rect_slide, "rect", tmp_path / "centres.parquet", alone / "e.zarr",
              alone / "m.json", vit_alone)  # fmt: skip
    vit, vit_coords, _ = load_embeddings(out["vit"].zarr)
    expected, _, _ = load_embeddings(alone / "e.zarr")
    assert vit.shape == (80, 64)
    np.testing.assert_array_equal(vit_coords, coords)  # the tile's own corner, not the centre's
    np.testing.assert_allclose(vit, expected, rtol=1e-5, atol=1e-5)

    # One read: as many compressed tiles decoded for two models as for one.
    decoded = {m["compressed_tiles_decoded"] for m in metrics.values()}
    assert decoded == {own["compressed_tiles_decoded"]} and own["compressed_tiles_decoded"] > 0
    for key, m in metrics.items():
        assert m["model_key"] == key and m["models_in_job"] == ["grid", "vit", "whole"]
        assert 0 < m["model_s"] <= m["wall_s"] and m["tiles"] == 80
        assert json.loads(out[key].metrics.read_text()) == m
    # One device, shared: the models' busy shares add up to no more than the loop's.
    job = next(iter(metrics.values()))
    busy = sum(m["model_busy_fraction"] for m in metrics.values())
    assert 0 < busy <= job["wall_s"] / job["job_s"] + 1e-3


def test_a_job_embeds_only_the_models_whose_outputs_are_not_current(
    rect_slide, tiled, grid_program, tmp_path
):
    models = two_models(grid_program)
    out = outputs(tmp_path, [*models, "third"])
    embed_slide(rect_slide, "rect", tiled, out, models, params(models))
    stamps = {key: out[key].metrics.stat().st_mtime_ns for key in models}
    grid_features = load_embeddings(out["grid"].zarr)[0]

    # Unchanged: nothing is embedded again.
    assert embed_slide(rect_slide, "rect", tiled, out, models, params(models)) == {}

    # A third model: only it.
    three = models | {"third": replace(models["grid"], input_size=56)}
    metrics = embed_slide(rect_slide, "rect", tiled, out, three, params(three))
    assert list(metrics) == ["third"] and metrics["third"]["models_in_job"] == ["third"]
    assert {key: out[key].metrics.stat().st_mtime_ns for key in models} == stamps
    assert load_embeddings(out["third"].zarr)[0].shape == (80, 48)

    # One model's settings changed: only that model.
    changed = three | {"grid": replace(models["grid"], mean=(0.5, 0.5, 0.5))}
    metrics = embed_slide(rect_slide, "rect", tiled, out, changed, params(changed))
    assert list(metrics) == ["grid"]
    assert not np.array_equal(load_embeddings(out["grid"].zarr)[0], grid_features)
    assert out["vit"].metrics.stat().st_mtime_ns == stamps["vit"]

    # A half-written output (its metrics lost) is not current.
    out["vit"].metrics.unlink()
    metrics = embed_slide(rect_slide, "rect", tiled, out, changed, params(changed))
    assert list(metrics) == ["vit"]


def test_a_model_input_is_cut_and_resized_from_the_tile_or_refused_by_name():
    hopt = model_spec("h-optimus-0")
    centre = model_input(hopt, 448, 0.5)
    assert (centre.size, centre.mpp, centre.crop) == (224, 0.5, 0.5)
    whole = model_input(model_spec("timm:vit_small_patch16_224"), 448, 0.5, input_size=224)
    assert (whole.size, whole.mpp, whole.crop) == (224, 1.0, 1.0)
    with pytest.raises(ConfigError, match=r"models.a 'h-optimus-0' needs 0.5 µm/px.*mpp: 0.5"):
        model_input(hopt, 224, 1.0, label="models.a")
    with pytest.raises(ConfigError, match=r"sees 112 µm .*set tiles.size: 224"):
        model_input(hopt, 112, 0.5)
    with pytest.raises(ConfigError, match="takes 224 px, not 448"):
        model_input(hopt, 448, 0.5, input_size=448)


def test_a_served_model_of_the_list_must_name_its_server_and_model():
    served = {"name": "timm:test_vit", "backend": "remote"}
    tiles = {"size": 224, "mpp": 0.5}
    with pytest.raises(
        ConfigError, match=r"models.a.backend remote needs models.a.remote.url and "
    ):
        check_model_config(served, tiles, {"url": None, "model": None}, key="a")
    check_model_config(served, tiles, {"url": "http://gpu-1:8000", "model": "vit"}, key="a")


def test_models_that_do_not_fit_the_gpu_are_refused_with_a_split():
    gib = 2**30
    check_memory({"a": 3 * gib, "b": 3 * gib}, free=7 * gib, total=8 * gib)
    with pytest.raises(ModelError, match=r"need about 9.0 GiB .*into runs of c, a \| b$"):
        check_memory({"a": 2 * gib, "b": 2 * gib, "c": 5 * gib}, free=7 * gib, total=7 * gib)
    # Two jobs take turns on a 16 GiB GPU: each may count on 8 GiB, however much is free.
    with pytest.raises(ModelError, match=r"has 8.0 GiB .*per job .*runs of b \| a or lower"):
        check_memory({"a": 5 * gib, "b": 6 * gib}, free=16 * gib, total=16 * gib, jobs_on_gpu=2)
    hopt = EmbedSettings(model="h-optimus-0", precision="fp16")
    assert weights_bytes(model_spec("h-optimus-0"), hopt) == pytest.approx(2.27e9, rel=0.02)


def model_jobs(result, rule: str) -> list[str]:
    """(slide id, model key) of the jobs of `rule` that Snakemake started."""
    lines = result.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == f"localrule {rule}:"]
    found = []
    for i in starts:
        line = next(line for line in lines[i:] if "wildcards: " in line)
        wildcards = dict(part.split("=") for part in line.split("wildcards: ")[1].split(", "))
        found.append(f"{wildcards['slide_id']}/{wildcards.get('model_key', '')}")
    return sorted(found)


def with_models(workflow, models: dict) -> None:
    path = workflow.dir / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["models"] = models
    path.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.workflow
def test_a_single_model_config_records_the_params_it_always_did(workflow, rect_slide):
    """Upgrading re-runs nothing: each output's rule and params, as Snakemake records them
    (what its params trigger compares), are those recorded before `models:` and
    `loader.decode` existed. A cohort of that time keeps the exact decode (its stores
    record no method): the first run pins it, the stores are then made as old ones are,
    and a run that leaves the method unset finds nothing to do."""
    workflow.sheet([("rect", rect_slide)])
    workflow.run("--config", "loader={workers: 1, prefetch: 2, block: 4, decode: exact}")
    recorded = {}
    for path in (workflow.dir / ".snakemake" / "metadata").iterdir():
        name = base64.b64decode(path.name.replace("@", "/")).decode()
        metadata = json.loads(path.read_text())
        params = [p.replace(str(rect_slide.parent), "{tmp}") for p in metadata["params"]]
        params = ["{slide identity}" if "bytes, mtime" in p else p for p in params]
        recorded[name] = {"rule": metadata["rule"], "params": params}
    before = json.loads((Path(__file__).parent / "data" / "single_model_params.json").read_text())
    assert recorded == before
    assert not (workflow.dir / "results" / "models").exists()
    store = workflow.result("rect", "embeddings.zarr") / "zarr.json"
    document = json.loads(store.read_text())
    for name in ("decode", "decode_shrink"):
        del document["attributes"][name]
    store.write_text(json.dumps(document))
    assert "embed_tiles" not in workflow.run("--dry-run").stdout


@pytest.mark.workflow
def test_a_cohort_of_models_reruns_only_the_model_that_changed(workflow, rect_slide, grid_program):
    workflow.sheet([("rect", rect_slide)])
    vit = {"name": "timm:test_vit", "weights": "random", "precision": "fp32", "input_size": 112}
    grid = {"name": "custom", "checkpoint": grid_program, "precision": "fp32"}
    with_models(workflow, {"vit": vit, "grid": grid})
    first = workflow.run()
    assert model_jobs(first, "embed_tiles") == ["rect/"]
    assert model_jobs(first, "pool_slide") == ["rect/grid", "rect/vit"]
    for key, width in (("vit", 64), ("grid", 48)):
        features, _, attrs = load_embeddings(workflow.result("rect", f"{key}/embeddings.zarr"))
        assert features.shape == (80, width) and attrs["model_key"] == key
    cohort = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t")
    assert list(cohort["model"]) == ["vit", "grid"] and set(cohort["status"]) == {"done"}
    assert (cohort["model_s"] > 0).all() and (cohort["model_s"] <= cohort["wall_s"]).all()
    features = pd.read_parquet(workflow.dir / "results" / "slide_features.parquet")
    assert list(features["model_key"]) == ["vit", "grid"]
    embedded = workflow.log("rect", "embed_tiles")
    assert "read once for models vit, grid" in embedded

    # A third model: the job embeds only it, and leaves the others' outputs as they were.
    kept = {
        key: workflow.result("rect", f"{key}/metrics.json").read_text() for key in ("vit", "grid")
    }
    vit_features = load_embeddings(workflow.result("rect", "vit/embeddings.zarr"))[0]
    third = {"name": "timm:test_vit", "weights": "random", "precision": "fp32"}
    with_models(workflow, {"vit": vit, "grid": grid, "third": third})
    workflow.run()
    log = workflow.log("rect", "embed_tiles")
    assert "read once for models third on" in log and "model vit is current" in log
    metrics = json.loads(workflow.result("rect", "third/metrics.json").read_text())
    assert metrics["models_in_job"] == ["third"]
    for key, text in kept.items():
        assert workflow.result("rect", f"{key}/metrics.json").read_text() == text
    np.testing.assert_array_equal(
        load_embeddings(workflow.result("rect", "vit/embeddings.zarr"))[0], vit_features
    )

    # A model removed: nothing runs.
    with_models(workflow, {"vit": vit, "third": third})
    assert "Nothing to be done" in workflow.run("--dry-run").stdout

    # One model changed: only its embeddings, and the run is complete after it.
    with_models(workflow, {"vit": vit | {"mean": [0.5, 0.5, 0.5]}, "third": third})
    workflow.run()
    log = workflow.log("rect", "embed_tiles")
    assert "read once for models vit on" in log and "model third is current" in log
    assert "Nothing to be done" in workflow.run("--dry-run").stdout


@pytest.mark.workflow
def test_a_head_reads_the_model_it_names(workflow, rect_slide, tmp_path):
    """With models:, head.model names the model the head was trained on: its width is
    checked against that model, and its predictions go in that model's folder."""
    head = tmp_path / "head.safetensors"
    save_file({"weight": torch.randn(3, 64), "bias": torch.zeros(3)}, str(head))
    workflow.sheet([("rect", rect_slide)])
    vit = {"name": "timm:test_vit", "weights": "random"}
    with_models(workflow, {"vit": vit, "h0": {"name": "h0-mini", "weights": "random"}})
    unnamed = workflow.run("-n", "--config", f"head={{checkpoint: {head}}}", check=False)
    assert "head.model None is not a key of models: (vit, h0)" in unnamed.stdout
    h0 = workflow.run("-n", "--config", f"head={{checkpoint: {head}, model: h0}}", check=False)
    assert "takes 64-d features but the model gives 768-d" in h0.stdout
    planned = workflow.run("-n", "--config", f"head={{checkpoint: {head}, model: vit}}")
    assert "results/slides/rect/vit/predictions.parquet" in planned.stdout
    assert "rect/h0/predictions.parquet" not in planned.stdout


class NotFinite(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], 8), float("nan"))


def not_finite(grid: EmbedSettings, folder: Path) -> EmbedSettings:
    """A program whose features are NaN: refused by the writer, in the loop."""
    torch.jit.save(torch.jit.script(NotFinite()), str(folder / "not_finite.pt"))
    return replace(grid, checkpoint=str(folder / "not_finite.pt"))


def wrong_width(grid: EmbedSettings, folder: Path) -> EmbedSettings:
    """A ViT whose checkpoint holds a 48-wide ViT's weights: refused when it loads."""
    vit = timm.create_model("vit_tiny_patch16_224", num_classes=0, embed_dim=48, depth=1)
    save_file(vit.state_dict(), str(folder / "narrow.safetensors"))
    return replace(grid, model="timm:test_vit", checkpoint=str(folder / "narrow.safetensors"))


def server_down(grid: EmbedSettings, folder: Path) -> EmbedSettings:
    """A served model whose server is not there: refused when it connects."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    remote = RemoteSettings(url=url, model="vit", ready_timeout_s=1)
    return replace(grid, model="timm:test_vit", backend="remote", remote=remote)


BROKEN = {
    not_finite: "NaN or infinite values",
    wrong_width: "does not fit architecture test_vit",
    server_down: "not ready within remote.ready_timeout_s",
}


@pytest.mark.parametrize("make", list(BROKEN), ids=lambda make: make.__name__)
def test_a_model_that_fails_costs_only_itself(
    make, rect_slide, tiled, grid_program, tmp_path, caplog
):
    """On a fresh slide, a model that fails (in the loop, as it loads, as it connects)
    fails the job with one line naming its key; the other model finishes and waits in
    its kept folder, nothing looks finished, and the next run places it without
    embedding again."""
    caplog.set_level(logging.INFO)
    grid = two_models(grid_program)["grid"]
    models = {"grid": grid, "broken": make(grid, tmp_path)}
    out = outputs(tmp_path / "out", models)
    with pytest.raises(ModelsFailedError, match=r"failed: broken .*embeddings of grid are kept"):
        embed_slide(rect_slide, "rect", tiled, out, models, params(models),
                           open_served=ServedRun)  # fmt: skip
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].startswith("slide 'rect': model 'broken' failed: ")
    assert BROKEN[make] in errors[0]
    for key in models:
        assert not out[key].zarr.exists() and not out[key].metrics.exists()
    assert not out["broken"].kept().zarr.exists() and not out["broken"].kept().metrics.exists()
    assert out["grid"].kept().metrics.is_file()
    assert [p.name for p in (tmp_path / "out").rglob(".*-*")] == []  # no temporaries left
    waiting = load_embeddings(out["grid"].kept().zarr)[0]
    assert waiting.shape == (80, 48)

    caplog.clear()
    alone = {"grid": grid}
    assert embed_slide(rect_slide, "rect", tiled, out, alone, params(alone)) == {}
    assert "model grid was embedded by the last run; kept" in caplog.text
    np.testing.assert_array_equal(load_embeddings(out["grid"].zarr)[0], waiting)
    assert out["grid"].metrics.is_file() and not (tmp_path / "out" / "grid" / ".kept").exists()


def test_a_model_that_fails_leaves_a_current_model_as_it_was(
    rect_slide, tiled, grid_program, tmp_path
):
    """A model added to a done slide that fails: the model that was current is not in
    the job, and keeps its outputs as they were."""
    grid = two_models(grid_program)["grid"]
    out = outputs(tmp_path / "out", ["grid", "broken"])
    embed_slide(rect_slide, "rect", tiled, out, {"grid": grid}, params({"grid": grid}))
    kept = out["grid"].metrics.read_text()
    models = {"grid": grid, "broken": not_finite(grid, tmp_path)}
    with pytest.raises(ModelsFailedError, match=r"1 model\(s\) failed: broken \(each"):
        embed_slide(rect_slide, "rect", tiled, out, models, params(models))
    assert out["grid"].metrics.read_text() == kept
    assert load_embeddings(out["grid"].zarr)[0].shape == (80, 48)
    assert not out["broken"].zarr.exists() and not out["broken"].kept().zarr.exists()


@pytest.mark.workflow
def test_a_cohort_with_a_failing_model_keeps_the_others_and_says_which_failed(
    workflow, rect_slide, grid_program, tmp_path
):
    """Snakemake removes the new outputs of a failed job: the model that finished waits
    in its kept folder, cohort.tsv says which model failed and why, and the next run,
    the broken model mended, embeds only it."""
    torch.jit.save(torch.jit.script(NotFinite()), str(tmp_path / "not_finite.pt"))
    workflow.sheet([("rect", rect_slide)])
    grid = {"name": "custom", "checkpoint": grid_program, "precision": "fp32"}
    with_models(
        workflow, {"grid": grid, "broken": grid | {"checkpoint": str(tmp_path / "not_finite.pt")}}
    )
    failed = workflow.run(check=False)
    assert failed.returncode != 0
    assert "slide 'rect': model 'broken' failed: the model's tile features" in failed.stderr
    cohort = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t", index_col="model")
    assert list(cohort["status"]) == ["pending", "failed"]
    assert cohort.loc["broken", "reason"].startswith("slide 'rect': model 'broken' failed: ")
    assert "kept until the slide's other models succeed" in cohort.loc["grid", "reason"]
    assert not workflow.result("rect", "grid/embeddings.zarr").exists()

    with_models(workflow, {"grid": grid, "broken": grid | {"input_size": 112}})
    workflow.run()
    log = workflow.log("rect", "embed_tiles")
    assert "model grid was embedded by the last run; kept" in log
    assert "read once for models broken on" in log
    cohort = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t")
    assert set(cohort["status"]) == {"done"}


def test_the_cohort_summary_of_a_model_list_with_nothing_done_lists_every_pair(tmp_path):
    """A fresh run of two models where every job failed or never ran still writes a
    cohort.tsv of every slide and model, with the failed model's reason, replacing the
    previous run's table."""
    results, logs = tmp_path / "results", tmp_path / "logs"
    (logs / "a" / "hopt").mkdir(parents=True)
    (logs / "a" / "hopt" / "embed_tiles.log").write_text(
        "12:00:00 ERROR slidesnake: slide 'a': model 'hopt': features are NaN\n"
    )
    results.mkdir()
    (results / "cohort.tsv").write_text("slide_id\tstatus\nold\tdone\n")
    write_cohort_summary(["a", "b"], results, logs, since=0, models=["hopt", "uni"])
    table = pd.read_csv(results / "cohort.tsv", sep="\t", keep_default_na=False)
    rows = table[["slide_id", "model", "status"]].values.tolist()
    assert rows == [
        ["a", "hopt", "failed"], ["a", "uni", "pending"],
        ["b", "hopt", "pending"], ["b", "uni", "pending"],
    ]  # fmt: skip
    assert table.loc[0, "reason"] == "slide 'a': model 'hopt': features are NaN"
    assert pd.read_parquet(results / "slide_features.parquet").empty
