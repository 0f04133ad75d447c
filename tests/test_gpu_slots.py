"""GPU slots on a workstation: each job claims a different GPU, and a dead job frees its."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from itertools import combinations

import pytest

CLAIM = """
import os, sys, time
from slidesnake.embed.gpu_slots import claim_gpu
print(claim_gpu(wait_s=float(sys.argv[1])), os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def pretend_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIDESNAKE_GPU_IDS", "7,9")
    monkeypatch.setenv("SLIDESNAKE_GPU_LOCK_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def claim(wait_s: float = 0.0, hold_s: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLAIM, str(wait_s), str(hold_s)],
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
    gpu = claim.split("claimed GPU ")[1].split()[0]
    return gpu, _timestamp(claim), _timestamp(end)


def _timestamp(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.workflow
def test_k_gpus_keep_k_jobs_busy_and_never_share_one(workflow, blob_slide, pretend_gpus):
    slide_ids = [f"slide-{i}" for i in range(5)]
    workflow.sheet([(slide_id, blob_slide) for slide_id in slide_ids])
    workflow.run("--resources", "gpu=2", "--config", "loader={workers: 0}")
    spans = [held(workflow.log(slide_id, "embed_tiles")) for slide_id in slide_ids]
    assert {gpu for gpu, _, _ in spans} == {"7", "9"}
    for (gpu_a, start_a, end_a), (gpu_b, start_b, end_b) in combinations(spans, 2):
        overlap = start_a < end_b and start_b < end_a
        assert not (overlap and gpu_a == gpu_b), "two jobs on one GPU at once"
    assert any(
        start_a < end_b and start_b < end_a for (_, start_a, end_a), (_, start_b, end_b) in
        combinations(spans, 2)
    ), "the two GPUs were never busy at the same time"  # fmt: skip
