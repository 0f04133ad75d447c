"""Shared fixtures: synthetic slides made on the spot, the real slides in ../shared, and a
helper that runs the real workflow in a scratch directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tifffile
import torch
import yaml

from slidesnake.embed.job import ONE_MODEL, embed_slide
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.slides.synthetic import Rect, random_blobs, write_slide

if "PYTEST_XDIST_WORKER" in os.environ:
    # `make test` runs a test process per core: torch's thread pool in each (and in the
    # processes each starts) would only contend for the same cores. A Snakemake job
    # still gets its own threads' worth, which Snakemake sets.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO = Path(__file__).resolve().parents[1]
SHARED_SLIDES = REPO.parent / "shared" / "slides"

# A 40x slide whose tissue is one rectangle aligned to both the 0.5 µm/px tile grid
# (448 level-0 px) and the 8 µm/px mask grid (32 level-0 px): 10 x 8 whole tiles.
RECT_SLIDE = {"width": 448 * 20, "height": 448 * 16, "mpp": 0.25}
RECT_TISSUE = Rect(448 * 5, 448 * 4, 448 * 15, 448 * 12)
RECT_TILES = (10, 8)

# The tests' model: timm's 0.3 M-parameter test ViT with random weights, ~200 tiles/s on
# this CPU. One loader worker, so that two jobs fit on two cores.
TEST_MODEL = {
    "model": {"name": "timm:test_vit", "weights": "random", "precision": "fp32", "batch_size": 32},
    "loader": {"workers": 1},
}


class ChannelGrid(torch.nn.Module):
    """An informative test model: the mean of each channel over a 4 x 4 grid of the tile,
    (B, 3, S, S) -> (B, 48), so a wrong pixel, position or channel changes the features."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)


@pytest.fixture(autouse=True, scope="session")
def weights_digest_cache(tmp_path_factory) -> None:
    """The weights digests of the tests' checkpoints stay out of the user's cache."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def rect_slide(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slides") / "rect.svs"
    return write_slide(path, shapes=[RECT_TISSUE], levels=3, **RECT_SLIDE)


@pytest.fixture(scope="session")
def blob_slide(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("slides") / "blobs.tif"
    shapes = random_blobs(6000, 4500, count=3, seed=7)
    return write_slide(path, 6000, 4500, shapes, mpp=0.5, levels=2, vendor="generic", seed=7)


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on loopback, with the tests' credentials in the environment."""
    from store_servers import S3_ENV, s3_server

    saved = {key: os.environ.get(key) for key in S3_ENV}
    os.environ.update(S3_ENV)
    with s3_server() as server:
        yield server
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """The Range-capable HTTP server of store_servers, on loopback, with its hostile paths."""
    from store_servers import RangeServer

    server = RangeServer(tmp_path_factory.mktemp("served"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_slides() -> Path:
    if not SHARED_SLIDES.is_dir():
        pytest.skip("../shared/slides is absent (a fresh clone has no real slides)")
    return SHARED_SLIDES


def embed_one(slide, slide_id: str, tiles, zarr, metrics, settings, **options) -> dict:
    """The run's one model (a list of one) embedding `slide`: its metrics."""
    outputs = {ONE_MODEL: ModelOutputs(Path(zarr), Path(metrics))}
    return embed_slide(slide, slide_id, tiles, outputs, {ONE_MODEL: settings}, **options)[ONE_MODEL]


def corrupted_copy(slide: Path, out: Path, x: int, y: int) -> Path:
    """A copy of `slide` whose level-0 compressed tile under (x, y) is all zeros."""
    copy = out / f"corrupt-{slide.name}"
    shutil.copy(slide, copy)
    with tifffile.TiffFile(copy) as tiff:
        page = tiff.pages[0]
        across = -(-page.imagewidth // page.tilewidth)
        index = y // page.tilelength * across + x // page.tilewidth
        offset, count = page.dataoffsets[index], page.databytecounts[index]
    with copy.open("r+b") as f:
        f.seek(offset)
        f.write(bytes(count))
    return copy


def write_sheet(path: Path, rows: list[tuple]) -> Path:
    """A sample sheet with slide_id, path and mpp ('' for none)."""
    lines = ["slide_id\tpath\tmpp"]
    lines += ["\t".join(str(v) for v in (*row, "")[:3]) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def jobs_run(result: subprocess.CompletedProcess, rule: str) -> list[str]:
    """slide ids of the jobs of `rule` that Snakemake started, from its output."""
    lines = result.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == f"localrule {rule}:"]
    ids = []
    for i in starts:
        wildcard = next(line for line in lines[i:] if "wildcards: slide_id=" in line)
        ids.append(wildcard.split("slide_id=")[1].strip())
    return sorted(ids)


class Workflow:
    """A scratch working directory with the project's default config (model: the tests'
    model) and a sample sheet."""

    def __init__(self, workdir: Path, snakefile: Path = REPO / "workflow" / "Snakefile") -> None:
        self.dir = workdir
        self.snakefile = snakefile
        (workdir / "config").mkdir(parents=True, exist_ok=True)
        config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        for section, values in TEST_MODEL.items():
            config[section] |= values
        (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))

    def sheet(self, rows: list[tuple]) -> Path:
        return write_sheet(self.dir / "config" / "samples.tsv", rows)

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "snakemake",
            "--snakefile",
            str(self.snakefile),
            "--directory",
            str(self.dir),
            "--cores",
            "2",
            *args,
        ]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(*args), capture_output=True, text=True)
        if check and result.returncode != 0:
            raise AssertionError(f"snakemake failed:\n{result.stdout}\n{result.stderr}")
        return result

    def result(self, slide_id: str, name: str) -> Path:
        return self.dir / "results" / "slides" / slide_id / name

    def log(self, slide_id: str, rule: str) -> str:
        return (self.dir / "logs" / "slides" / slide_id / f"{rule}.log").read_text()


@pytest.fixture
def workflow(tmp_path) -> Workflow:
    return Workflow(tmp_path / "run")
