"""`slidesnake status`: a cohort's state from what has landed, during a run (a job held
open by a store that drips its bytes) and after it, and its estimate of the time left."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Workflow

from slidesnake.cli import main

pytestmark = pytest.mark.workflow


def status(results: Path, capsys) -> str:
    main(["status", str(results)])
    return capsys.readouterr().out


def status_once(results: Path, capsys, words: str, timeout_s: float = 240.0) -> str:
    """The first status that says `words`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if words in (said := status(results, capsys)):
            return said
        time.sleep(0.2)
    raise AssertionError(f"no status said {words!r} in {timeout_s} s; the last:\n{said}")


def test_status_of_a_finished_run_and_its_page(workflow, rect_slide, tmp_path, capsys):
    broken = tmp_path / "broken.svs"
    broken.write_bytes(b"II*\x00" + bytes(100))
    workflow.sheet([("rect", rect_slide), ("broken", broken)])
    assert workflow.run(check=False).returncode != 0
    said = status(workflow.dir / "results", capsys)
    assert "cohort of 2 slides: 1 done, 1 failed, 0 running, 0 pending" in said
    assert "run: not running" in said and "tiles: 80 embedded, about 0 to go" in said
    assert "failed: broken: slide 'broken'" in said and "time left" not in said
    page = (workflow.dir / "results" / "cohort.html").read_text()
    assert "the run had finished" in page and "<b>1</b> of 2 slides done" in page


def test_status_while_a_job_is_held_open_then_stopped(
    workflow, web, rect_slide, blob_slide, capsys
):
    """A slide whose store drips its bytes keeps its job running while the others
    finish: status sees the run live, that slide running, and says so on the page."""
    url = web.add(rect_slide, "drip/held.svs")  # every ranged read a byte per half second
    workflow.sheet([("rect", rect_slide), ("blobs", blob_slide), ("held", url)])
    # A core beyond the two an embedding job takes: the held job keeps one.
    command = [*workflow.command(), "--cores", "3"]
    run = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    results = workflow.dir / "results"
    try:
        said = status_once(results, capsys, "2 done")
        assert "cohort of 3 slides: 2 done, 0 failed, 1 running, 0 pending" in said
        assert "run: running" in said and "tiles: 154 embedded" in said
        page = (results / "cohort.html").read_text()
        assert "the run was still going" in page and '"status": "running"' in page
    finally:  # Ctrl-C, as a terminal sends it: to Snakemake and its jobs
        os.killpg(run.pid, signal.SIGINT)
        run.wait(120)
    said = status(results, capsys)  # killed before its first line: as if never started
    assert "2 done, 0 failed, 0 running, 1 pending" in said and "run: not running" in said
    assert "the run had finished" in (results / "cohort.html").read_text()


def test_the_time_left_on_equal_slides_is_estimated_within_a_fifth(tmp_path, rect_slide, capsys):
    """Eight links to one slide, one job at a time: the estimate once three are done,
    against when the last embedding was written."""
    workflow = Workflow(tmp_path / "run")
    links = []
    for index in range(8):
        links.append(tmp_path / f"s{index}.svs")
        links[-1].symlink_to(rect_slide)
    workflow.sheet([(f"s{index}", link) for index, link in enumerate(links)])
    command = [*workflow.command(), "--cores", "1"]
    run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = workflow.dir / "results"
    try:
        said = status_once(results, capsys, "time left")
        asked = time.time()
        assert run.wait(300) == 0
    finally:
        run.kill()
    left = said.split("time left: about ")[1].split("\n")[0]
    minutes, seconds = (int(part.split()[0]) for part in left.split(" min "))
    estimate = 60 * minutes + seconds
    last = max(path.stat().st_mtime for path in results.glob("slides/*/metrics.json"))
    assert abs(estimate - (last - asked)) <= 0.2 * (last - asked) + 1, (estimate, last - asked)
