"""The real Snakemake workflow on synthetic slides: outputs, no-op re-runs, increments."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import REPO, Workflow, jobs_run

from slidesnake import load_embeddings
from slidesnake.slides.synthetic import random_blobs, write_slide
from slidesnake.tiling.mask_file import load_mask
from slidesnake.tiling.tile_table import read_tiles

pytestmark = pytest.mark.workflow

OUTPUTS = ("tissue_mask.png", "qc_mask.png", "tiles.parquet", "qc_tiles.png")


def mtimes(workflow, slide_ids, names=OUTPUTS):
    return {(s, n): workflow.result(s, n).stat().st_mtime_ns for s in slide_ids for n in names}


def test_cohort_runs_then_reruns_only_what_changed(workflow, rect_slide, blob_slide, tmp_path):
    rows = [("rect", rect_slide), ("blobs", blob_slide)]
    workflow.sheet(rows)
    first = workflow.run()
    assert jobs_run(first, "make_tissue_mask") == ["blobs", "rect"]
    for slide_id in ("rect", "blobs"):
        for name in OUTPUTS:
            assert workflow.result(slide_id, name).stat().st_size > 0
        tiles, geometry = read_tiles(workflow.result(slide_id, "tiles.parquet"))
        assert len(tiles) > 0 and geometry.target_mpp == 0.5
        assert "tiles of 224 px" in workflow.log(slide_id, "make_tile_coords")
        features, coords, attrs = load_embeddings(workflow.result(slide_id, "embeddings.zarr"))
        assert features.shape == (len(tiles), 64) and features.dtype == np.float16
        np.testing.assert_array_equal(coords, tiles[["x", "y"]].to_numpy())
        assert attrs["slide_id"] == slide_id and attrs["model"] == "timm:test_vit"
        metrics = json.loads(workflow.result(slide_id, "metrics.json").read_text())
        assert metrics["tiles"] == len(tiles)
    assert len(read_tiles(workflow.result("rect", "tiles.parquet"))[0]) == 80
    cohort = (workflow.dir / "results" / "cohort.html").read_text()
    assert "<b>2</b> of 2 slides done" in cohort and '"slide_id": "rect"' in cohort
    assert "embedding_map.png" in cohort
    slide_features = pd.read_parquet(workflow.dir / "results" / "slide_features.parquet")
    assert list(slide_features["slide_id"]) == ["rect", "blobs"]  # a row per done slide
    assert set(slide_features["pooling"]) == {"mean"} and "f0063" in slide_features
    workflow.run("--report", "report.html")
    report = (workflow.dir / "report.html").read_text()
    assert "cohort.html" in report and "embedding_maps.jpg" in report
    assert load_mask(workflow.result("blobs", "tissue_mask.png")).mpp == pytest.approx(8.0)
    before = mtimes(workflow, ["rect", "blobs"])

    # nothing changed: nothing runs
    assert "Nothing to be done" in workflow.run("--dry-run").stdout + workflow.run().stderr
    assert mtimes(workflow, ["rect", "blobs"]) == before

    # a new slide (that records no mpp, rescued by the sheet): only its jobs run
    new = write_slide(
        tmp_path / "new.tif",
        3000,
        2500,
        random_blobs(3000, 2500, 2, 3),
        mpp=None,
        vendor="generic",
        levels=2,
    )
    workflow.sheet([*rows, ("new", new, 0.5)])
    added = workflow.run()
    assert jobs_run(added, "make_tissue_mask") == ["new"]
    assert jobs_run(added, "make_tile_coords") == ["new"]
    assert mtimes(workflow, ["rect", "blobs"]) == before
    assert "0.5 µm/px (from sample sheet)" in workflow.log("new", "make_tissue_mask")

    # a tile parameter changed: tiling re-runs for every slide, masking for none
    retiled = workflow.run("--config", "tiles={stride: 112}")
    assert jobs_run(retiled, "make_tissue_mask") == []
    assert jobs_run(retiled, "make_tile_coords") == ["blobs", "new", "rect"]
    assert jobs_run(retiled, "embed_tiles") == ["blobs", "new", "rect"]
    after = mtimes(workflow, ["rect", "blobs"])
    for slide_id in ("rect", "blobs"):
        for name in ("tissue_mask.png", "qc_mask.png"):
            assert after[slide_id, name] == before[slide_id, name]
        assert after[slide_id, "tiles.parquet"] > before[slide_id, "tiles.parquet"]
    _, geometry = read_tiles(workflow.result("rect", "tiles.parquet"))
    assert geometry.stride == 112

    # only a model setting changed: only embedding re-runs, and what follows from it
    remodelled = workflow.run("--config", "tiles={stride: 112}", "model={batch_size: 16}")
    assert jobs_run(remodelled, "make_tile_coords") == []
    assert jobs_run(remodelled, "embed_tiles") == ["blobs", "new", "rect"]
    assert jobs_run(remodelled, "pool_slide") == ["blobs", "new", "rect"]

    # only the pooling changed: only pooling re-runs
    settings = ("tiles={stride: 112}", "model={batch_size: 16}", "slide={pooling: [mean, max]}")
    repooled = workflow.run("--config", *settings)
    assert jobs_run(repooled, "pool_slide") == ["blobs", "new", "rect"]
    for rule in ("make_tissue_mask", "make_tile_coords", "embed_tiles", "draw_embedding_map"):
        assert jobs_run(repooled, rule) == []
    cohort = pd.read_parquet(workflow.dir / "results" / "slide_features.parquet")
    assert sorted(cohort["slide_id"].unique()) == ["blobs", "new", "rect"]
    rect = cohort[cohort["slide_id"] == "rect"].set_index("pooling").filter(regex=r"^f\d+$")
    features, _, _ = load_embeddings(workflow.result("rect", "embeddings.zarr"))
    np.testing.assert_allclose(rect.loc["mean"], features.astype(np.float64).mean(0), rtol=1e-5)
    np.testing.assert_allclose(rect.loc["max"], features.max(0), rtol=1e-6)
    assert (workflow.dir / "results" / "slide_features_pca.png").stat().st_size > 0


def test_invalid_config_stops_before_any_job(workflow, rect_slide):
    workflow.sheet([("rect", rect_slide)])
    result = workflow.run("--config", "tiles={mask_threshold: 2}", check=False)
    assert result.returncode != 0
    assert "mask_threshold" in result.stderr
    assert not (workflow.dir / "results").exists()


def test_a_model_that_does_not_fit_the_tiles_stops_before_any_job(workflow, rect_slide):
    workflow.sheet([("rect", rect_slide)])
    result = workflow.run("--config", "model={name: h-optimus-0}", "tiles={size: 256}", check=False)
    assert result.returncode != 0
    assert "model 'h-optimus-0' takes 224 px tiles but tiles.size is 256" in result.stderr
    assert not (workflow.dir / "results").exists()


def test_bad_sample_sheet_stops_before_any_job(workflow, rect_slide):
    workflow.sheet([("rect", rect_slide), ("rect", rect_slide), ("x", rect_slide.parent)])
    result = workflow.run(check=False)
    assert result.returncode != 0
    assert "slide_id 'rect' appears more than once" in result.stderr
    assert f"slide 'x': {rect_slide.parent} is a directory" in result.stderr
    assert not (workflow.dir / "results").exists()


def test_outputs_of_a_slide_not_in_the_sheet_are_refused_by_name(workflow, rect_slide):
    workflow.sheet([("rect", rect_slide)])
    result = workflow.run("results/slides/rekt/qc_tiles.png", check=False)
    assert result.returncode != 0
    assert "slide 'rekt' is not in the sample sheet config/samples.tsv" in result.stderr
    assert not (workflow.dir / "results").exists()


def test_editing_a_script_without_changing_results_recomputes_nothing(tmp_path, blob_slide):
    copy = tmp_path / "slidesnake"
    copy.mkdir()
    for part in ("workflow", "scripts", "config", "envs", "profiles"):
        source = REPO / part
        (shutil.copytree if source.is_dir() else shutil.copy)(source, copy / part)
    workflow = Workflow(tmp_path / "run", snakefile=copy / "workflow" / "Snakefile")
    workflow.sheet([("blobs", blob_slide)])
    workflow.run()
    script = copy / "scripts" / "embed_tiles.py"
    script.write_text(script.read_text() + "# a comment that changes no result\n")
    assert "Nothing to be done" in workflow.run().stderr
    assert jobs_run(workflow.run("--forcerun", "embed_tiles"), "embed_tiles") == ["blobs"]
