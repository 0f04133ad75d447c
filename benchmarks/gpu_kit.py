"""The GPU kit (`make gpu-kit`): the wheels the lent GPU machine lacks, for its Python.

The machine has no network and its own Python 3.12 with torch (envs/gpu-machine.txt).
The kit is every package the project needs at run time that the machine's packages do
not already bring, resolved for CPython 3.12 on manylinux x86-64 beside the machine's
torch, downloaded as wheels into gpu-kit/wheels/ (git-ignored) beside the project's own
wheel. On the machine, `COMMAND` installs the wheels with
`pip --no-index --no-deps --target` into a folder on PYTHONPATH, which leaves the
machine's torch as it is, and runs the GPU check.

    .venv/bin/python benchmarks/gpu_kit.py [--out gpu-kit]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MACHINE = REPO / "envs" / "gpu-machine.txt"
CI_PINS = REPO / "envs" / "constraints.txt"
# The 64 MiB a device run carries, less the working tree and a margin.
KIT_LIMIT_MB = 56
PYTHON_VERSION = "3.12"
# Left out to fit the 64 MiB, each with all it alone brings; the check uses none of them.
LEFT_OUT = {
    "s3fs": "slides in S3 buckets (with botocore, 17 MiB)",
    "pulp": "Snakemake's ILP scheduler (16 MiB): the check runs --scheduler greedy",
}
# The extras the check runs beside the package's requirements: loader.decode gpu.
EXTRAS = ("gpu-decode",)
# Carried without the parts the machine cannot use, to fit the 64 MiB (members of the
# wheel whose path matches, and their RECORD lines): imagecodecs without the codecs of no
# slide format (AVIF, JPEG XL, pcodec, SZ3: 8.4 MiB of its 25), nvImageCodec with only
# CPython 3.12's module and its JPEG decoders (5 MiB of its 24).
TRIMMED = {
    "imagecodecs": r"imagecodecs(\.libs)?/(_avif|libavif|libaom|_jpegxl|libjxl|_pcodec"
    r"|libcpcodec|_sz3|libSZ3c)",
    "nvidia-nvimgcodec-cu13": r"nvidia/nvimgcodec/(include/|tools/|nvimgcodec_impl\.cpython-"
    r"(?!312-)|extensions/lib(?!nvjpeg_ext|jpeg_turbo_ext))",
}
# The kit is resolved by a CPython 3.12 here, which may build the pure-Python packages
# published only as source (pip cannot for another interpreter).
PYTHON312 = os.environ.get("PYTHON312", "python3.12")
# Every manylinux tag a glibc 2.28 machine (the oldest torch 2.11's wheels run on) takes.
PLATFORMS = [
    *(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)),
    *("manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"),
]
# Compiled wheels are fetched for those tags, not for the glibc of the machine making the kit.
PLATFORM_ARGS = [
    *("--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", "cp312"),
    *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
    "--only-binary=:all:",
]
# Run from the repository root on the lent machine, with the kit carried beside it.
COMMAND = (
    "python3 -m pip install --quiet --no-index --no-deps --target gpu-kit/site "
    "gpu-kit/wheels/*.whl && PYTHONPATH=$PWD:$PWD/gpu-kit/site "
    "PATH=$PWD/gpu-kit/site/bin:$PATH PYTHON=python3 benchmarks/gpu_check.sh"
)


class KitError(RuntimeError):
    """pip could not resolve or download the kit."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_requirements() -> list[str]:
    lines = MACHINE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def project_requirements() -> list[str]:
    """The package's run-time requirements and its `EXTRAS`', less those `LEFT_OUT`."""
    with open(REPO / "pyproject.toml", "rb") as file:
        project = tomllib.load(file)["project"]
    extras = project["optional-dependencies"]
    requirements = [*project["dependencies"], *(r for name in EXTRAS for r in extras[name])]
    return [r for r in requirements if canonical(re.split(r"[<>=!~\[; ]", r)[0]) not in LEFT_OUT]


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON312, "-m", "pip", *args], capture_output=True, text=True)


def resolve(requirements: list[str], pins: list[str]) -> dict[str, tuple[str, str]]:
    """What pip would install into an empty Python 3.12: canonical name -> (version,
    URL), read from its report (metadata only: nothing large is fetched)."""
    with tempfile.TemporaryDirectory() as folder:
        report, constraints = Path(folder) / "report.json", Path(folder) / "pins.txt"
        constraints.write_text("\n".join(pins) + "\n")
        answer = pip("install", "--dry-run", "--quiet", "--ignore-installed", "--target",
                     f"{folder}/target", "--report", str(report), "--constraint",
                     str(constraints), *requirements)  # fmt: skip
        if answer.returncode != 0:
            raise KitError(f"pip could not resolve {requirements}:\n{answer.stderr[-3000:]}")
        items = json.loads(report.read_text())["install"]
    return {
        canonical(item["metadata"]["name"]): (
            item["metadata"]["version"],
            item["download_info"]["url"],
        )
        for item in items
    }


def kit_packages() -> dict[str, tuple[str, str]]:
    """name -> (version, URL) of what the project needs beyond the machine's packages and
    all they bring, resolved beside the machine's pinned torch and torchvision, at the
    versions CI tests (envs/constraints.txt) where the machine has none."""
    machine = machine_requirements()
    pins = [line for line in machine if "==" in line]
    present = resolve(machine, pins)
    tested = [line for line in CI_PINS.read_text().splitlines()
              if "==" in line and canonical(line.split("==")[0]) not in present]  # fmt: skip
    needed = resolve(project_requirements(), pins + tested)
    return {
        name: found
        for name, found in needed.items()
        if name not in present and name not in LEFT_OUT
    }


def download(packages: dict[str, tuple[str, str]], wheels: Path) -> None:
    """Compiled wheels for the machine's tags; pure-Python wheels as they are, built here
    from source where a package publishes no wheel."""
    wheels.mkdir(parents=True, exist_ok=True)
    for stale in wheels.glob("*.whl"):
        stale.unlink()
    compiled = {n: v for n, (v, url) in packages.items() if _compiled(url)}
    pure = {n: v for n, (v, url) in packages.items() if not _compiled(url)}
    for args in (
        ("download", *PLATFORM_ARGS, *_pinned(compiled)),
        ("wheel", *_pinned(pure)),
    ):
        answer = pip(args[0], "--quiet", "--no-deps", "--dest" if args[0] == "download"
                     else "--wheel-dir", str(wheels), *args[1:])  # fmt: skip
        if answer.returncode != 0:
            raise KitError(f"pip could not fetch the kit:\n{answer.stderr[-3000:]}")
    project_wheel(wheels)
    for wheel in wheels.glob("*.whl"):
        dropped = TRIMMED.get(canonical(wheel.name.split("-")[0]))
        if dropped:
            trim(wheel, re.compile(dropped))
    built = [w.name for w in wheels.glob("*.whl") if not _fits(w.name)]
    if built:
        raise KitError(f"wheels that do not fit the machine's Python: {built}")


def trim(wheel: Path, dropped: re.Pattern) -> None:
    """Rewrite `wheel` without its members whose path `dropped` matches, and without
    their lines in its RECORD (pip installs what the RECORD lists)."""
    trimmed = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(trimmed, "w") as target:
        for member in source.infolist():
            if dropped.match(member.filename):
                continue
            data = source.read(member)
            if member.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not dropped.match(line)]
                data = ("\n".join(kept) + "\n").encode()
            target.writestr(member, data, zipfile.ZIP_DEFLATED, 9)
    trimmed.replace(wheel)


def project_wheel(wheels: Path) -> None:
    """The project's wheel, for its metadata and `slidesnake` command (its code is
    imported from the working tree, first on PYTHONPATH), built from a copy: setuptools
    leaves a build/ folder where it builds."""
    with tempfile.TemporaryDirectory() as folder:
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, folder)
        shutil.copytree(REPO / "slidesnake", Path(folder) / "slidesnake",
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        answer = pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), folder)
    if answer.returncode != 0:
        raise KitError(f"pip could not build the project's wheel:\n{answer.stderr[-3000:]}")


def _compiled(url: str) -> bool:
    return url.endswith(".whl") and not url.endswith("-none-any.whl")


def _fits(wheel: str) -> bool:
    return wheel.endswith("-none-any.whl") or any(p in wheel for p in PLATFORMS)


def _pinned(packages: dict[str, str]) -> list[str]:
    return [f"{name}=={version}" for name, version in sorted(packages.items())]


def size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def tree_mb() -> float:
    """The working tree a device run copies: tracked and untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True,
                            check=True).stdout  # fmt: skip
    paths = [REPO / name for name in listed.decode().split("\0") if name]
    return sum(path.stat().st_size for path in paths if path.is_file()) / 2**20


def check_python312() -> None:
    try:
        answer = pip("--version")
    except OSError as err:
        answer = subprocess.CompletedProcess([], 1, "", str(err))
    if answer.returncode != 0 or "(python 3.12)" not in answer.stdout:
        raise SystemExit(
            f"PYTHON312={PYTHON312} is not a CPython 3.12 with pip here "
            f"({(answer.stderr or answer.stdout).strip()[:200]}); give its path, e.g. "
            "make gpu-kit PYTHON312=/usr/bin/python3.12"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "gpu-kit")
    args = parser.parse_args()
    check_python312()
    packages = kit_packages()
    wheels = args.out / "wheels"
    download(packages, wheels)
    (args.out / "packages.txt").write_text(
        "".join(f"{name}=={version}\n" for name, (version, _) in sorted(packages.items()))
    )
    kit, tree = size_mb(args.out), tree_mb()
    print(f"{len(packages)} wheels for CPython {PYTHON_VERSION}, manylinux x86-64, in {wheels}")
    print(f"kit {kit:.1f} MiB + working tree {tree:.1f} MiB = {kit + tree:.1f} MiB (limit 64)")
    if kit > KIT_LIMIT_MB:
        raise SystemExit(f"the kit is {kit:.1f} MiB, over its {KIT_LIMIT_MB} MiB")
    for name, why in LEFT_OUT.items():
        print(f"left out: {name}, {why}")
    print("On the lent machine, from the repository root (the run tool: carry gpu-kit):")
    print(f"  {COMMAND}")


if __name__ == "__main__":
    main()
