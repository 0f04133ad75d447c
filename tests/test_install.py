"""The package installs into an environment that already has its own torch (a cluster's
module, a conda environment) and leaves that torch as it is; `make install` reproduces
the versions CI tests.

The environment here gets torch 2.13 from this machine's disk: older than CI's and inside
the ranges, so a pin to CI's torch would replace it and the test tells a range from a
pin. The oldest torch the ranges accept (2.3) runs the unit tests in `make test-floor`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OLDER_TORCH = "2.13.*"
ITS_TORCHVISION = "0.28.*"

pytestmark = pytest.mark.install


def pip(python: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def env_with_torch(tmp_path_factory) -> Path:
    """A venv holding torch 2.13 from this machine's disk and its torchvision."""
    venv = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    torch = f"torch=={OLDER_TORCH}"
    # Only from local disk: the registry's build of torch brings gigabytes of CUDA.
    local = pip(python, "install", "--dry-run", "--quiet", "--no-index", "--no-deps", torch)
    if local.returncode != 0:
        pytest.skip(f"no {torch} wheel on this machine's disk")
    answer = pip(python, "install", "--quiet", torch, f"torchvision=={ITS_TORCHVISION}")
    assert answer.returncode == 0, answer.stderr[-2000:]
    return python


def installed(python: Path, name: str) -> str:
    answer = pip(python, "show", name)
    return re.search(r"^Version: (\S+)", answer.stdout, re.MULTILINE).group(1)


def test_installing_the_package_keeps_the_environments_torch(env_with_torch, tmp_path):
    before = installed(env_with_torch, "torch")
    report = tmp_path / "report.json"
    answer = pip(env_with_torch, "install", "--dry-run", "--quiet", "--report", str(report),
                 "--editable", str(REPO))  # fmt: skip
    assert answer.returncode == 0, answer.stderr[-3000:]
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}  # fmt: skip
    assert "slidesnake" in planned and "timm" in planned  # it resolved the whole package
    assert "torch" not in planned and "torchvision" not in planned, planned
    assert before.startswith("2.13.")


def test_make_install_pins_what_ci_tests():
    """Every package of .venv is in envs/constraints.txt at the version installed, and the
    Makefile installs with that file: `make install` gives CI's environment."""
    constraints = dict(
        line.split("==")
        for line in (REPO / "envs" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert {"torch", "torchvision", "snakemake", "zarr", "numpy"} <= set(constraints)
    makefile = (REPO / "Makefile").read_text()
    assert "--constraint envs/constraints.txt --editable '.[dev]'" in makefile
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    if Path(sys.prefix) != REPO / ".venv":
        pytest.skip("the tests run outside the project's .venv")
    for line in frozen.splitlines():
        name, _, version = line.partition("==")
        assert constraints.get(name) == version, f"{name} {version} is not as CI pinned"
