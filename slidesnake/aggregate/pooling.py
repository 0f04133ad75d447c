"""Slide-level features pooled from a slide's tile embeddings, streamed from zarr.

Mean, max, sum and the tissue-weighted mean accumulate over row chunks in float64, so
memory does not grow with the number of tiles. The median cannot be accumulated: it is
exact, computed over blocks of columns (every tile, a few dimensions at a time), which
bounds memory by the tiles times a block, not by the whole matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import zarr

from slidesnake.embed.store import open_embeddings
from slidesnake.errors import ConfigError, NonFiniteError

POOLINGS = ("mean", "max", "median", "sum", "tissue_weighted_mean")
MEDIAN_COLUMNS = 64  # dimensions per block of the median


def pool_features(
    zarr_path: str | Path, poolings: Sequence[str], weights: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """{pooling: (D,) float32} over every tile of the store; none for a slide of 0 tiles.
    `weights` (one per tile) are tissue_weighted_mean's; required only for it."""
    unknown = sorted(set(poolings) - set(POOLINGS))
    if unknown:
        raise ConfigError(f"slide.pooling {unknown} unknown; choose from {list(POOLINGS)}")
    features = open_embeddings(zarr_path)["features"]
    if features.shape[0] == 0:
        return {}
    pooled = _accumulated(features, set(poolings) - {"median"}, weights)
    if "median" in poolings:
        pooled["median"] = _median(features)
    return {name: pooled[name].astype(np.float32) for name in poolings}


def _accumulated(
    features: zarr.Array, poolings: set[str], weights: np.ndarray | None
) -> dict[str, np.ndarray]:
    dim = features.shape[1]
    total, weighted = np.zeros(dim), np.zeros(dim)
    largest = np.full(dim, -np.inf)
    step = features.chunks[0]
    for start in range(0, features.shape[0], step):
        chunk = features[start : start + step].astype(np.float64)
        total += chunk.sum(axis=0)
        largest = np.maximum(largest, chunk.max(axis=0))
        if "tissue_weighted_mean" in poolings:
            weighted += weights[start : start + step] @ chunk
    rows = features.shape[0]
    pooled = {"mean": total / rows, "sum": total, "max": largest}
    if "tissue_weighted_mean" in poolings:
        total_weight = float(np.sum(weights))
        if not total_weight > 0:
            raise NonFiniteError(
                f"slide.pooling tissue_weighted_mean: the {rows} tiles' tissue fractions sum "
                f"to {total_weight:g}, so the weighted mean is undefined; use mean for slides "
                "whose tiles lie off the tissue mask (imported coordinates)"
            )
        pooled["tissue_weighted_mean"] = weighted / total_weight
    return pooled


def _median(features: zarr.Array) -> np.ndarray:
    dim = features.shape[1]
    return np.concatenate([
        np.median(features[:, start : start + MEDIAN_COLUMNS].astype(np.float64), axis=0)
        for start in range(0, dim, MEDIAN_COLUMNS)
    ])  # fmt: skip
