"""A cohort's state while its run goes on, from what has landed in its working directory:
`slidesnake status`. The end-of-run summary stays the source of truth; this reads the
same outputs and logs, and Snakemake's own traces of the run (its log, its lock).

The rate is that of the latest embeddings: the tiles of the slides finished in the last
WINDOW_S, over the time between the first and the last of them, so the masking and tiling
Snakemake may run first do not count as slow embedding, and in a steady run the gaps
between slides hold everything a slide costs. The time left is the tiles not yet
embedded at that rate: a tiled slide's own tile count, an untiled one's the mean.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from slidesnake.atomic import atomic_output
from slidesnake.cohort.page import COHORT_PICTURES, cohort_page
from slidesnake.cohort.summary import cohort_table

WINDOW_S = 300.0


@dataclass(frozen=True)
class RunState:
    """One look at a cohort: its table (cohort.tsv's, with 'running' rows), and what it
    says of the run."""

    table: pd.DataFrame
    live: bool  # a Snakemake holds the working directory
    started: float | None  # when the latest run started
    tiles_done: int
    tiles_left: int
    rate: float | None  # tiles/s over the latest finished slides
    eta_s: float | None

    def lines(self) -> list[str]:
        counts = self.table["status"].value_counts()
        unit = "slide-model pairs" if "model" in self.table else "slides"
        statuses = ("done", "failed", "running", "pending")
        state = "running" if self.live else "not running (the last run ended)"
        if self.started:
            state += f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}"
        lines = [
            f"cohort of {len(self.table)} {unit}: "
            + ", ".join(f"{counts.get(s, 0)} {s}" for s in statuses),
            f"run: {state}",
            f"tiles: {self.tiles_done:,} embedded, about {self.tiles_left:,} to go",
        ]
        if self.rate is not None:
            lines.append(f"rate: {self.rate:,.1f} tiles/s over the latest slides")
        if self.live and self.eta_s is not None:
            lines.append(f"time left: about {_duration(self.eta_s)}")
        failed = self.table[self.table["status"] == "failed"]
        lines += [f"failed: {row.slide_id}: {row.reason}" for row in failed.itertuples()]
        return lines


def run_state(
    workdir: Path, slide_ids: list[str], models: Sequence[str] = (), now: float | None = None
) -> RunState:
    """The state of the cohort of `slide_ids` (and `models` keys) run in `workdir`."""
    now = time.time() if now is None else now
    live, started = run_is_live(workdir), run_started(workdir)
    results = workdir / "results" / "slides"
    table = cohort_table(slide_ids, results, workdir / "logs" / "slides", started, models, live)
    done = table[table["status"] == "done"]
    finished = _finish_times(done, results)
    rate = tiles_rate(finished, now)
    left = tiles_left(table, results)
    eta = None
    if rate:
        eta = max(left / rate - (now - max(t for t, _ in finished)), 0.0)
    tiles = int(done["tiles"].sum()) if len(done) else 0
    return RunState(table, live, started, tiles, left, rate, eta)


def run_is_live(workdir: Path) -> bool:
    """Snakemake holds a lock in .snakemake/locks for as long as it runs."""
    locks = workdir / ".snakemake" / "locks"
    return locks.is_dir() and any(locks.iterdir())


def run_started(workdir: Path) -> float | None:
    """The start of the latest run: the time its log (.snakemake/log/<start>.snakemake.log)
    is named by."""
    logs = sorted((workdir / ".snakemake" / "log").glob("*.snakemake.log"))
    if not logs:
        return None
    stamp = logs[-1].name.removesuffix(".snakemake.log")
    return datetime.strptime(stamp, "%Y-%m-%dT%H%M%S.%f").timestamp()


def _finish_times(done: pd.DataFrame, results: Path) -> list[tuple[float, int]]:
    """(when its metrics were written, tiles) of each done row."""
    models = done["model"] if "model" in done else [""] * len(done)
    return [
        ((results / slide_id / model / "metrics.json").stat().st_mtime, int(tiles))
        for slide_id, model, tiles in zip(done["slide_id"], models, done["tiles"], strict=True)
    ]


def tiles_rate(finished: list[tuple[float, int]], now: float) -> float | None:
    """Tiles/s of the slides finished in the last WINDOW_S: those after the first over the
    time since it; None until two have finished there."""
    recent = sorted(item for item in finished if item[0] >= now - WINDOW_S)
    if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
        return None
    return sum(tiles for _, tiles in recent[1:]) / (recent[-1][0] - recent[0][0])


def tiles_left(table: pd.DataFrame, results: Path) -> int:
    """The tiles of the rows still to embed (neither done nor failed): a tiled slide's
    table, else the mean of the known."""
    known, unknown = [], 0
    for row in table[~table["status"].isin(("done", "failed"))].itertuples():
        path = results / row.slide_id / "tiles.parquet"
        if path.is_file():
            known.append(pq.read_metadata(path).num_rows)
        else:
            unknown += 1
    every = [*known, *table.loc[table["status"] == "done", "tiles"].dropna().astype(int)]
    mean = sum(every) / len(every) if every else 0.0
    return int(sum(known) + math.ceil(unknown * mean))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s"


def write_live_page(state: RunState, results: Path) -> Path:
    """results/cohort.html from `state`, with the cohort pictures the last summary drew."""
    pictures = {name: results / name for name in COHORT_PICTURES if (results / name).is_file()}
    page = cohort_page(state.table, results, pictures, finished=not state.live)
    with atomic_output(results / "cohort.html") as tmp:
        tmp.write_text(page)
    return results / "cohort.html"
