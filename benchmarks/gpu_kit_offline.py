"""The GPU kit tried here, without a GPU, on an environment like the lent machine's.

The environment: CPython 3.12 with only the packages of envs/gpu-machine.txt, from PyPI
(torch 2.11 and torchvision 0.26 with their CUDA libraries, which run on a CPU), made
once into benchmarks/out/gpu-machine-env. The working tree and gpu-kit/ are copied to a
fresh folder, as a device run copies them, and there `gpu_kit.COMMAND` runs as written,
with no network (a network namespace of its own, where `unshare -n` works), no package
index and no find-links, and CHECK_ON_CPU=1: the check's CPU side (versions, doctor, the
CUDA tests skipping, `slidesnake bench` with a tiny model, the workflow on two small
slides). Prints the figures docs/testing.md gives.

    make gpu-kit && .venv/bin/python benchmarks/gpu_kit_offline.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gpu_kit import COMMAND, MACHINE, PYTHON312, REPO, machine_requirements, size_mb, tree_mb

MACHINE_ENV = REPO / "benchmarks" / "out" / "gpu-machine-env"
KIT = REPO / "gpu-kit"
# What the machine lacks: the kit must bring them, so the environment must not have them.
NOT_ON_THE_MACHINE = ("zarr", "openslide", "snakemake", "imagecodecs", "wsidicom")


def machine_env() -> Path:
    """The stand-in for the lent machine's Python, made once per envs/gpu-machine.txt."""
    stamp = MACHINE_ENV / ".installed"
    if not stamp.is_file() or stamp.read_text() != MACHINE.read_text():
        shutil.rmtree(MACHINE_ENV, ignore_errors=True)
        subprocess.run([PYTHON312, "-m", "venv", str(MACHINE_ENV)], check=True)
        pip = [str(MACHINE_ENV / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, *machine_requirements()], check=True)
        stamp.write_text(MACHINE.read_text())
    python = MACHINE_ENV / "bin" / "python"
    for name in NOT_ON_THE_MACHINE:
        found = subprocess.run([str(python), "-c", f"import {name}"], capture_output=True)
        if found.returncode == 0:
            raise SystemExit(f"{MACHINE_ENV} has {name}, which the lent machine lacks")
    return python


def copy_tree(target: Path) -> None:
    """The working tree as a device run copies it, and the kit's wheels."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True,
                            check=True).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    shutil.copytree(KIT / "wheels", target / "gpu-kit" / "wheels")


def offline_env(python: Path, out: Path) -> dict[str, str]:
    """`python3` is the stand-in's; pip sees no index, no find-links, no config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env |= {"PATH": f"{python.parent}:/usr/bin:/bin", "PIP_CONFIG_FILE": os.devnull}
    env |= {"PIP_NO_INDEX": "1", "OUT": str(out), "CHECK_ON_CPU": "1"}
    env.pop("PYTHONPATH", None)
    return env


def no_network(command: str) -> list[str]:
    """`command` in a network namespace with loopback alone, where this machine allows one."""
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n", "bash", "-c", f"ip link set lo up && {command}"]
    print("unshare -n is not allowed here: the run is offline by pip's settings alone")
    return ["bash", "-c", command]


def figures(work: Path, out: Path, seconds: float, tests: str) -> list[str]:
    bench = json.loads((out / "bench-fp32.json").read_text())["end_to_end"]
    return [
        f"kit {size_mb(KIT / 'wheels'):.1f} MiB + working tree {tree_mb():.1f} MiB; "
        f"installed {size_mb(work / 'gpu-kit' / 'site'):.0f} MiB",
        f"the command, install and check: {seconds:.0f} s",
        *(out / "versions.txt").read_text().splitlines(),
        f"tests: {tests}",
        f"bench ({bench['model']}, cpu): {bench['tiles_per_s']:.1f} tiles/s end to end",
        *(out / "cohort" / "table.md").read_text().splitlines(),
    ]


def main() -> None:
    python = machine_env()
    if not (KIT / "wheels").is_dir():
        raise SystemExit("no gpu-kit/wheels here: run `make gpu-kit` first")
    with tempfile.TemporaryDirectory(prefix="slidesnake-kit-") as folder:
        work, out = Path(folder) / "tree", Path(folder) / "out"
        copy_tree(work)
        started = time.perf_counter()
        answer = subprocess.run(no_network(COMMAND), cwd=work, env=offline_env(python, out))
        seconds = time.perf_counter() - started
        if answer.returncode != 0:
            raise SystemExit(f"the kit's command failed ({answer.returncode})")
        tests = (out / "tests.txt").read_text().strip().splitlines()[-1]
        if re.search(r"\b(failed|errors?)\b", tests):
            raise SystemExit(f"the check's tests failed: {tests}")
        shown = figures(work, out, seconds, tests)
    print("\n".join(["", *shown]))


if __name__ == "__main__":
    main()
