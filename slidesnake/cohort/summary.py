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
import re
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from slidesnake.aggregate.cohort_features import (
    SLIDE_FEATURES,
    gather_slide_features,
    gather_slide_predictions,
)
from slidesnake.aggregate.cohort_projection import draw_cohort_projection
from slidesnake.atomic import OutputSet, atomic_output, output_set
from slidesnake.cohort.gallery import EMBEDDING_MAP, write_gallery
from slidesnake.cohort.jobs import JOB_DONE
from slidesnake.cohort.page import COHORT_PICTURES, cohort_page
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.tiling.tile_table import read_dropped

# dropped_*: tiles the artefact filters removed, for slides tiled with the filter on
DROPPED = ["dropped_pen", "dropped_focus"]
# model_busy_fraction: the share of the job its device (the GPU) was busy with the model
COLUMNS = ["slide_id", "status", "reason", "tiles", *DROPPED, "wall_s", "tiles_per_s",
           "loader_wait_fraction", "model_busy_fraction"]  # fmt: skip
# With several models, each model's own time in the job it shared with the others.
MODEL_COLUMNS = ["model_s", "model_tiles_per_s"]
# The line of a model that failed in a job of several (embed.model_list)
MODEL_FAILED = re.compile(r"model '([^']+)' failed: ")
RUNNING = "running"  # failure_in_run's answer for a job still writing its log


def slide_status(
    slide_id: str,
    results: Path,
    logs: Path,
    since: float | None = None,
    model: str = "",
    live: bool = False,
) -> dict[str, object]:
    """One row of the summary: 'done' with its metrics, 'failed' with why, 'running' (in a
    `live` run: a job of this run whose log has not ended) or 'pending'; for one `model`
    key of `models:`, from that model's outputs and jobs.

    `since` is when this run started; without it, only the outputs on disk count."""
    row: dict[str, object] = {"slide_id": slide_id, **({"model": model} if model else {})}
    reason = failure_in_run(logs / slide_id, since, model, live) if since is not None else ""
    if reason == RUNNING:
        return row | {"status": "running", "reason": ""}
    if reason:
        return row | {"status": "failed", "reason": reason}
    outputs = results / slide_id / model
    metrics_path = outputs / "metrics.json"
    if metrics_path.is_file() and (outputs / "embeddings.zarr").is_dir():
        metrics = json.loads(metrics_path.read_text())
        metrics.pop("model", None)  # the model's name: the row's model is its key
        dropped = read_dropped(results / slide_id / "tiles.parquet")
        dropped = {f"dropped_{name}": count for name, count in dropped.items()}
        return row | {"status": "done", "reason": "", **metrics, **dropped}
    kept = ModelOutputs(outputs / "embeddings.zarr", metrics_path).kept()
    waits = "embedded; kept until the slide's other models succeed" if model else ""
    return row | {"status": "pending", "reason": waits if kept.metrics.is_file() else ""}


def failure_in_run(log_dir: Path, since: float, model: str = "", live: bool = False) -> str:
    """Why a job of this slide (and of its `model`) failed in the run started at `since`,
    or '' if none did; RUNNING for a job whose log has not ended in a `live` run. The
    embedding job of a model list names each model that failed on a line of its own: the
    others did not fail there."""
    # An empty log is a job that never started: Snakemake creates the logs of a SLURM
    # group's jobs up front, and stops the group at its first failure.
    found = [*log_dir.glob("*.log"), *((log_dir / model).glob("*.log") if model else [])]
    logs = [log for log in found if log.stat().st_mtime >= since]
    if live and any(log.stat().st_size == 0 for log in logs):
        return RUNNING  # a job that has not written its first line yet
    logs = [log for log in logs if log.stat().st_size > 0]
    for log in sorted(logs, key=lambda p: p.stat().st_mtime):
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if " ERROR " in line]
        if errors:
            failed = {named[1]: line for line in errors if (named := MODEL_FAILED.search(line))}
            reason = failed.get(model, "") if failed else errors[-1]
            if reason:
                return reason.split(": ", 1)[-1]
        elif not lines or not lines[-1].endswith(JOB_DONE):
            return RUNNING if live else f"{log.stem} stopped without a result (killed?); see {log}"
    return ""


def cohort_table(
    slide_ids: Iterable[str],
    results: str | Path,
    logs: str | Path,
    since: float | None = None,
    models: Iterable[str] = (),
    live: bool = False,
) -> pd.DataFrame:
    """One row per slide, in sheet order, with the COLUMNS; with `models` (the keys of
    `models:`), one row per slide and model, with a model column."""
    keys = list(models) or [""]
    rows = [
        slide_status(slide_id, Path(results), Path(logs), since, key, live)
        for slide_id in slide_ids
        for key in keys
    ]
    columns = [COLUMNS[0], "model", *COLUMNS[1:], *MODEL_COLUMNS] if models else COLUMNS
    table = pd.DataFrame(rows).reindex(columns=columns)
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
    models: Iterable[str] = (),
    head_model: str = "",
) -> pd.DataFrame:
    """Write the summary of the run started at `since` into `results`: cohort.tsv, the
    same table as cohort.html with links to each slide's pictures, the galleries of QC
    pictures and of embedding maps, and the slide features of the done slides. The files
    describe exactly `slide_ids` (none included), and are replaced together. With
    `models` (keys), the tables have a row per slide and model; the pictures, the
    projection and the predictions (of `head_model`) are of one model each."""
    results = Path(results)
    slide_ids, models = list(slide_ids), list(models)
    table = cohort_table(slide_ids, results / "slides", logs, since, models)
    (results / COHORT_SLIDES).unlink(missing_ok=True)
    with output_set([results / name for name in COHORT_FILES]) as outputs:
        _write_cohort_files(table, results, outputs, models, head_model)
    write_cohort_slides(slide_ids, results / COHORT_SLIDES)
    return table


def _write_cohort_files(
    table: pd.DataFrame, results: Path, outputs: OutputSet, models: list[str], head_model: str
) -> None:
    slides = results / "slides"
    table.to_csv(outputs.path(results / "cohort.tsv"), sep="\t", index=False)
    first = table[table["model"] == models[0]] if models else table
    pictures = {name: outputs.path(results / name) for name in COHORT_PICTURES}
    write_gallery(first, slides, pictures["cohort_gallery.jpg"])
    done = first[first["status"] == "done"]
    maps = (str(Path(models[0] if models else "", EMBEDDING_MAP)),)
    write_gallery(done, slides, pictures["embedding_maps.jpg"], maps)
    features = gather_slide_features(
        table[table["status"] == "done"], slides, outputs.path(results / SLIDE_FEATURES)
    )
    if models:
        features = features[features["model_key"] == models[0]]
    draw_cohort_projection(features, pictures["slide_features_pca.png"])
    heads = table[table["status"] == "done"]
    if models:
        heads = heads[heads["model"] == head_model]
    gather_slide_predictions(heads, slides, outputs.path(results / "slide_predictions.tsv"))
    pictures = {name: path for name, path in pictures.items() if path.is_file()}
    outputs.path(results / "cohort.html").write_text(cohort_page(table, results, pictures))


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
