"""The GPU kit's choices (benchmarks/gpu_kit.py), without the network: what it leaves out,
which wheels fit the lent machine, and that the docs give the command it prints.
`make gpu-kit-offline` tries the kit itself, offline, on a stand-in for the machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_kit  # noqa: E402


def test_the_kit_leaves_out_only_what_it_says():
    names = {gpu_kit.canonical(r.split(">")[0].split("<")[0]) for r in
             gpu_kit.project_requirements()}  # fmt: skip
    assert "s3fs" not in names and "pulp" not in names
    assert {"zarr", "snakemake", "openslide-python", "openslide-bin", "imagecodecs"} <= names
    assert {"torch", "timm"} <= names  # resolved, then dropped as the machine's


@pytest.mark.parametrize(
    ("wheel", "fits"),
    [
        ("zarr-3.1.6-py3-none-any.whl", True),
        ("imagecodecs-2026.3.6-cp312-abi3-manylinux_2_28_x86_64.whl", True),
        ("numcodecs-0.16-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
        ("greenlet-3.5-cp312-cp312-manylinux_2_34_x86_64.whl", False),  # glibc too new
        ("psutil-7.2-cp312-cp312-macosx_11_0_arm64.whl", False),
    ],
)
def test_only_wheels_the_machines_python_can_load_fit(wheel, fits):
    assert gpu_kit._fits(wheel) is fits


def test_the_machine_list_pins_its_torch_and_the_docs_give_the_printed_command():
    machine = gpu_kit.machine_requirements()
    assert "torch==2.11.0" in machine and "torchvision==0.26.0" in machine
    page = (REPO / "docs" / "gpu-workstation.md").read_text()
    assert gpu_kit.COMMAND in page
    assert "--no-index --no-deps --target" in gpu_kit.COMMAND


def test_a_trimmed_wheel_loses_the_matching_members_and_their_record_lines(tmp_path):
    import re
    import zipfile

    wheel = tmp_path / "imagecodecs-1.0-cp312-abi3-manylinux_2_28_x86_64.whl"
    kept = ["imagecodecs/__init__.py", "imagecodecs/_jpeg8.abi3.so"]
    gone = ["imagecodecs/_avif.abi3.so", "imagecodecs.libs/libaom-1.so.3"]
    record = "imagecodecs-1.0.dist-info/RECORD"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in kept + gone:
            archive.writestr(name, b"x" * 100)
        archive.writestr(record, "".join(f"{name},sha256=x,100\n" for name in kept + gone))
    gpu_kit.trim(wheel, re.compile(gpu_kit.TRIMMED["imagecodecs"]))
    with zipfile.ZipFile(wheel) as archive:
        assert sorted(archive.namelist()) == sorted([*kept, record])
        lines = archive.read(record).decode().splitlines()
    assert [line.split(",")[0] for line in lines] == kept
