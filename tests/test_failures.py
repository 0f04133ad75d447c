"""Failures that cost one slide: bad files, the cohort summary, re-runs, and real signals."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import SHARED_SLIDES, jobs_run

from slidesnake.slides.synthetic import Rect, random_blobs, write_slide

pytestmark = pytest.mark.workflow

SLOW_MODEL = "model={name: timm:vit_tiny_patch16_224}"  # ~25 tiles/s here: time to kill


def summary(workflow) -> pd.DataFrame:
    return pd.read_csv(workflow.dir / "results" / "cohort.tsv", sep="\t", index_col="slide_id")


def bad_files(tmp_path: Path, good: Path) -> list[tuple]:
    """Sheet rows of files that must fail: made here, plus ../shared's broken ones."""
    text = tmp_path / "notes.svs"
    text.write_text("not a slide\n")
    truncated = tmp_path / "truncated.tif"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    rows = [("unsupported", text), ("truncated", truncated)]
    if SHARED_SLIDES.is_dir():
        rows += [
            ("unopenable", SHARED_SLIDES / "broken" / "openslide-unopenable.tiff"),
            ("unreadable", SHARED_SLIDES / "broken" / "openslide-unreadable.svs"),
            ("not-tiff", SHARED_SLIDES / "broken" / "histolab-broken.svs"),
            ("qptiff", SHARED_SLIDES / "unsupported" / "pathml-small_vectra.qptiff"),
        ]
    return rows


def test_bad_slides_fail_alone_and_a_fixed_sheet_reruns_only_them(workflow, blob_slide, tmp_path):
    no_mpp = write_slide(
        tmp_path / "no-mpp.tif", 3000, 2500, random_blobs(3000, 2500, 2, 3), mpp=None,
        vendor="generic", levels=2,
    )  # fmt: skip
    blank = write_slide(tmp_path / "blank.svs", 3000, 2500, [], mpp=0.5, levels=2)
    good = [("good", blob_slide), ("blank", blank)]
    bad = bad_files(tmp_path, blob_slide)
    workflow.sheet([*good, ("no-mpp", no_mpp), *bad])

    first = workflow.run(check=False)
    assert first.returncode != 0
    table = summary(workflow)
    assert list(table.index) == ["good", "blank", "no-mpp", *(row[0] for row in bad)]
    assert table.loc["good", "status"] == "done" and table.loc["good", "tiles"] > 0
    assert table.loc["blank", "status"] == "done" and table.loc["blank", "tiles"] == 0
    assert "does not record its microns per pixel" in table.loc["no-mpp", "reason"]
    assert "does not recognise this file" in table.loc["unsupported", "reason"]
    for slide_id, path in [("no-mpp", no_mpp), *bad]:
        reason = table.loc[slide_id, "reason"]
        assert table.loc[slide_id, "status"] == "failed"
        assert reason.startswith(f"slide '{slide_id}' ({path}): ") and ". Fix: " in reason
        assert reason in first.stderr  # the job's one line, on the terminal too
    assert "cohort: 2 done" in first.stderr
    assert_report_lists(workflow, [row[0] for row in bad])
    done_before = workflow.result("good", "embeddings.zarr").stat().st_mtime_ns

    workflow.sheet([*good, ("no-mpp", no_mpp, 0.5)])
    second = workflow.run()
    for rule in ("make_tissue_mask", "make_tile_coords", "embed_tiles"):
        assert jobs_run(second, rule) == ["no-mpp"]
    assert set(summary(workflow)["status"]) == {"done"}
    assert workflow.result("good", "embeddings.zarr").stat().st_mtime_ns == done_before


def assert_report_lists(workflow, failed: list[str]) -> None:
    """`snakemake --report` works after a run in which slides failed, and its cohort table
    names each failed slide as failed."""
    workflow.run("--report", "report.html")
    report = (workflow.dir / "report.html").read_text()
    embedded = re.search(r"filename=cohort\.html;base64,([A-Za-z0-9+/=]+)", report)
    cohort = base64.b64decode(embedded.group(1)).decode()
    rows = cohort.split('<script type="application/json" id="rows">')[1].split("</script>")[0]
    statuses = {row["slide_id"]: row["status"] for row in json.loads(rows)}
    for slide_id in failed:
        assert statuses[slide_id] == "failed" and f"<li><b>{slide_id}</b>: " in cohort
    assert "filename=cohort_gallery.jpg" in report
    assert "filename=qc_tiles.png" not in report  # per-slide pictures stay on disk


def dense_slide(tmp_path: Path) -> Path:
    """~400 tiles: 15 s of embedding with the slow model, long enough to kill mid-way."""
    return write_slide(
        tmp_path / "dense.svs", 6000, 4500, [Rect(300, 200, 5700, 4300)], mpp=0.5, levels=2
    )


def wait_for(condition, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def embedding_started(slide_dir: Path) -> bool:
    return any(slide_dir.glob(".embeddings.zarr.tmp-*"))


def test_sigkill_mid_embedding_leaves_nothing_complete_and_only_that_slide_reruns(
    workflow, blob_slide, tmp_path
):
    workflow.sheet([("small", blob_slide)])
    workflow.run("--config", SLOW_MODEL)
    workflow.sheet([("small", blob_slide), ("dense", dense_slide(tmp_path))])
    run = subprocess.Popen(
        workflow.command("--config", SLOW_MODEL),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    dense = workflow.dir / "results" / "slides" / "dense"
    wait_for(lambda: embedding_started(dense))
    time.sleep(3)
    os.killpg(run.pid, signal.SIGKILL)  # Snakemake, the job and its loader workers
    run.wait()
    assert not (dense / "embeddings.zarr").exists() and not (dense / "metrics.json").exists()

    workflow.run("--unlock")
    rerun = workflow.run("--config", SLOW_MODEL)
    assert jobs_run(rerun, "embed_tiles") == ["dense"]
    assert jobs_run(rerun, "make_tissue_mask") == []
    assert (dense / "embeddings.zarr").is_dir() and not embedding_started(dense)
    assert summary(workflow).loc["dense", "status"] == "done"


def test_sigterm_stops_an_embedding_job_within_seconds_and_cleanly(tmp_path):
    slide = dense_slide(tmp_path)
    subprocess.run([sys.executable, "-m", "slidesnake", "mask", str(slide), str(tmp_path)])
    subprocess.run([sys.executable, "-m", "slidesnake", "tiles", str(slide), str(tmp_path)])
    out = tmp_path / "out"
    job = subprocess.Popen(
        [
            sys.executable, "-m", "slidesnake", "embed", str(slide),
            str(tmp_path / "tiles.parquet"), str(out), "--model", "timm:vit_tiny_patch16_224",
            "--weights", "random", "--precision", "fp32", "--workers", "1",
        ],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: embedding_started(out))
    time.sleep(2)
    job.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, stderr = job.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert job.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
    assert list(out.iterdir()) == [], "no output, no temporary left"
    assert not processes_mentioning(str(out)), "loader workers are gone too"


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_text().replace("\0", " "):
                found.append(int(proc.name))
        except OSError:
            continue
    return found
