"""Each ready-to-copy configuration in config/examples/ passes the workflow's validation
and plans a whole cohort in a dry run, with the command line its header gives."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import REPO, Workflow

pytestmark = pytest.mark.workflow

EXAMPLES = sorted((REPO / "config" / "examples").glob("*.yaml"))


def command_line(example: Path) -> list[str]:
    """The snakemake arguments of the example's header, less --cores and the sample sheet
    (the test's own), with the example's path as it lies here."""
    lines = [line.removeprefix("#").strip() for line in example.read_text().splitlines()
             if line.startswith("#   ") or line.startswith("#       ")]  # fmt: skip
    text = " ".join(line.removesuffix("\\").strip() for line in lines)
    text = text[text.index("snakemake ") + len("snakemake ") :].split(" Check first:")[0]
    args = shlex.split(text.replace("config/examples/", str(example.parent) + "/"))
    dropped = {"--config": 1, "--cores": 1}
    kept, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in dropped:
            skip = dropped[arg]
        else:
            kept.append(arg)
    return [a.replace("profiles/", str(REPO / "profiles") + "/") for a in kept]


def test_every_example_is_tested():
    assert {e.stem for e in EXAMPLES} >= {"workstation-1gpu", "node-8gpu", "slurm",
                                          "remote-server", "cpu-laptop"}  # fmt: skip


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_an_example_config_plans_the_cohort(example, tmp_path, rect_slide, blob_slide):
    workflow = Workflow(tmp_path / "run")
    workflow.sheet([("a", rect_slide), ("b", blob_slide)])
    for checkpoint in re.findall(r"checkpoint: (weights/\S+)", example.read_text()):
        # What `slidesnake weights fetch` lays out; a dry run only needs the file there.
        (workflow.dir / checkpoint).parent.mkdir(parents=True, exist_ok=True)
        (workflow.dir / checkpoint).write_bytes(b"\0" * 1024)
    result = workflow.run("-n", *command_line(example))
    jobs = dict(re.findall(r"^(\w+)\s+(\d+)$", result.stdout, re.MULTILINE))
    assert jobs["embed_tiles"] == "2" and jobs["make_tile_coords"] == "2", result.stdout
