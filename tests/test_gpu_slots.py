"""GPU slots on a workstation: each job claims a different GPU, and a dead job frees its."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime

import pytest

CLAIM = """
import os, sys, time
from slidesnake.embed.gpu_slots import claim_gpu
gpu = claim_gpu(wait_s=float(sys.argv[1]), jobs_per_gpu=int(sys.argv[3]))
print(gpu, os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def pretend_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDESNAKE_GPU_IDS", "7,9")
    monkeypatch.setenv("SLIDESNAKE_GPU_LOCK_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def claim(wait_s: float = 0.0, hold_s: float = 0.0, jobs_per_gpu: int = 1) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLAIM, str(wait_s), str(hold_s), str(jobs_per_gpu)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )


def test_each_job_gets_its_own_gpu_and_a_dead_jobs_gpu_is_free_again(pretend_gpus):
    first, second = claim(hold_s=60), claim(hold_s=60)
    try:
        first_id, first_visible = first.stdout.readline().split()
        second_id, second_visible = second.stdout.readline().split()
        assert {first_id, second_id} == {"7", "9"}
        assert (first_visible, second_visible) == (first_id, second_id)

        third = claim(wait_s=0)
        assert third.wait(timeout=60) != 0
        assert "no free GPU among ['7', '9']" in third.stderr.read()

        first.kill()  # SIGKILL: the kernel releases its lock, nobody has to clean up
        first.wait()
        fourth = claim()
        assert fourth.stdout.readline().split() == [first_id, first_id]
        fourth.wait(timeout=60)
    finally:
        for job in (first, second):
            job.kill()
            job.wait()


def test_two_jobs_per_gpu_share_each_gpu_and_never_three(pretend_gpus):
    holders, claimed = [], []
    try:
        for _ in range(4):  # one after the other: slots fill GPU by GPU
            holders.append(claim(hold_s=60, jobs_per_gpu=2))
            claimed.append(holders[-1].stdout.readline().split()[0])
        assert claimed == ["7", "9", "7", "9"]

        fifth = claim(wait_s=0, jobs_per_gpu=2)
        assert fifth.wait(timeout=60) != 0
        assert "--resources gpu=4 (2 GPUs x gpu.jobs_per_gpu 2)" in fifth.stderr.read()

        holders[0].kill()  # its slot, and only its, is free again
        holders[0].wait()
        sixth = claim(jobs_per_gpu=2)
        assert sixth.stdout.readline().split()[0] == claimed[0]
        sixth.wait(timeout=60)
    finally:
        for job in holders:
            job.kill()
            job.wait()


@pytest.mark.slow
def test_a_job_waiting_for_a_gpu_says_once_who_holds_them_and_what_to_pass(pretend_gpus):
    first, second = claim(hold_s=60), claim(hold_s=60)
    try:
        holders = {first.stdout.readline().split()[0]: first.pid}
        holders[second.stdout.readline().split()[0]] = second.pid
        waiting = claim(wait_s=11)  # three rounds of waiting, then it gives up
        assert waiting.wait(timeout=60) != 0
        stderr = waiting.stderr.read()
        assert stderr.count("are taken") == 1, stderr
        assert "pass --resources gpu=2" in stderr
        for gpu, pid in holders.items():
            assert f"GPU {gpu}: pid {pid}" in stderr
    finally:
        for job in (first, second):
            job.kill()
            job.wait()


def test_an_allocation_that_set_cuda_visible_devices_is_kept(monkeypatch, tmp_path):
    monkeypatch.delenv("SLIDESNAKE_GPU_IDS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("SLIDESNAKE_GPU_LOCK_DIR", str(tmp_path))
    job = claim()
    assert job.stdout.readline().split() == ["3", "3"]
    job.wait(timeout=60)
    assert not list(tmp_path.iterdir()), "no lock taken: the allocation owns the GPU"


def held(log: str) -> tuple[str, datetime, datetime]:
    """(GPU id, when the job claimed it, when its embedding finished) from a job's log."""
    lines = log.splitlines()
    claim = next(line for line in lines if "claimed GPU" in line)
    end = next(line for line in lines if " tiles in " in line)
    gpu = claim.split("claimed GPU ")[1].split(",")[0]
    return gpu, _timestamp(claim), _timestamp(end)


def _timestamp(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.workflow
def test_more_jobs_than_slots_never_put_three_on_one_gpu(workflow, blob_slide, pretend_gpus):
    """Snakemake lets five embedding jobs run (--resources gpu=5) on two GPUs with two
    slots each: the fifth waits for a slot, and no GPU ever runs more than two."""
    slide_ids = [f"slide-{i}" for i in range(5)]
    workflow.sheet([(slide_id, blob_slide) for slide_id in slide_ids])
    workflow.run("--cores", "5", "--resources", "gpu=5", "--config", "loader={workers: 0}")
    spans = [held(workflow.log(slide_id, "embed_tiles")) for slide_id in slide_ids]
    assert {gpu for gpu, _, _ in spans} == {"7", "9"}
    for gpu in ("7", "9"):
        assert most_at_once([(start, end) for g, start, end in spans if g == gpu]) <= 2
    assert most_at_once([(start, end) for _, start, end in spans]) >= 2, "never in parallel"


def most_at_once(spans: list[tuple[datetime, datetime]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most
