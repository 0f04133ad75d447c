"""Polygon rings filled on a pixel grid by scanlines, in time linear in the pixels plus the
edge crossings, with the crossings counted before any is made.

A pixel is inside when its centre is (the rule the mask follows). A drawing library's
polygon fill tests every edge against every row (bounding-box rows x vertices: hours for a
GeoJSON of a million vertices over a resection); here each edge yields only the rows it
crosses, so the work is bounded by a number known up front, and refused above it.
"""

from __future__ import annotations

import numpy as np

# Edge crossings of scanlines one ring may cost (each a few dozen bytes while filling).
MAX_CROSSINGS = 20_000_000


class RingTooComplexError(ValueError):
    """The ring crosses the grid's rows more often than MAX_CROSSINGS."""


def fill_ring(cols: np.ndarray, rows: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """(h, w) bool: pixels whose centre (c + 0.5, r + 0.5) lies inside the closed ring of
    vertices (`cols`, `rows`) in pixel units, by the even-odd rule."""
    height, width = shape
    x0, y0 = cols, rows
    x1, y1 = np.roll(cols, -1), np.roll(rows, -1)
    low, high = np.minimum(y0, y1), np.maximum(y0, y1)
    # Scanline r (centre r + 0.5) crosses the edge when low <= r + 0.5 < high.
    first = np.clip(np.ceil(low - 0.5), 0, height).astype(np.int64)
    stop = np.clip(np.ceil(high - 0.5), 0, height).astype(np.int64)
    counts = np.maximum(stop - first, 0)
    total = int(counts.sum())
    if total > MAX_CROSSINGS:
        raise RingTooComplexError(f"{total:,} edge crossings, more than {MAX_CROSSINGS:,}")
    out = np.zeros(shape, bool)
    if total == 0:
        return out
    edge = np.repeat(np.arange(len(counts)), counts)
    offset = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    row = first[edge] + offset
    t = (row + 0.5 - y0[edge]) / (y1[edge] - y0[edge])
    x = x0[edge] + t * (x1[edge] - x0[edge])
    order = np.lexsort((x, row))
    row, x = row[order], x[order]
    # Each row holds an even number of crossings: fill between the 1st and 2nd, 3rd and 4th.
    start = np.clip(np.ceil(x[0::2] - 0.5), 0, width).astype(np.int64)
    end = np.clip(np.ceil(x[1::2] - 0.5), 0, width).astype(np.int64)
    steps = np.zeros((height, width + 1), np.int32)
    np.add.at(steps, (row[0::2], start), 1)
    np.add.at(steps, (row[0::2], end), -1)
    return np.cumsum(steps[:, :width], axis=1) > 0
