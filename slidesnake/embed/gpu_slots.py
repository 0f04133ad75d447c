"""A bounded number of embedding jobs per GPU on a workstation, without Snakemake's help.

Snakemake counts `gpu` resources but never says which GPU a job should use. Each job
therefore claims a slot on a GPU itself, before CUDA starts, by taking an exclusive lock
file per slot (`jobs_per_gpu` slots per GPU id); the kernel drops the lock when the
process dies, however it dies. Two slots per GPU let one slide's job start up (imports,
weights) while another's computes. Slots fill GPU by GPU in turn: with two GPUs and two
jobs, each gets a GPU of its own. Under SLURM (or whenever CUDA_VISIBLE_DEVICES is already
set) the allocation has chosen: we keep it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from slidesnake.errors import GpuSlotError

log = logging.getLogger(__name__)

IDS_VARIABLE = "SLIDESNAKE_GPU_IDS"  # e.g. "0,1,2,3"; pretend ids work for tests
LOCK_DIR_VARIABLE = "SLIDESNAKE_GPU_LOCK_DIR"

_held: list[int] = []  # open lock file descriptors, kept for the life of the process


def gpu_ids(configured: list[str] | None = None) -> list[str]:
    """GPU ids this machine offers: config, then $SLIDESNAKE_GPU_IDS, then nvidia-smi."""
    if configured:
        return [str(i) for i in configured]
    if os.environ.get(IDS_VARIABLE):
        return [i.strip() for i in os.environ[IDS_VARIABLE].split(",") if i.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return [str(i) for i, line in enumerate(listing.stdout.splitlines()) if line.startswith("GPU")]


def claim_gpu(
    configured: list[str] | None = None, wait_s: float = 3600.0, jobs_per_gpu: int = 1
) -> str | None:
    """Claim a free slot on a GPU and expose only that GPU to CUDA; returns its id, or
    None for the CPU.

    Must run before anything initialises CUDA in this process.
    """
    if "CUDA_VISIBLE_DEVICES" in os.environ and not os.environ.get(IDS_VARIABLE):
        return os.environ["CUDA_VISIBLE_DEVICES"] or None
    ids = gpu_ids(configured)
    if not ids:
        return None
    lock_dir = Path(
        os.environ.get(LOCK_DIR_VARIABLE, Path(tempfile.gettempdir()) / "slidesnake-gpu")
    )
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + wait_s
    waiting = False
    slots = [(gpu, slot) for slot in range(jobs_per_gpu) for gpu in ids]
    slots_total = len(slots)
    while True:
        for gpu, slot in slots:
            if _try_lock(lock_dir / _lock_name(gpu, slot)):
                os.environ["CUDA_VISIBLE_DEVICES"] = gpu
                log.info("claimed GPU %s, slot %d of %d", gpu, slot + 1, jobs_per_gpu)
                return gpu
        if time.monotonic() > deadline:
            raise GpuSlotError(
                f"no free GPU among {ids} after {wait_s:.0f} s; run Snakemake with "
                f"--resources gpu={slots_total} ({len(ids)} GPUs x gpu.jobs_per_gpu "
                f"{jobs_per_gpu}), or list more GPUs in gpu.ids"
            )
        if not waiting:  # said once: the job then waits quietly until the deadline
            log.warning(
                "all %d slots of GPUs %s are taken (%s); this job waits up to %.0f s for "
                "one. More embedding jobs than slots run when Snakemake's --resources gpu= "
                "is above %d (GPUs x gpu.jobs_per_gpu), or when another run shares these "
                "GPUs: pass --resources gpu=%d",
                slots_total,
                ids,
                _holders(lock_dir, slots),
                wait_s,
                slots_total,
                slots_total,
            )
            waiting = True
        time.sleep(5)


def _lock_name(gpu: str, slot: int) -> str:
    return f"gpu-{gpu}-slot-{slot}.lock"


def _try_lock(path: Path) -> bool:
    """Take the lock file at `path` for the life of this process, if it is free."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held.append(fd)
    return True


def _holders(lock_dir: Path, slots: list[tuple[str, int]]) -> str:
    """Who holds each slot, from the pid its lock file records."""
    pids = []
    for gpu, slot in sorted(slots):
        try:
            pid = (lock_dir / _lock_name(gpu, slot)).read_text().strip() or "?"
        except OSError:
            pid = "?"
        pids.append(f"GPU {gpu}: pid {pid}")
    return ", ".join(pids)
