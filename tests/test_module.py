"""The workflow used from other workflows: as a Snakemake module, as a snakedeploy
deployment, and with -s from a directory that has no config of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, TEST_MODEL, write_sheet

from slidesnake import load_embeddings

pytestmark = pytest.mark.workflow

# What a host gives: its sample sheet and model; every other key is the workflow's default.
HOST_CONFIG = {"samples": "config/samples.tsv", **TEST_MODEL}

HOST_SNAKEFILE = f"""\
configfile: "config/config.yaml"


module slidesnake:
    snakefile:
        "{REPO / "workflow" / "Snakefile"}"
    config:
        config


use rule * from slidesnake as slidesnake_*


rule all:
    default_target: True
    input:
        rules.slidesnake_all.input,


onsuccess:
    slidesnake.summarize_cohort()
"""


def snakemake(workdir: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "snakemake", "--cores", "2", *args]
    result = subprocess.run(command, cwd=cwd or workdir, capture_output=True, text=True)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return result


def host(workdir: Path, slide: Path) -> Path:
    (workdir / "config").mkdir(parents=True)
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(HOST_CONFIG))
    write_sheet(workdir / "config" / "samples.tsv", [("rect", slide)])
    return workdir


def assert_embedded(workdir: Path, expected_tiles: int) -> None:
    features, coords, attributes = load_embeddings(workdir / "results/slides/rect/embeddings.zarr")
    assert features.shape == (expected_tiles, 64) and len(coords) == expected_tiles
    assert attributes["model"] == "timm:test_vit"
    # A default the host did not give, from the workflow's own config/config.yaml:
    assert attributes["tile_mask_threshold"] == 0.5


def test_the_workflow_runs_as_a_module_of_another_workflow(tmp_path, rect_slide):
    workdir = host(tmp_path / "host", rect_slide)
    (workdir / "workflow").mkdir()
    (workdir / "workflow" / "Snakefile").write_text(HOST_SNAKEFILE)
    result = snakemake(workdir)
    assert "localrule slidesnake_embed_tiles:" in result.stderr
    assert_embedded(workdir, 80)
    assert (workdir / "results" / "cohort.tsv").read_text().splitlines()[1].startswith("rect\tdone")
    assert "Nothing to be done" in snakemake(workdir).stderr


def planned_jobs(dry_run: str) -> dict[str, int]:
    """Rule name (a module's prefix dropped) -> job count, from a dry run's job stats."""
    stats = dry_run.split("Job stats:")[1].split("total")[0]
    rows = (line.split() for line in stats.splitlines()[3:] if line.strip())
    return {name.removeprefix("slidesnake_"): int(count) for name, count in rows}


def test_the_top_level_snakefile_and_the_module_plan_the_same_jobs(tmp_path, rect_slide):
    """Both layouts hold: `snakemake` run in the project's root (its top-level Snakefile),
    workflow/Snakefile, and the workflow used as a module plan the same jobs."""
    workdir = host(tmp_path / "host", rect_slide)
    write_sheet(workdir / "config" / "samples.tsv", [("a", rect_slide), ("b", rect_slide)])
    (workdir / "workflow").mkdir()
    (workdir / "workflow" / "Snakefile").write_text(HOST_SNAKEFILE)
    from_root = snakemake(workdir, "-n", "--directory", str(workdir), cwd=REPO)
    assert f"Snakefile: {REPO / 'Snakefile'}" in from_root.stdout + from_root.stderr
    plain = snakemake(workdir, "-n", "-s", str(REPO / "workflow" / "Snakefile"))
    as_module = snakemake(workdir, "-n")
    jobs = planned_jobs(from_root.stdout)
    assert jobs["embed_tiles"] == 2 and jobs["make_tissue_mask"] == 2
    assert jobs == planned_jobs(plain.stdout) == planned_jobs(as_module.stdout)


def test_snakedeploy_deploys_a_runnable_workflow(tmp_path, rect_slide):
    source = tmp_path / "slidesnake"
    for part in ("workflow", "scripts", "config", "envs", "profiles"):
        shutil.copytree(REPO / part, source / part)
    deployment = tmp_path / "deployment"
    deploy = [str(Path(sys.executable).parent / "snakedeploy"), "deploy-workflow", str(source)]
    subprocess.run([*deploy, str(deployment), "--branch", "main"], check=True)
    assert (deployment / "config" / "config.yaml").is_file()
    assert (deployment / "profiles" / "slurm" / "config.yaml").is_file()
    snakefile = deployment / "workflow" / "Snakefile"
    deployed = snakefile.read_text()
    assert "use rule * from slidesnake" in deployed
    # snakedeploy writes a local source's Snakefile relative to the source's root, which
    # Snakemake reads relative to the deployment's workflow/ (a GitHub source gets a
    # github(...) reference instead): point it at the source, as a user of a local
    # deployment must.
    snakefile.write_text(deployed.replace('"workflow/Snakefile"', f'"{source}/workflow/Snakefile"'))
    config = yaml.safe_load((deployment / "config" / "config.yaml").read_text())
    for section, values in TEST_MODEL.items():
        config[section] |= values
    (deployment / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    write_sheet(deployment / "config" / "samples.tsv", [("rect", rect_slide)])
    snakemake(deployment)
    assert_embedded(deployment, 80)


def test_a_run_from_a_directory_without_config_takes_the_workflows_defaults(tmp_path, rect_slide):
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    sheet = write_sheet(workdir / "cohort.tsv", [("rect", rect_slide)])
    model = "{name: 'timm:test_vit', weights: random, precision: fp32, batch_size: 32}"
    snakemake(
        workdir,
        "--snakefile",
        str(REPO / "workflow" / "Snakefile"),
        "--config",
        f"samples={sheet}",
        f"model={model}",
        "loader={workers: 1}",
    )
    assert_embedded(workdir, 80)
