"""How sharp each tile is: the variance of the Laplacian of its grey levels.

A scanner out of focus blurs nuclear edges first, and the Laplacian responds to exactly
those edges, so its variance over a tile falls with blur. Scored at about 2 µm/px, where
nuclei are a few pixels across, from a reduced pyramid level, never level 0: the score
costs a small fraction of the embedding's reads. Adjacent tiles of a row are read as one
strip, and the per-tile sums come from cumulative sums along that strip.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import ndimage as ndi

from slidesnake.slides.lowres import bin_pixels, reduced_level
from slidesnake.slides.slide import Slide

_GREY = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R BT.601 luma weights


def focus_scores(slide: Slide, tiles: pd.DataFrame, size_level0: int, mpp: float) -> np.ndarray:
    """The focus score of each size_level0 x size_level0 tile of `tiles` (x, y in level-0
    px), computed at about `mpp` µm/px; float32, in the order of `tiles`."""
    scores = np.zeros(len(tiles), np.float32)
    if tiles.empty:
        return scores
    level, factor = reduced_level(slide, mpp)
    downsample = slide.levels[level].downsample
    scale = downsample * factor  # level-0 px per pixel scored
    side = max(3, round(size_level0 / scale))
    level_width, level_height = slide.levels[level].width, slide.levels[level].height
    xs, ys = tiles["x"].to_numpy(), tiles["y"].to_numpy()
    for rows in _runs(xs, ys, size_level0):
        left, y = int(xs[rows[0]]), int(ys[rows[0]])
        width = (round((int(xs[rows[-1]]) - left) / scale) + side) * factor
        width = min(width, level_width - int(left // downsample))  # rounding past the edge
        height = min(side * factor, level_height - int(y // downsample))
        strip = slide.read(level, left, y, width, height)
        starts = np.round((xs[rows] - left) / scale).astype(np.int64)
        scores[rows] = _laplacian_variance(bin_pixels(strip, factor), starts, side)
    return scores


def _runs(xs: np.ndarray, ys: np.ndarray, size: int) -> list[np.ndarray]:
    """Indices of the tiles in runs along rows: same y, each tile at most `size` px right of
    the one before, so a strip never decodes the glass between two pieces of tissue."""
    order = np.lexsort((xs, ys))
    gap = (np.diff(ys[order]) != 0) | (np.diff(xs[order]) > size)
    return np.split(order, np.flatnonzero(gap) + 1)


def _laplacian_variance(rgb: np.ndarray, starts: np.ndarray, side: int) -> np.ndarray:
    """Variance of the Laplacian over columns [start, start + side) of a strip one tile
    high, for every start at once."""
    laplacian = ndi.laplace(rgb.astype(np.float32) @ _GREY)
    total = np.concatenate([[0.0], np.cumsum(laplacian.sum(axis=0, dtype=np.float64))])
    squares = np.concatenate([[0.0], np.cumsum((laplacian**2).sum(axis=0, dtype=np.float64))])
    ends = np.minimum(starts + side, laplacian.shape[1])
    count = (ends - starts) * laplacian.shape[0]
    mean = (total[ends] - total[starts]) / count
    return (squares[ends] - squares[starts]) / count - mean * mean
