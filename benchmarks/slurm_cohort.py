"""What the SLURM profile submits and polls for a cohort: N tiny slides on a real cluster.

Runs the CPU stages (masking and tiling) of `--slides` links to one small synthetic slide
through profiles/slurm, twice: the first run does the work, the second must submit
nothing. Prints the submissions (sbatch calls) per run, the CPU submissions per slide,
and how often the Snakemake process polled SLURM (squeue and sacct calls per minute,
counted by wrappers on PATH that log each call and run the real command). Needs a cluster:
tests/slurm/start_slurm.sh starts one (as root).

    python benchmarks/slurm_cohort.py [--slides 200]     (or: make bench-slurm)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cohort_scaling import REPO, cohort, tiny_slide

COUNTED = ["sbatch", "squeue", "sacct"]


def counting_path(directory: Path) -> dict[str, str]:
    """An environment whose PATH logs each call of the SLURM commands to calls.log."""
    shims = directory / "shims"
    shims.mkdir(exist_ok=True)
    for name in COUNTED:
        real = shutil.which(name)
        shim = shims / name
        shim.write_text(f'#!/bin/sh\necho {name} >> {directory}/calls.log\nexec {real} "$@"\n')
        shim.chmod(0o755)
    return {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}


def run(workdir: Path, env: dict[str, str]) -> tuple[float, dict[str, int]]:
    """(wall s, calls per command) of one run of the CPU stages through the profile."""
    calls = workdir.parent / "calls.log"
    calls.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "workflow" / "Snakefile"),
        "--profile", str(REPO / "profiles" / "slurm"), "--until", "make_tile_coords",
    ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the SLURM run failed:\n{done.stderr[-3000:]}")
    names = calls.read_text().split() if calls.exists() else []
    return wall, {name: names.count(name) for name in COUNTED}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slides", type=int, default=200)
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-slurm"
    )
    args = parser.parse_args()
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        sys.exit("no SLURM cluster answers (tests/slurm/start_slurm.sh starts one, as root)")
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    workdir = cohort(args.workdir, tiny_slide(args.workdir / "tiny.svs"), args.slides)
    env = counting_path(args.workdir)

    print(f"profiles/slurm, masking and tiling of {args.slides} slides:")
    for label in ("first run", "second run"):
        wall, calls = run(workdir, env)
        polls = calls["squeue"] + calls["sacct"]
        print(
            f"  {label}: {wall:6.0f} s, {calls['sbatch']} submissions "
            f"({calls['sbatch'] / args.slides:.3f} per slide), squeue {calls['squeue']}, "
            f"sacct {calls['sacct']} ({60 * polls / wall:.1f} status calls per minute)"
        )


if __name__ == "__main__":
    main()
