"""One embedding job per GPU on a workstation, without Snakemake's help.

Snakemake counts `gpu` resources but never says which GPU a job should use. Each job
therefore claims a GPU itself, before CUDA starts, by taking an exclusive lock file per
GPU id; the kernel drops the lock when the process dies, however it dies. Under SLURM
(or whenever CUDA_VISIBLE_DEVICES is already set) the allocation has chosen: we keep it.
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


def claim_gpu(configured: list[str] | None = None, wait_s: float = 3600.0) -> str | None:
    """Claim a free GPU and expose only it to CUDA; returns its id, or None for the CPU.

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
    while True:
        for gpu in ids:
            fd = os.open(lock_dir / f"gpu-{gpu}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _held.append(fd)
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            log.info("claimed GPU %s (lock %s)", gpu, lock_dir / f"gpu-{gpu}.lock")
            return gpu
        if time.monotonic() > deadline:
            raise GpuSlotError(
                f"no free GPU among {ids} after {wait_s:.0f} s; run Snakemake with "
                f"--resources gpu={len(ids)} (at most one embedding job per GPU), or list "
                "more GPUs in gpu.ids"
            )
        if not waiting:  # said once: the job then waits quietly until the deadline
            log.warning(
                "all GPUs %s are taken (%s); this job waits up to %.0f s for one. More "
                "embedding jobs than GPUs run when Snakemake's --resources gpu= is above "
                "%d, or when another run shares these GPUs: pass --resources gpu=%d",
                ids,
                _holders(lock_dir, ids),
                wait_s,
                len(ids),
                len(ids),
            )
            waiting = True
        time.sleep(5)


def _holders(lock_dir: Path, ids: list[str]) -> str:
    """Who holds each GPU, from the pid its lock file records."""
    pids = []
    for gpu in ids:
        try:
            pid = (lock_dir / f"gpu-{gpu}.lock").read_text().strip() or "?"
        except OSError:
            pid = "?"
        pids.append(f"GPU {gpu}: pid {pid}")
    return ", ".join(pids)
