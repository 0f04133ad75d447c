"""What the SLURM profile submits and polls for a cohort: N tiny slides on a real cluster.

Runs the CPU stages (masking and tiling) of `--slides` links to one small synthetic slide
through profiles/slurm, twice: the first run does the work, the second must submit
nothing. Then the GPU stage (embedding, a small random ViT) of every slide, once as the
profile submits it, in job arrays, and once more with one submission per slide
(`--slurm-array-jobs none`), and checks that both wrote the same embeddings. Prints the
submissions (sbatch calls) of each run, per slide, and how often the Snakemake process
polled SLURM (squeue and sacct calls per minute, counted by wrappers on PATH that log
each call and run the real command). Needs a cluster: tests/slurm/start_slurm.sh starts
one (as root; SLURM_CI_GPUS=2 gives it two fake GPUs).

    python benchmarks/slurm_cohort.py [--slides 200] [--no-embedding | --gpu-only]
        [--modes arrays per-slide]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from cohort_scaling import REPO, cohort, tiny_slide

from slidesnake import load_embeddings

COUNTED = ["sbatch", "squeue", "sacct"]
# How the GPU stage is submitted: the profile's job arrays, or a submission per slide.
MODES = {
    "arrays": ("job arrays (the profile)", ()),
    "per-slide": ("one submission per slide", ("--slurm-array-jobs", "none")),
}


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


def run(workdir: Path, env: dict[str, str], *options: str) -> tuple[float, dict[str, int]]:
    """(wall s, calls per command) of one run through the profile (by default, of the CPU
    stages)."""
    calls = workdir.parent / "calls.log"
    calls.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "workflow" / "Snakefile"),
        "--profile", str(REPO / "profiles" / "slurm"),
        *(options or ("--until", "make_tile_coords")),
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
    parser.add_argument("--no-embedding", dest="embedding", action="store_false")
    parser.add_argument("--gpu-only", action="store_true", help="mask and tile locally first")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=sorted(MODES),
                        help="the GPU stage's submissions to measure")  # fmt: skip
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-slurm"
    )
    args = parser.parse_args()
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        sys.exit("no SLURM cluster answers (tests/slurm/start_slurm.sh starts one, as root)")
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    workdir = cohort(args.workdir, tiny_slide(args.workdir / "tiny.svs"), args.slides)
    configure_model(workdir)
    env = counting_path(args.workdir)

    if args.gpu_only:  # the tiles made here, untimed: what is measured is the GPU stage
        run(workdir, env, "--executor", "local", "--cores", "2", "--until", "make_tile_coords")
    else:
        print(f"profiles/slurm, masking and tiling of {args.slides} slides:")
        for label in ("first run", "second run"):
            show(label, *run(workdir, env), args.slides)
    if not args.embedding:
        return
    print(f"the GPU stage of {args.slides} slides (timm:vit_tiny, random weights, 0 workers):")
    digests = {}
    for label, options in (MODES[mode] for mode in sorted(args.modes)):
        show(label, *run(workdir, env, "--until", "embed_tiles", "--forcerun", "embed_tiles",
                         *options), args.slides)  # fmt: skip
        digests[label] = embeddings_digest(workdir)
    if len(digests) > 1:
        same = len(set(digests.values())) == 1
        print(f"  the same embeddings both ways: {'yes' if same else 'NO'}")


def show(label: str, wall: float, calls: dict[str, int], slides: int) -> None:
    polls = calls["squeue"] + calls["sacct"]
    print(
        f"  {label}: {wall:6.0f} s, {calls['sbatch']} submissions "
        f"({calls['sbatch'] / slides:.3f} per slide), squeue {calls['squeue']}, "
        f"sacct {calls['sacct']} ({60 * polls / wall:.1f} status calls per minute)"
    )


def configure_model(workdir: Path) -> None:
    """A model whose jobs cost their start-up, not their forward passes."""
    path = workdir / "config" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["model"] |= {"name": "timm:vit_tiny_patch16_224", "precision": "fp32"}
    config["loader"] |= {"workers": 0}
    path.write_text(yaml.safe_dump(config))


def embeddings_digest(workdir: Path) -> str:
    """One digest of every slide's features, in the order of the sheet."""
    digest = hashlib.sha256()
    for store in sorted((workdir / "results" / "slides").glob("*/embeddings.zarr")):
        digest.update(load_embeddings(store)[0].tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    main()
