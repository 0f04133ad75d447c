"""What SLURM reports for a job, read back: requests, node sizes, and the jobs that can
never start. The cluster itself is in test_slurm.py; here, its outputs as SLURM writes them."""

from __future__ import annotations

from slidesnake.cluster.stuck_jobs import (
    PendingJob,
    Request,
    from_comment,
    never_starts,
    parse_tres,
    slide_log_report,
    why_never,
)

NODES = {
    "cpu": [Request(64, 256_000, 0)],
    "gpu": [Request(32, 512_000, 4), Request(16, 128_000, 8)],
}


def job(partition: str, tres: str, reason: str = "Resources", comment: str = "") -> PendingJob:
    comment = comment or "rule_embed_tiles_wildcards_TCGA_A1_01"
    return PendingJob("77", partition, reason, parse_tres(tres), *from_comment(comment))


def test_tres_in_every_unit_slurm_writes():
    assert parse_tres("cpu=5,mem=16000M,node=1,billing=5,gres/gpu=1") == Request(5, 16000, 1)
    assert parse_tres("cpu=2,mem=1.5G,node=1") == Request(2, 1536, 0)
    assert parse_tres("cpu=1,mem=2T") == Request(1, 2 * 1024 * 1024, 0)


def test_the_comment_names_the_rule_and_the_slide_even_with_underscores():
    stuck = job("gpu", "cpu=5")
    assert (stuck.rule, stuck.slide_id) == ("embed_tiles", "TCGA_A1_01")
    group = job("cpu", "cpu=2", comment="rule_cpu_stages_make_tile_coords_make_tissue_mask")
    assert group.slide_id is None


def test_a_job_that_fits_one_node_waits_and_one_that_fits_none_never_starts():
    # 9 CPUs fit only the 32-CPU node, 6 GPUs only the 8-GPU node: no node has both.
    assert never_starts(job("gpu", "cpu=20,mem=100000M,gres/gpu=6"), NODES)
    assert not never_starts(job("gpu", "cpu=16,mem=100000M,gres/gpu=6"), NODES)
    assert never_starts(job("cpu", "cpu=4,mem=1000M,gres/gpu=1"), NODES)
    assert never_starts(job("gpu", "cpu=1", reason="PartitionTimeLimit"), NODES)
    assert never_starts(job("nowhere", "cpu=1"), NODES)


def test_the_message_names_the_job_the_slide_and_the_setting_to_change():
    message = why_never(job("gpu", "cpu=40,mem=16000M,gres/gpu=1", "PartitionConfig"), NODES)
    assert message.startswith("SLURM job 77 (embed_tiles, slide 'TCGA_A1_01') can never start")
    assert "40 CPUs, the largest node has 32" in message
    assert "loader.workers" in message
    memory = why_never(job("cpu", "cpu=1,mem=300G"), NODES)
    assert "307200 MB" in memory and "mem_mb for embed_tiles" in memory
    gpus = why_never(job("cpu", "cpu=1,gres/gpu=1"), NODES)
    assert "slurm_partition" in gpus


def test_a_stuck_slide_job_is_said_and_written_in_that_jobs_log(tmp_path):
    said = []
    report = slide_log_report(["TCGA_A1_01"], said.append, tmp_path)
    report(job("gpu", "cpu=1,mem=1G"), "job 77 can never start")
    report(job("gpu", "cpu=1,mem=1G", comment="rule_embed_tiles_wildcards_other"), "job 78 too")
    assert said == ["job 77 can never start", "job 78 too"]
    (log,) = tmp_path.rglob("*.log")
    assert log.relative_to(tmp_path).as_posix() == "TCGA_A1_01/embed_tiles.log"
    assert log.read_text().endswith(" ERROR slidesnake.cluster: job 77 can never start\n")
