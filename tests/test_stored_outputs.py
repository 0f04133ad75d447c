"""A cohort whose outputs live only in a bucket (Snakemake's default storage provider, the
S3 plugin, moto's server on loopback), as on an executor without a shared disk: every
run starts in a fresh working directory, with nothing of the last one but the bucket."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import RECT_SLIDE, REPO, Workflow, corrupted_copy, jobs_run
from store_servers import S3_ENV, SECRET

from slidesnake import load_embeddings

pytestmark = [pytest.mark.workflow, pytest.mark.store]
pytest.importorskip("snakemake_storage_plugin_s3")

BUCKET = "results"


class StoredRun:
    """Runs of one cohort, each in a working directory of its own, into the bucket."""

    def __init__(self, s3, root: Path, rows: list[tuple], prefix: str) -> None:
        self.s3, self.root, self.rows, self.prefix, self.runs = s3, root, rows, prefix, []

    def run(self, *args: str, check: bool = True):
        workflow = Workflow(self.root / f"run-{len(self.runs)}")
        workflow.sheet(self.rows)
        storage = f"storage={{s3: {{endpoint_url: {self.s3.url}}}}}"  # the slides' store
        command = workflow.command(
            "--config", storage,
            "--default-storage-provider", "s3",
            "--default-storage-prefix", f"s3://{BUCKET}/{self.prefix}",
            "--storage-s3-endpoint-url", self.s3.url, *args,
        )  # fmt: skip
        keys = {"SNAKEMAKE_STORAGE_S3_ACCESS_KEY": S3_ENV["AWS_ACCESS_KEY_ID"],
                "SNAKEMAKE_STORAGE_S3_SECRET_KEY": SECRET}  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, env=os.environ | keys)
        if check and result.returncode:
            raise AssertionError(f"snakemake failed:\n{result.stderr}")
        self.runs.append(workflow)
        return result

    def stored_keys(self) -> list[str]:
        pages = self.s3.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def body(self, key: str) -> bytes:
        return self.s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()

    def fetch(self, relative: str, into: Path) -> Path:
        """A copy of `relative` (a file, or a folder such as an embeddings.zarr)."""
        for key in self.stored_keys():
            if key == f"{self.prefix}/{relative}" or key.startswith(f"{self.prefix}/{relative}/"):
                path = into / key
                path.parent.mkdir(parents=True, exist_ok=True)
                self.s3.client.download_file(BUCKET, key, str(path))
        return into / self.prefix / relative

    def summary(self, into: Path) -> dict[str, str]:
        table = pd.read_csv(self.fetch("results/cohort.tsv", into), sep="\t")
        return dict(zip(table["slide_id"], table["status"], strict=True))


def test_a_cohort_with_its_outputs_only_in_a_bucket_runs_as_on_disk(
    s3, tmp_path, rect_slide, blob_slide
):
    """Equal embeddings to a run on disk; a slide whose embedding fails (a corrupt tile
    under tissue) fails alone and is redone alone once mended; a run with everything in
    the bucket runs nothing; no file written, here or in the bucket, holds the secret."""
    centre = (RECT_SLIDE["width"] // 2, RECT_SLIDE["height"] // 2)
    broken = corrupted_copy(rect_slide, tmp_path, *centre)
    rows = [("in_s3", s3.put("cohort", "out/rect.svs", rect_slide)), ("on_disk", blob_slide),
            ("broken", s3.put("cohort", "out/broken.svs", broken))]  # fmt: skip
    on_disk = Workflow(tmp_path / "on_disk")
    on_disk.sheet([("in_s3", rect_slide), ("on_disk", blob_slide)])
    on_disk.run()
    stored = StoredRun(s3, tmp_path, rows, "cohort")

    assert stored.run(check=False).returncode != 0
    assert stored.summary(tmp_path / "1") == {
        "in_s3": "done",
        "on_disk": "done",
        "broken": "failed",
    }
    for slide_id in ("in_s3", "on_disk"):
        zarr = stored.fetch(f"results/slides/{slide_id}/embeddings.zarr", tmp_path / "1")
        features, coords, _ = load_embeddings(zarr)
        local, local_coords, _ = load_embeddings(on_disk.result(slide_id, "embeddings.zarr"))
        np.testing.assert_array_equal(features, local)
        np.testing.assert_array_equal(coords, local_coords)
    assert not [key for key in stored.stored_keys() if "/broken/embeddings.zarr" in key]
    log = stored.fetch("logs/slides/broken/embed_tiles.log", tmp_path / "1").read_text()
    assert "could not be decoded" in log

    s3.put("cohort", "out/broken.svs", rect_slide)  # mended
    mended = stored.run()
    for rule in ("embed_tiles", "pool_slide", "draw_embedding_map"):
        assert jobs_run(mended, rule) == ["broken"]
    for rule in ("make_tissue_mask", "make_tile_coords"):  # stored by the first run
        assert jobs_run(mended, rule) == []
    assert stored.summary(tmp_path / "2") == dict.fromkeys(("in_s3", "on_disk", "broken"), "done")
    assert "Nothing to be done" in stored.run().stderr

    written = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert not [path for path in written if SECRET.encode() in path.read_bytes()]
    objects = stored.stored_keys()
    assert "cohort/results/cohort.html" in objects
    assert not [key for key in objects if SECRET.encode() in stored.body(key)]


def test_a_model_added_to_a_list_in_a_bucket_embeds_the_list_again(s3, tmp_path, rect_slide):
    """Snakemake cannot keep a stored output in place (`update`), so with outputs in
    storage the job of a longer list embeds each of its models, the old ones as before."""
    stored = StoredRun(s3, tmp_path, [("rect", rect_slide)], "models")
    vit = {"name": "timm:test_vit", "weights": "random", "precision": "fp32"}
    stored.run("--config", f"models={{a: {vit}}}")
    first, _, _ = load_embeddings(
        stored.fetch("results/slides/rect/a/embeddings.zarr", tmp_path / "1")
    )
    longer = stored.run("--config", f"models={{a: {vit}, b: {vit | {'batch_size': 8}}}}")
    assert jobs_run(longer, "embed_tiles") == ["rect"]
    again, _, _ = load_embeddings(
        stored.fetch("results/slides/rect/a/embeddings.zarr", tmp_path / "2")
    )
    added, _, _ = load_embeddings(
        stored.fetch("results/slides/rect/b/embeddings.zarr", tmp_path / "2")
    )
    np.testing.assert_array_equal(again, first)
    np.testing.assert_allclose(added, first, rtol=1e-5, atol=1e-6)
    assert stored.summary(tmp_path / "3") == {"rect": "done"}


def test_the_kubernetes_profile_sends_every_output_to_the_bucket_and_asks_a_gpu(
    s3, tmp_path, rect_slide
):
    """A dry run of profiles/kubernetes: every job's outputs and logs go to the bucket
    (nothing on a shared disk), the embedding pod asks one NVIDIA GPU, the others none."""
    pytest.importorskip("snakemake_executor_plugin_kubernetes")
    stored = StoredRun(
        s3, tmp_path, [("rect", s3.put("cohort", "k8s/rect.svs", rect_slide))], "k8s"
    )
    dry = stored.run("--profile", str(REPO / "profiles" / "kubernetes"), "--dry-run")
    parts = re.split(r"^\s*(?:local)?rule (\w+):$", dry.stdout + dry.stderr, flags=re.M)
    rules = dict(zip(parts[1::2], parts[2::2], strict=True))
    assert {"make_tissue_mask", "make_tile_coords", "embed_tiles"} <= set(rules)
    for job in rules.values():
        files = [line for line in job.splitlines() if line.strip().startswith(("output:", "log:"))]
        assert all("s3://results/k8s/" in line for line in files)
    assert "gpu=1," in rules["embed_tiles"] and "gpu_manufacturer=nvidia" in rules["embed_tiles"]
    assert "gpu=" not in rules["make_tile_coords"]
