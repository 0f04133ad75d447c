"""The workflow through the SLURM profile on a real single-node SLURM cluster.

tests/slurm/start_slurm.sh brings one up (as root; .ci/run does it): slurmctld, slurmd,
munge, slurmdbd with MariaDB so that `sacct` works, and a fake GPU (gres/gpu on
/dev/null). Without a cluster these tests skip, unless SLIDESNAKE_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import REPO, Workflow

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
    """SLURM job id -> what it ran: group_cpu_stages (masking + tiling) or rule_embed_tiles."""
    base = workdir / ".snakemake" / "slurm_logs"
    kinds = {log.stem: log.relative_to(base).parts[0] for log in base.glob("**/*.log")}
    return {
        job: kind.removesuffix("_make_tile_coords_make_tissue_mask") for job, kind in kinds.items()
    }


def test_the_slurm_profile_runs_every_job_through_sbatch(tmp_path, rect_slide, blob_slide):
    text = tmp_path / "notes.svs"
    text.write_text("not a slide\n")
    rows = [("rect", rect_slide), ("blobs", blob_slide)]
    since = subprocess.run(["date", "+%Y-%m-%dT%H:%M:%S"], capture_output=True, text=True)
    on_slurm = Workflow(tmp_path / "slurm")
    on_slurm.sheet([*rows, ("notes", text)])
    result = on_slurm.run(
        "--profile", str(REPO / "profiles" / "slurm"), *FAST_POLLING, "--retries", "0",
        check=False,
    )  # fmt: skip
    assert result.returncode != 0  # the text file failed; the slides finished
    table = pd.read_csv(on_slurm.dir / "results" / "cohort.tsv", sep="\t", index_col=0)
    assert table["status"].to_dict() == {"rect": "done", "blobs": "done", "notes": "failed"}

    jobs = sacct_jobs(since.stdout.strip())
    ran = slurm_logs(on_slurm.dir)
    assert set(ran) <= set(jobs.index), "every job went through sbatch and sacct knows it"
    assert sorted(ran.values()) == ["group_cpu_stages"] * 3 + ["rule_embed_tiles"] * 2
    for job, kind in ran.items():
        assert ("gres/gpu=1" in jobs.loc[job, "tres"]) == (kind == "rule_embed_tiles")
    assert sorted(jobs.loc[list(ran), "state"]) == ["COMPLETED"] * 4 + ["FAILED"]
    for slide_id, _ in rows:
        assert "CUDA_VISIBLE_DEVICES=0" in on_slurm.log(slide_id, "embed_tiles")

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
