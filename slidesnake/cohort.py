"""results/cohort.tsv: every slide of the sheet, done, failed (and why) or pending.

Snakemake skips the jobs downstream of a failed one, so a summary rule would never run on
a cohort with one bad slide. The summary is written by the workflow's onsuccess and
onerror handlers instead, from what is on disk: finished outputs and the jobs' logs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from slidesnake.atomic import atomic_output

COLUMNS = ["slide_id", "status", "reason", "tiles", "wall_s", "tiles_per_s", "loader_wait_fraction"]


def slide_status(slide_id: str, results: Path, logs: Path) -> dict[str, object]:
    """One row of the summary: 'done' with its metrics, 'failed' with why, or 'pending'."""
    metrics_path = results / slide_id / "metrics.json"
    if metrics_path.is_file() and (results / slide_id / "embeddings.zarr").is_dir():
        metrics = json.loads(metrics_path.read_text())
        return {"slide_id": slide_id, "status": "done", "reason": "", **metrics}
    reason = last_error(logs / slide_id)
    return {"slide_id": slide_id, "status": "failed" if reason else "pending", "reason": reason}


def last_error(log_dir: Path) -> str:
    """The one-line reason of the slide's most recent failed job, or '' if none failed."""
    for log in sorted(log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if " ERROR " in line]
        if errors:
            return errors[-1].split(": ", 1)[-1]
        if any(line.startswith("Traceback") for line in lines):
            return f"{log.stem} crashed: {lines[-1].strip()}"
    return ""


def write_cohort_summary(
    slide_ids: Iterable[str], results: str | Path, logs: str | Path, path: str | Path
) -> pd.DataFrame:
    """Write the summary as a TSV and return it."""
    rows = [slide_status(slide_id, Path(results), Path(logs)) for slide_id in slide_ids]
    table = pd.DataFrame(rows).reindex(columns=COLUMNS).astype({"tiles": "Int64"})
    with atomic_output(path) as tmp:
        table.to_csv(tmp, sep="\t", index=False)
    return table
