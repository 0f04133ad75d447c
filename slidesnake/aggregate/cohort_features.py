"""results/slide_features.parquet: the slide features of every done slide of the cohort,
gathered after each run with the cohort summary (a rule downstream of every slide would
never run while one slide fails). No torch, no zarr: the workflow's main process runs it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from slidesnake.atomic import atomic_output

SLIDE_FEATURES = "slide_features.parquet"


def gather_slide_features(done: pd.DataFrame, slides: Path, path: Path) -> pd.DataFrame:
    """Write the rows of the `done` slides (cohort rows: slide_id, and model with several
    models) that have their slide_features.parquet, and return them; a cohort without any
    gets the columns and no row. Columns of features missing from a slide (a narrower
    encoder vector, another model) are NaN. With several models, a model_key column."""
    tables = [
        _with_key(pd.read_parquet(folder / SLIDE_FEATURES), key)
        for _, folder, key in _folders(done, slides)
        if (folder / SLIDE_FEATURES).is_file()
    ]
    table = pd.concat(tables, ignore_index=True) if tables else _no_features("model" in done)
    with atomic_output(path) as tmp:
        table.to_parquet(tmp, index=False)
    return table


def _no_features(with_models: bool) -> pd.DataFrame:
    """The columns of a cohort without slide features (model_key with several models)."""
    key = {"model_key": str} if with_models else {}
    columns = {"slide_id": str, **key, "pooling": str, "model": str, "tiles": "int64"}
    return pd.DataFrame({name: [] for name in columns}).astype(columns)


SLIDE_PREDICTION = "slide_prediction.tsv"


def _folders(done: pd.DataFrame, slides: Path) -> list[tuple[str, Path, str]]:
    """(slide id, folder of what its model decides, model key or '') of each cohort row."""
    keys = done["model"] if "model" in done else [""] * len(done)
    return [(s, slides / s / key, key) for s, key in zip(done["slide_id"], keys, strict=True)]


def _with_key(table: pd.DataFrame, key: str) -> pd.DataFrame:
    if not key:
        return table
    return table.assign(model_key=key)[["slide_id", "model_key", *table.columns[1:]]]


def gather_slide_predictions(done: pd.DataFrame, slides: Path, path: Path) -> int:
    """Write results/slide_predictions.tsv: the slide predictions of the `done` slides
    (cohort rows) that have one, a row per slide and method; returns how many slides it
    holds."""
    tables = [
        pd.read_csv(folder / SLIDE_PREDICTION, sep="\t").assign(slide_id=slide_id)
        for slide_id, folder, _ in _folders(done, slides)
        if (folder / SLIDE_PREDICTION).is_file()
    ]
    if not tables:
        return 0
    table = pd.concat(tables, ignore_index=True)
    table = table[["slide_id", *(c for c in table.columns if c != "slide_id")]]
    with atomic_output(path) as tmp:
        table.to_csv(tmp, sep="\t", index=False)
    return len(tables)
