"""The cohort summary: every slide of the sheet, done, failed (and why) or pending.

Snakemake skips the jobs downstream of a failed one, so a summary rule would never run on
a cohort with one bad slide. The summary is written by the workflow's onsuccess and
onerror handlers instead, and says what happened in this run: a slide any of whose jobs
failed in this run is failed, even if outputs of an earlier run are still on disk (its
file was replaced, say). A job of this run is one whose log was written since the run
started; its log ends with the job's one-line error, with JOB_DONE, or with neither when
the job was killed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from html import escape
from pathlib import Path
from urllib.parse import quote

import pandas as pd

from slidesnake.aggregate.cohort_features import (
    SLIDE_FEATURES,
    gather_slide_features,
    gather_slide_predictions,
)
from slidesnake.aggregate.cohort_projection import draw_cohort_projection
from slidesnake.atomic import OutputSet, atomic_output, output_set
from slidesnake.cohort.gallery import EMBEDDING_MAP, QC_PICTURES, write_gallery
from slidesnake.cohort.jobs import JOB_DONE
from slidesnake.tiling.tile_table import read_dropped

# dropped_*: tiles the artefact filters removed, for slides tiled with the filter on
DROPPED = ["dropped_pen", "dropped_focus"]
COLUMNS = ["slide_id", "status", "reason", "tiles", *DROPPED, "wall_s", "tiles_per_s",
           "loader_wait_fraction"]  # fmt: skip


def slide_status(
    slide_id: str, results: Path, logs: Path, since: float | None = None
) -> dict[str, object]:
    """One row of the summary: 'done' with its metrics, 'failed' with why, or 'pending'.

    `since` is when this run started; without it, only the outputs on disk count."""
    reason = failure_in_run(logs / slide_id, since) if since is not None else ""
    if reason:
        return {"slide_id": slide_id, "status": "failed", "reason": reason}
    metrics_path = results / slide_id / "metrics.json"
    if metrics_path.is_file() and (results / slide_id / "embeddings.zarr").is_dir():
        metrics = json.loads(metrics_path.read_text())
        dropped = read_dropped(results / slide_id / "tiles.parquet")
        dropped = {f"dropped_{name}": count for name, count in dropped.items()}
        return {"slide_id": slide_id, "status": "done", "reason": "", **metrics, **dropped}
    return {"slide_id": slide_id, "status": "pending", "reason": ""}


def failure_in_run(log_dir: Path, since: float) -> str:
    """Why a job of this slide failed in the run started at `since`, or '' if none did."""
    # An empty log is a job that never started: Snakemake creates the logs of a SLURM
    # group's jobs up front, and stops the group at its first failure.
    logs = [
        log
        for log in log_dir.glob("*.log")
        if log.stat().st_mtime >= since and log.stat().st_size > 0
    ]
    for log in sorted(logs, key=lambda p: p.stat().st_mtime):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if " ERROR " in line]
        if errors:
            return errors[-1].split(": ", 1)[-1]
        if not lines or not lines[-1].endswith(JOB_DONE):
            return f"{log.stem} stopped without a result (killed?); see {log}"
    return ""


def cohort_table(
    slide_ids: Iterable[str], results: str | Path, logs: str | Path, since: float | None = None
) -> pd.DataFrame:
    """One row per slide, in sheet order, with the COLUMNS."""
    rows = [slide_status(slide_id, Path(results), Path(logs), since) for slide_id in slide_ids]
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    return table.astype(dict.fromkeys(["tiles", *DROPPED], "Int64"))


# The cohort files, replaced together by each summary, then the list of the slides they
# describe: written last, so a summary killed half-way leaves no list and the next run
# writes the summary again (the workflow's rule list_cohort_slides needs the list).
COHORT_FILES = (
    "cohort.tsv",
    "cohort.html",
    "cohort_gallery.jpg",
    "embedding_maps.jpg",
    SLIDE_FEATURES,
    "slide_features_pca.png",
    "slide_predictions.tsv",
)
COHORT_SLIDES = ".cohort_slides.txt"


def write_cohort_summary(
    slide_ids: Iterable[str],
    results: str | Path,
    logs: str | Path,
    since: float | None = None,
) -> pd.DataFrame:
    """Write the summary of the run started at `since` into `results`: cohort.tsv, the
    same table as cohort.html with links to each slide's pictures, the galleries of QC
    pictures and of embedding maps, and the slide features of the done slides. The files
    describe exactly `slide_ids` (none included), and are replaced together."""
    results = Path(results)
    slide_ids = list(slide_ids)
    table = cohort_table(slide_ids, results / "slides", logs, since)
    (results / COHORT_SLIDES).unlink(missing_ok=True)
    with output_set([results / name for name in COHORT_FILES]) as outputs:
        _write_cohort_files(table, results, outputs)
    write_cohort_slides(slide_ids, results / COHORT_SLIDES)
    return table


def _write_cohort_files(table: pd.DataFrame, results: Path, outputs: OutputSet) -> None:
    slides = results / "slides"
    table.to_csv(outputs.path(results / "cohort.tsv"), sep="\t", index=False)
    outputs.path(results / "cohort.html").write_text(cohort_html(table, results))
    write_gallery(table, slides, outputs.path(results / "cohort_gallery.jpg"))
    done = table[table["status"] == "done"]
    maps = outputs.path(results / "embedding_maps.jpg")
    write_gallery(done, slides, maps, (EMBEDDING_MAP,))
    features = gather_slide_features(
        done["slide_id"], slides, outputs.path(results / SLIDE_FEATURES)
    )
    draw_cohort_projection(features, outputs.path(results / "slide_features_pca.png"))
    gather_slide_predictions(
        done["slide_id"], slides, outputs.path(results / "slide_predictions.tsv")
    )


def write_cohort_slides(slide_ids: list[str], path: Path) -> None:
    """The slide ids a summary describes, one per line: the output of list_cohort_slides."""
    with atomic_output(path) as tmp:
        tmp.write_text("".join(f"{slide_id}\n" for slide_id in slide_ids))


def failed_slides(summary: str | Path) -> set[str]:
    """The slides that failed in the run that wrote `summary` (cohort.tsv); none if there
    is no summary yet."""
    try:
        table = pd.read_csv(summary, sep="\t", usecols=["slide_id", "status"], dtype=str)
    except FileNotFoundError:
        return set()
    return set(table.loc[table["status"] == "failed", "slide_id"])


def cohort_html(table: pd.DataFrame, results: Path) -> str:
    """The table as a page that links each slide's QC pictures where they exist."""
    done = table[table["status"] == "done"]
    totals = (
        f"{len(done)} of {len(table)} slides done, {int(done['tiles'].sum())} tiles in "
        f"{done['wall_s'].sum():.1f} s of embedding"
    )
    unused = [column for column in DROPPED if table.get(column, pd.Series()).isna().all()]
    shown = table.drop(columns=unused, errors="ignore")
    shown = shown.map(lambda v: escape(str(v)) if isinstance(v, str) else v)
    shown["pictures"] = [picture_links(results, slide_id) for slide_id in table["slide_id"]]
    headers = {"slide_id": "slide", "wall_s": "seconds", "tiles_per_s": "tiles/s"}
    headers |= {"loader_wait_fraction": "loader wait", "dropped_pen": "dropped (pen)"}
    headers["dropped_focus"] = "dropped (focus)"
    rows = shown.rename(columns=headers).to_html(
        index=False, na_rep="", float_format=lambda v: f"{v:.3g}", border=0, escape=False
    )
    return _PAGE.format(totals=totals, table=rows)


def picture_links(results: Path, slide_id: str) -> str:
    """Links, relative to results/, to the slide's QC pictures that are on disk."""
    names = {name: name[3:-4] for name in QC_PICTURES}
    names |= {EMBEDDING_MAP: "embedding map", "heatmaps.png": "heatmaps"}
    return " ".join(
        f'<a href="slides/{quote(slide_id)}/{name}">{label}</a>'
        for name, label in names.items()
        if (results / "slides" / slide_id / name).is_file()
    )


_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>slidesnake cohort</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }}
th, td {{ padding: 0.3em 0.8em; text-align: right; border-bottom: 1px solid #ddd; }}
th:first-child, td:first-child, td:nth-child(3) {{ text-align: left; }}
</style></head>
<body><h1>Cohort</h1><p>{totals}</p>
{table}
</body></html>
"""
