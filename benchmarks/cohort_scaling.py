"""What the workflow itself costs as the cohort grows: 100, 1,000 and 10,000 slides.

Sample sheets of N symbolic links to one small synthetic slide. For each N: the dry run
(`snakemake -n`, wall time and the Snakemake process's peak memory). Then a real run of
the cheap stages (masking and tiling) on `--real` slides, the cohort summary and
`--report`: the scheduler's overhead per job (wall time minus the jobs' own time spread
over the cores); resuming it (the same command again: what Snakemake re-checks when every
slide is done); the summary's time at that size and at 10 times it; and the report's time
and size. Printed per slide,
with how each grows from 1,000 to 10,000 (the ratio; linear is 10). Then the cohort page
of `--page` slides (10,000): three slides embedded for real, the rest links to their
outputs and logs (one in a hundred failed), the summary that writes the page, its size,
its open in headless Chromium (the page's own time to a usable table, and the browser's
whole run), and `slidesnake status` on it.

    python benchmarks/cohort_scaling.py [--sizes 100 1000 10000] [--real 1000] [--cores 2]
        [--page 10000]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from slidesnake.cohort.summary import write_cohort_summary
from slidesnake.slides.synthetic import random_blobs, write_slide

REPO = Path(__file__).resolve().parents[1]
# A registry model: the workflow then checks the config without importing torch or timm,
# as it does for users of H-optimus (a `timm:` name costs the Snakemake process 2 s and
# 1 GB once, to check the architecture exists). Only the CPU stages run here.
CONFIG = {"model": {"name": "h-optimus-0", "weights": "random"}}


def tiny_slide(path: Path) -> Path:
    """The one small synthetic slide every row of a benchmark cohort links to."""
    return write_slide(path, 2000, 1500, random_blobs(2000, 1500, 2, 1), mpp=0.5, levels=2)


def cohort(directory: Path, slide: Path, size: int) -> Path:
    """A working directory whose sheet lists `size` links to `slide`."""
    workdir = directory / f"cohort-{size}"
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    (workdir / "slides").mkdir(exist_ok=True)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for section, values in CONFIG.items():
        config[section] |= values
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    rows = ["slide_id\tpath"]
    for i in range(size):
        link = workdir / "slides" / f"s{i:05d}.svs"
        if not link.is_symlink():
            link.symlink_to(slide)
        rows.append(f"s{i:05d}\tslides/s{i:05d}.svs")
    (workdir / "config" / "samples.tsv").write_text("\n".join(rows) + "\n")
    return workdir


def snakemake(workdir: Path, *args: str) -> tuple[float, float]:
    """(wall s, peak MB) of one Snakemake command in `workdir`."""
    command = ["/usr/bin/time", "-f", "%M", sys.executable, "-m", "snakemake",
               "--snakefile", str(REPO / "workflow" / "Snakefile"), *args]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"snakemake {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return wall, int(done.stderr.strip().splitlines()[-1]) / 1024


def jobs_own_s(workdir: Path) -> tuple[int, float]:
    """(jobs, seconds) from Snakemake's own record of each job's start and end."""
    spans = {}
    for record in (workdir / ".snakemake" / "metadata").iterdir():
        meta = json.loads(record.read_text())
        spans[meta["rule"], meta["job_hash"]] = meta["endtime"] - meta["starttime"]
    return len(spans), sum(spans.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--real", type=int, default=1000, help="slides of the real run; 0: none")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--page", type=int, default=10000, help="slides of the page; 0: none")
    parser.add_argument(
        "--workdir", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-scaling"
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    slide = args.workdir / "tiny.svs"
    if not slide.exists():
        tiny_slide(slide)

    print("dry run (snakemake -n), the Snakemake process:")
    dry = {}
    for size in args.sizes:
        wall, peak = snakemake(cohort(args.workdir, slide, size), "-n", "--cores", "1")
        dry[size] = wall
        print(
            f"  {size:6d} slides: {wall:7.1f} s, {peak:6.0f} MB, {1000 * wall / size:6.1f} ms/slide"
        )
    if 1000 in dry and 10000 in dry:
        print(f"  growth 1,000 -> 10,000: {dry[10000] / dry[1000]:.1f}x (linear: 10)")

    if args.real:
        real_run(args.workdir, slide, args.real, args.cores)
    if args.page:
        page_run(args.workdir, slide, args.page)


def real_run(directory: Path, slide: Path, size: int, cores: int) -> None:
    """Masking and tiling of `size` slides for real, then the summary and the report."""
    workdir = cohort(directory, slide, size)
    for earlier in ("results", "logs", ".snakemake"):  # a real run, not "nothing to be done"
        shutil.rmtree(workdir / earlier, ignore_errors=True)
    print(f"real run of masking and tiling, {size} slides, {cores} cores:")
    wall, peak = snakemake(workdir, "--cores", str(cores), "--until", "make_tile_coords")
    jobs, own = jobs_own_s(workdir)
    overhead = wall - own / cores
    print(f"  {jobs} jobs in {wall:.1f} s ({peak:.0f} MB); the jobs' own time {own:.1f} s; "
          f"scheduler overhead {1000 * overhead / jobs:.0f} ms per job")  # fmt: skip

    wall, _ = snakemake(workdir, "--cores", str(cores), "--until", "make_tile_coords")
    print(f"  resume (the same command again, every slide done): {wall:.1f} s, "
          f"{jobs_own_s(workdir)[0] - jobs} jobs run")  # fmt: skip

    for scale in (10, 1):  # the report below carries the last summary: `size` slides
        summary = summary_s(workdir, size, scale)
        print(f"  cohort summary of {scale * size} slides: {summary:.2f} s, "
              f"{1000 * summary / (scale * size):.2f} ms/slide")  # fmt: skip

    wall, _ = snakemake(workdir, "--report", "report.html", "--cores", "1")
    size_mb = (workdir / "report.html").stat().st_size / 1e6
    print(f"  --report: {wall:.1f} s, {size_mb:.1f} MB")


def summary_s(workdir: Path, size: int, scale: int) -> float:
    """Seconds to write the summary of `scale` x `size` slides: the slides past `size` are
    links to the results and logs of the first `size`, so every one has files to read."""
    for i in range(size, scale * size):
        for tree in ("results/slides", "logs/slides"):
            link = workdir / tree / f"s{i:05d}"
            if not link.is_symlink():
                link.symlink_to(workdir / tree / f"s{i % size:05d}")
    started = time.perf_counter()
    ids = [f"s{i:05d}" for i in range(scale * size)]
    # since=0: every job's log counts as this run's, so every log is read (the worst case)
    write_cohort_summary(ids, workdir / "results", workdir / "logs" / "slides", 0.0)
    return time.perf_counter() - started


def page_run(directory: Path, slide: Path, size: int, real: int = 3) -> None:
    """The cohort page of `size` slides, and `slidesnake status` on them."""
    workdir = cohort(directory, slide, real)
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    config["model"] |= {"name": "timm:vit_tiny_patch16_224", "precision": "fp32"}
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(workdir, "--cores", "2")
    workdir = cohort(directory, slide, size)  # the same folder names, `size` rows
    for earlier in ("results", "logs"):
        shutil.rmtree(workdir / earlier, ignore_errors=True)  # links, not what they name
    for i in range(size):
        for tree in ("results/slides", "logs/slides"):
            link = workdir / tree / f"s{i:05d}"
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(directory / f"cohort-{real}" / tree / f"s{i % real:05d}")
    for i in range(real, size, 100):  # one slide in a hundred failed in this run
        log = workdir / "logs" / "slides" / f"s{i:05d}"
        log.unlink()
        log.mkdir()
        (log / "embed_tiles.log").write_text(
            "2026-01-01 00:00:00,000 ERROR slidesnake: slide 's': the tile at (0, 0) could "
            "not be decoded. Fix: re-export the slide\n"
        )
    ids = [f"s{i:05d}" for i in range(size)]
    started = time.perf_counter()
    write_cohort_summary(ids, workdir / "results", workdir / "logs" / "slides", 0.0)
    summary = time.perf_counter() - started
    page = workdir / "results" / "cohort.html"
    print(f"cohort page of {size} slides: summary {summary:.1f} s, "
          f"page {page.stat().st_size / 1e6:.1f} MB")  # fmt: skip
    for attempt in (1, 2):  # the first opens a cold browser
        wall, ready_ms = open_in_chromium(page)
        print(f"  opened in headless Chromium ({attempt}): table usable {ready_ms / 1000:.2f} s "
              f"after navigation; the browser's whole run {wall:.1f} s")  # fmt: skip
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "slidesnake", "status", str(workdir / "results")],
                   check=True, capture_output=True)  # fmt: skip
    print(f"  slidesnake status: {time.perf_counter() - started:.1f} s")


def open_in_chromium(page: Path) -> tuple[float, float]:
    """(wall s of a headless Chromium that loads `page` and dumps its DOM, ms from
    navigation to the page's table drawn and its filters live)."""
    command = ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
               "--virtual-time-budget=30000", "--dump-dom", page.as_uri()]  # fmt: skip
    started = time.perf_counter()
    dom = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - started
    return wall, float(dom.split('data-ready-ms="')[1].split('"')[0])


if __name__ == "__main__":
    main()
