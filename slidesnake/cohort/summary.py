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


def cohort_table(slide_ids: Iterable[str], results: str | Path, logs: str | Path) -> pd.DataFrame:
    """One row per slide, in sheet order, with the COLUMNS."""
    rows = [slide_status(slide_id, Path(results), Path(logs)) for slide_id in slide_ids]
    return pd.DataFrame(rows).reindex(columns=COLUMNS).astype({"tiles": "Int64"})


def write_cohort_summary(
    slide_ids: Iterable[str], results: str | Path, logs: str | Path, path: str | Path
) -> pd.DataFrame:
    """Write the summary as a TSV and return it."""
    table = cohort_table(slide_ids, results, logs)
    with atomic_output(path) as tmp:
        table.to_csv(tmp, sep="\t", index=False)
    return table


def write_cohort_html(
    slide_ids: Iterable[str], results: str | Path, logs: str | Path, path: str | Path
) -> None:
    """The summary as a self-contained HTML table, for the Snakemake report."""
    table = cohort_table(slide_ids, results, logs)
    done = table[table["status"] == "done"]
    totals = (
        f"{len(done)} of {len(table)} slides done, {int(done['tiles'].sum())} tiles in "
        f"{done['wall_s'].sum():.1f} s of embedding"
    )
    headers = {"slide_id": "slide", "wall_s": "seconds", "tiles_per_s": "tiles/s"}
    headers["loader_wait_fraction"] = "loader wait"
    html = table.rename(columns=headers).to_html(
        index=False, na_rep="", float_format=lambda v: f"{v:.3g}", border=0
    )
    with atomic_output(path) as tmp:
        tmp.write_text(_PAGE.format(totals=totals, table=html))


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>slidesnake cohort</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 0.3em 0.8em; text-align: right; border-bottom: 1px solid #ddd; }}
th:first-child, td:first-child {{ text-align: left; }}
</style></head>
<body><h1>Cohort</h1><p>{totals}</p>
{table}
</body></html>
"""
