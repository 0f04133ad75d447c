"""The workflow through the SLURM profile on a real single-node SLURM cluster.

tests/slurm/start_slurm.sh brings one up (as root; .ci/run does it): slurmctld, slurmd,
munge, slurmdbd with MariaDB so that `sacct` works, and a fake GPU (gres/gpu on
/dev/null). Without a cluster these tests skip, unless SLIDESNAKE_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import RECT_SLIDE, REPO, Workflow, corrupted_copy

from slidesnake import load_embeddings
from slidesnake.tiling.tile_table import read_tiles

pytestmark = [pytest.mark.workflow, pytest.mark.slurm]

FAST_POLLING = [
    "--slurm-init-seconds-before-status-checks", "1",
    "--seconds-between-status-checks", "2",
    "--slurm-keep-successful-logs",
]  # fmt: skip


def cluster_is_up() -> bool:
    if shutil.which("sbatch") is None:
        return False
    return subprocess.run(["scontrol", "ping"], capture_output=True).returncode == 0


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    if not cluster_is_up():
        if os.environ.get("SLIDESNAKE_REQUIRE_SLURM") == "1":
            pytest.fail("SLIDESNAKE_REQUIRE_SLURM=1 but no SLURM cluster answers")
        pytest.skip("no SLURM cluster here (tests/slurm/start_slurm.sh starts one, as root)")


def sacct_jobs(since: str) -> pd.DataFrame:
    listing = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", since, "-o", "JobID,State,AllocTRES"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [line.split("|") for line in listing.stdout.splitlines() if line]
    return pd.DataFrame(rows, columns=["job", "state", "tres"]).set_index("job")


def slurm_logs(workdir: Path) -> dict[str, str]:
    """SLURM job id -> what it ran: group_cpu_stages (masking and tiling of a batch of
    slides), rule_make_tissue_mask (a slide that failed last time, alone) or
    rule_embed_tiles."""
    base = workdir / ".snakemake" / "slurm_logs"
    kinds = {log.stem: log.relative_to(base).parts[0] for log in base.glob("**/*.log")}
    return {
        job: kind.removesuffix("_make_tile_coords_make_tissue_mask") for job, kind in kinds.items()
    }


def now() -> str:
    return subprocess.run(["date", "+%Y-%m-%dT%H:%M:%S"], capture_output=True, text=True).stdout


def statuses(workflow: Workflow) -> dict[str, str]:
    table = pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t", index_col=0)
    return table["status"].to_dict()


def test_the_slurm_profile_batches_cpu_stages_and_isolates_a_bad_slide(
    tmp_path, rect_slide, blob_slide
):
    """One submission masks and tiles the batch; a bad slide fails its batch once, then
    goes alone, and the others finish; one GPU job per slide; the stages after the
    embedding are batched too; a finished cohort submits nothing."""
    text = tmp_path / "notes.svs"
    text.write_text("not a slide\n")
    rows = [("rect", rect_slide), ("blobs", blob_slide)]
    on_slurm = Workflow(tmp_path / "slurm")
    on_slurm.sheet([*rows, ("notes", text)])
    profile = ["--profile", str(REPO / "profiles" / "slurm"), *FAST_POLLING, "--retries", "0"]

    since = now()
    assert on_slurm.run(*profile, check=False).returncode != 0
    assert statuses(on_slurm) == {"rect": "pending", "blobs": "pending", "notes": "failed"}
    assert sorted(slurm_logs(on_slurm.dir).values()) == ["group_cpu_stages"]
    assert len(sacct_jobs(since)) == 1, "the three slides' CPU stages: one submission"

    shutil.rmtree(on_slurm.dir / ".snakemake" / "slurm_logs")
    since = now()
    assert on_slurm.run(*profile, check=False).returncode != 0
    assert statuses(on_slurm) == {"rect": "done", "blobs": "done", "notes": "failed"}
    jobs = sacct_jobs(since)
    ran = slurm_logs(on_slurm.dir)
    assert set(ran) == set(jobs.index), "every job went through sbatch and sacct knows it"
    after_embedding = [kind for kind in ran.values() if kind.startswith("group_slide_features")]
    # The batch's other slides' CPU stages again only where they had not finished when
    # the bad slide failed the batch (keep-incomplete keeps what had: profiles/slurm).
    kinds = sorted(kind for kind in ran.values() if kind not in after_embedding)
    assert [k for k in kinds if k != "group_cpu_stages"] == [
        "rule_embed_tiles", "rule_embed_tiles", "rule_make_tissue_mask"
    ]  # fmt: skip
    assert kinds.count("group_cpu_stages") <= 1
    # pooling and the map of both slides: one batch, or two if one embedding ends early
    assert 1 <= len(after_embedding) <= 2
    for job, kind in ran.items():
        assert ("gres/gpu=1" in jobs.loc[job, "tres"]) == (kind == "rule_embed_tiles")
        assert jobs.loc[job, "state"] == (
            "FAILED" if kind == "rule_make_tissue_mask" else "COMPLETED"
        )
    for slide_id, _ in rows:
        assert "CUDA_VISIBLE_DEVICES=0" in on_slurm.log(slide_id, "embed_tiles")

    on_slurm.sheet(rows)
    since = now()
    on_slurm.run(*profile)
    assert sacct_jobs(since).empty, "a finished cohort submits nothing"

    local = Workflow(tmp_path / "local")
    local.sheet(rows)
    local.run()
    for slide_id, _ in rows:
        slurm_tiles, _ = read_tiles(on_slurm.result(slide_id, "tiles.parquet"))
        local_tiles, _ = read_tiles(local.result(slide_id, "tiles.parquet"))
        pd.testing.assert_frame_equal(slurm_tiles, local_tiles)
        slurm_features, slurm_coords, _ = load_embeddings(
            on_slurm.result(slide_id, "embeddings.zarr")
        )
        local_features, local_coords, _ = load_embeddings(local.result(slide_id, "embeddings.zarr"))
        np.testing.assert_array_equal(slurm_coords, local_coords)
        np.testing.assert_allclose(slurm_features, local_features, atol=2e-3)


def test_the_gpu_stage_goes_as_an_array_and_a_failed_element_reruns_alone(
    tmp_path, rect_slide, blob_slide
):
    """The embedding of the slides that become ready together is one `sbatch --array`,
    one element per slide; a slide whose embedding fails (a corrupt tile under tissue,
    which masking and tiling never read) fails its element alone, and the next run
    submits only that slide's embedding, which then equals its twin's."""
    centre = (RECT_SLIDE["width"] // 2, RECT_SLIDE["height"] // 2)
    broken = corrupted_copy(rect_slide, tmp_path, *centre)
    stamp = broken.stat().st_mtime_ns
    on_slurm = Workflow(tmp_path / "slurm")
    on_slurm.sheet([("rect", rect_slide), ("blobs", blob_slide), ("broken", broken)])
    profile = ["--profile", str(REPO / "profiles" / "slurm"), *FAST_POLLING, "--retries", "0"]

    since = now()
    assert on_slurm.run(*profile, check=False).returncode != 0
    assert statuses(on_slurm) == {"rect": "done", "blobs": "done", "broken": "failed"}
    jobs = sacct_jobs(since)
    elements = [job for job in jobs.index if "_" in job]  # <array>_<element>
    assert len({job.split("_")[0] for job in elements}) == 1, "one array submission"
    assert sorted(jobs.loc[elements, "state"]) == ["COMPLETED", "COMPLETED", "FAILED"]
    assert all("gres/gpu=1" in jobs.loc[job, "tres"] for job in elements)
    assert len(jobs) == 1 + len(elements), "and one submission of the CPU stages"
    assert "could not be decoded" in on_slurm.log("broken", "embed_tiles")

    shutil.copy(rect_slide, broken)  # mended, its old modification time kept
    os.utime(broken, ns=(stamp, stamp))
    masks = {
        slide: on_slurm.result(slide, "tissue_mask.png").stat().st_mtime_ns
        for slide in ("rect", "broken")
    }
    shutil.rmtree(on_slurm.dir / ".snakemake" / "slurm_logs")
    since = now()
    on_slurm.run(*profile)
    assert statuses(on_slurm) == {"rect": "done", "blobs": "done", "broken": "done"}
    embedded = [job for job, kind in slurm_logs(on_slurm.dir).items() if kind == "rule_embed_tiles"]
    assert len(embedded) == 1, "the broken slide's embedding alone, then the pooling batch"
    assert set(sacct_jobs(since)["state"]) == {"COMPLETED"}
    assert {
        slide: on_slurm.result(slide, "tissue_mask.png").stat().st_mtime_ns for slide in masks
    } == masks
    twin, coords, _ = load_embeddings(on_slurm.result("rect", "embeddings.zarr"))
    mended, mended_coords, _ = load_embeddings(on_slurm.result("broken", "embeddings.zarr"))
    np.testing.assert_array_equal(mended_coords, coords)
    np.testing.assert_array_equal(mended, twin)


def test_a_job_no_node_can_run_is_reported_and_cancelled(tmp_path, blob_slide, rect_slide):
    """More loader workers than the node has CPUs: SLURM would keep the job pending
    forever; the run reports it with the setting to change, and ends. The two slides'
    embedding is one array: each element is reported under its own slide."""
    cpus = os.cpu_count()  # the node's, as slurm.conf has it (nproc follows OMP_NUM_THREADS)
    on_slurm = Workflow(tmp_path / "slurm")
    on_slurm.sheet([("blobs", blob_slide), ("rect", rect_slide)])
    # In the config file: an array's --wrap breaks on a quoted --config (profiles/slurm).
    config = on_slurm.dir / "config" / "config.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["loader"]["workers"], settings["slurm"]["check_pending_s"] = cpus, 5
    config.write_text(yaml.safe_dump(settings))
    started = time.monotonic()
    result = on_slurm.run(
        "--profile", str(REPO / "profiles" / "slurm"), *FAST_POLLING, "--retries", "0",
        "--cores", "64",  # as the profile runs: the local --cores would cap the job's threads
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - started < 240, "reported within minutes, not waited on"
    reasons = pd.read_csv(on_slurm.dir / "results" / "cohort.tsv", sep="\t", index_col=0)
    for slide_id in ("blobs", "rect"):
        reason = reasons.loc[slide_id, "reason"]
        assert reason.startswith("SLURM job ")
        assert f"(embed_tiles, slide '{slide_id}') can never start" in reason
        assert f"asks for {cpus + 1} CPUs" in reason and "lower loader.workers" in reason
        assert reason in result.stderr
