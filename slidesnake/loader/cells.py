"""Which tiles are read together: cells of the tile grid, cut along the slide's own tiles.

A loader worker reads one cell at a time and decodes each compressed slide tile the cell
touches once, however many model tiles overlap it. A compressed tile shared by two cells
would be decoded twice (perhaps by two workers), so where the slide's compressed tile
grid is known, cells are cut where a row (column) of model tiles ends exactly where a row
(column) of compressed tiles ends: 448 px tiles on 256 px JPEG tiles line up every 4
tiles, 224 px tiles on 240 px tiles every 15. Where they never line up (overlapping tiles,
odd sizes), cells are cut at a maximum size and the tiles on the cut are decoded twice.
"""

from __future__ import annotations

import math

import numpy as np

# Read-level px: a cell is at least this long before it may be cut (smaller cells cost
# more per tile in planning and hand-over) ...
CELL_MIN_PX = 1024
# ... and is cut at this length even where the grids do not line up, to keep the decoded
# tiles held per worker and the rows in flight small.
CELL_MAX_PX = 8192


def plan_cells(
    grid_xy: np.ndarray, step: int, tile_px: int, compressed: tuple[int, int] | None, block: int
) -> list[np.ndarray]:
    """Row indices of the tiles, grouped by cell; cells and the rows in each row-major.

    `grid_xy`: (N, 2) grid column and row of each tile. `step`, `tile_px`: tile stride
    and size at the read level. `compressed`: (width, height) of the slide's compressed
    tiles at that level, or None where the slide is read region by region, in cells of
    `block` x `block` tiles.
    """
    if len(grid_xy) == 0:
        return []
    spans = grid_xy.max(axis=0) + 1
    if compressed is None:
        cols, rows = np.arange(spans[0]) // block, np.arange(spans[1]) // block
    else:
        cols = axis_cells(int(spans[0]), step, tile_px, compressed[0])
        rows = axis_cells(int(spans[1]), step, tile_px, compressed[1])
    keys = rows[grid_xy[:, 1]] * (cols[-1] + 1) + cols[grid_xy[:, 0]]
    order = np.argsort(keys, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(keys[order])) + 1)


def axis_cells(count: int, step: int, tile_px: int, tile: int) -> np.ndarray:
    """Cell number of each of `count` grid positions along one axis."""
    shortest = max(1, math.ceil(CELL_MIN_PX / step))
    longest = max(shortest, CELL_MAX_PX // step)
    cells = np.empty(count, np.int64)
    cell = length = 0
    for k in range(count):
        if length >= longest or (length >= shortest and clean_cut(k, step, tile_px, tile)):
            cell, length = cell + 1, 0
        cells[k] = cell
        length += 1
    return cells


def clean_cut(k: int, step: int, tile_px: int, tile: int) -> bool:
    """Whether grid positions k-1 and k touch no common compressed tile."""
    return ((k - 1) * step + tile_px - 1) // tile < (k * step) // tile
