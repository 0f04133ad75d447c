"""slide_features.parquet: a slide's pooled features (and its slide encoder's vector), one
row per pooling, one float32 column per dimension (f0000, f0001, ...): the shape pandas,
polars and scikit-learn take as it is (`X = table.filter(regex=r"^f\\d+$")`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from slidesnake.aggregate.pooling import pool_features
from slidesnake.atomic import atomic_output
from slidesnake.embed.store import open_embeddings
from slidesnake.tiling.tile_table import read_tiles

ENCODER = "encoder"  # the pooling column's value for the slide encoder's vector


def feature_columns(dim: int) -> list[str]:
    return [f"f{i:04d}" for i in range(dim)]


def slide_features(
    slide_id: str,
    zarr_path: str | Path,
    tiles_path: str | Path,
    poolings: Sequence[str],
    encoder: str | Path | None = None,
) -> pd.DataFrame:
    """The rows of one slide. A slide of 0 tiles gets its rows, with tiles 0 and no
    features (NaN), so that the cohort table still lists it."""
    group = open_embeddings(zarr_path)
    tiles, dim = group["features"].shape
    weights = None
    if "tissue_weighted_mean" in poolings:
        weights = read_tiles(tiles_path)[0]["tissue_fraction"].to_numpy(np.float64)
    vectors = pool_features(zarr_path, poolings, weights)
    names = [*poolings, *([ENCODER] if encoder else [])]
    if encoder:
        from slidesnake.aggregate.encoder import encode_slide  # torch: only when asked for

        vectors[ENCODER] = encode_slide(encoder, zarr_path)
    width = max([dim, *(len(v) for v in vectors.values() if v is not None)])
    matrix = np.full((len(names), width), np.nan, np.float32)
    for row, name in enumerate(names):
        vector = vectors.get(name)
        if vector is not None:
            matrix[row, : len(vector)] = vector
    meta = pd.DataFrame({
        "slide_id": slide_id, "pooling": names, "model": group.attrs.get("model", ""),
        "tiles": tiles,
    })  # fmt: skip
    return pd.concat([meta, pd.DataFrame(matrix, columns=feature_columns(width))], axis=1)


def write_slide_features(table: pd.DataFrame, path: str | Path) -> None:
    with atomic_output(path) as tmp:
        table.to_parquet(tmp, index=False)
