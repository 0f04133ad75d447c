"""results/slide_features.parquet: the slide features of every done slide of the cohort,
gathered after each run with the cohort summary (a rule downstream of every slide would
never run while one slide fails). No torch, no zarr: the workflow's main process runs it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from slidesnake.atomic import atomic_output

SLIDE_FEATURES = "slide_features.parquet"


def gather_slide_features(slide_ids: Iterable[str], slides: Path, path: Path) -> pd.DataFrame:
    """Write the rows of `slide_ids` that have their slide_features.parquet, and return
    them; a cohort without any gets the columns and no row. Columns of features missing
    from a slide (a narrower encoder vector) are NaN."""
    tables = [
        pd.read_parquet(slides / slide_id / SLIDE_FEATURES)
        for slide_id in slide_ids
        if (slides / slide_id / SLIDE_FEATURES).is_file()
    ]
    table = (
        pd.concat(tables, ignore_index=True)
        if tables
        else pd.DataFrame({"slide_id": [], "pooling": [], "model": [], "tiles": []}).astype(
            {"slide_id": str, "pooling": str, "model": str, "tiles": "int64"}
        )
    )
    with atomic_output(path) as tmp:
        table.to_parquet(tmp, index=False)
    return table


SLIDE_PREDICTION = "slide_prediction.tsv"


def gather_slide_predictions(slide_ids: Iterable[str], slides: Path, path: Path) -> int:
    """Write results/slide_predictions.tsv: the slide predictions of `slide_ids` that have
    one, a row per slide and method; returns how many slides it holds."""
    tables = [
        pd.read_csv(slides / slide_id / SLIDE_PREDICTION, sep="\t").assign(slide_id=slide_id)
        for slide_id in slide_ids
        if (slides / slide_id / SLIDE_PREDICTION).is_file()
    ]
    if not tables:
        return 0
    table = pd.concat(tables, ignore_index=True)
    table = table[["slide_id", *(c for c in table.columns if c != "slide_id")]]
    with atomic_output(path) as tmp:
        table.to_csv(tmp, sep="\t", index=False)
    return len(tables)
