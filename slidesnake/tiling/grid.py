"""The tile grid of a slide and the tissue fraction of every tile.

Tiles are laid at the target resolution and expressed in level-0 pixels (top-left, row
major), the TRIDENT/CLAM convention. Tissue fractions come from an integral image of the
mask, sampled bilinearly, which is the exact area of tissue under each tile for any
tile-to-mask scale; the whole grid is computed at once, without a loop over tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from slidesnake.tiling.config_section import ConfigSection
from slidesnake.tiling.mask_file import TissueMask


@dataclass(frozen=True)
class TileParams(ConfigSection):
    """Where tiles go: resolution, size and stride in target pixels, tissue needed."""

    mpp: float = 0.5
    size: int = 224
    stride: int | None = None  # None means stride = size (no overlap)
    mask_threshold: float = 0.5

    @property
    def step(self) -> int:
        return self.stride or self.size


@dataclass(frozen=True)
class TileGeometry:
    """How tile coordinates relate to the slide; stored with every tile table."""

    slide_mpp: float
    target_mpp: float
    size: int  # target px
    stride: int
    size_level0: int  # level-0 px
    stride_level0: int
    read_level: int  # the pyramid level tiles are read from
    read_downsample: float  # its level-0 px per px
    mask_threshold: float
    slide_width: int
    slide_height: int
    coords_source: str | None = None  # a file of another tool's coordinates, if imported


def tile_geometry(
    mask: TissueMask, params: TileParams, read_level: int, read_downsample: float
) -> TileGeometry:
    level0_per_target = params.mpp / mask.slide_mpp
    return TileGeometry(
        slide_mpp=mask.slide_mpp,
        target_mpp=params.mpp,
        size=params.size,
        stride=params.step,
        size_level0=round(params.size * level0_per_target),
        stride_level0=round(params.step * level0_per_target),
        read_level=read_level,
        read_downsample=read_downsample,
        mask_threshold=params.mask_threshold,
        slide_width=mask.slide_width,
        slide_height=mask.slide_height,
    )


def grid_tiles(mask: TissueMask, geometry: TileGeometry) -> pd.DataFrame:
    """Tiles fully inside the slide whose tissue fraction reaches the threshold."""
    xs = _starts(geometry.slide_width, geometry.size_level0, geometry.stride_level0)
    ys = _starts(geometry.slide_height, geometry.size_level0, geometry.stride_level0)
    fraction = tissue_fractions(mask, xs, ys, geometry.size_level0)
    keep = fraction >= geometry.mask_threshold
    rows, cols = np.nonzero(keep)  # row-major: y outer, x inner
    return pd.DataFrame(
        {
            "x": xs[cols].astype(np.int64),
            "y": ys[rows].astype(np.int64),
            "tissue_fraction": fraction[rows, cols].astype(np.float32),
        }
    )


def _starts(extent: int, size: int, stride: int) -> np.ndarray:
    if size > extent:
        return np.zeros(0, np.int64)
    return np.arange((extent - size) // stride + 1, dtype=np.int64) * stride


def tissue_fractions(mask: TissueMask, xs: np.ndarray, ys: np.ndarray, size: int) -> np.ndarray:
    """(len(ys), len(xs)) fraction of each size x size level-0 tile covered by tissue."""
    integral = np.zeros((mask.mask.shape[0] + 1, mask.mask.shape[1] + 1))
    integral[1:, 1:] = mask.mask.cumsum(axis=0).cumsum(axis=1)
    left, right = xs / mask.scale_x, (xs + size) / mask.scale_x
    top, bottom = ys / mask.scale_y, (ys + size) / mask.scale_y
    rows_top, rows_bottom = _lerp_rows(integral, top), _lerp_rows(integral, bottom)
    area = (
        _lerp_rows(rows_bottom.T, right).T
        - _lerp_rows(rows_bottom.T, left).T
        - _lerp_rows(rows_top.T, right).T
        + _lerp_rows(rows_top.T, left).T
    )
    tile_area = (size / mask.scale_x) * (size / mask.scale_y)
    return np.clip(area / tile_area, 0.0, 1.0)


def _lerp_rows(table: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Rows of `table` interpolated linearly at fractional row positions `at` (clamped)."""
    at = np.clip(at, 0, table.shape[0] - 1)
    low = np.minimum(np.floor(at).astype(np.int64), max(table.shape[0] - 2, 0))
    high = np.minimum(low + 1, table.shape[0] - 1)
    weight = (at - low)[:, None]
    return table[low] * (1 - weight) + table[high] * weight


def fractions_at(
    layer: np.ndarray, mask: TissueMask, xs: np.ndarray, ys: np.ndarray, size: int
) -> np.ndarray:
    """The fraction of each size x size level-0 tile at (xs[i], ys[i]) that `layer` (a
    boolean picture on the mask's grid: the tissue, the pen ink) covers, float32."""
    integral = np.zeros((layer.shape[0] + 1, layer.shape[1] + 1))
    integral[1:, 1:] = layer.cumsum(axis=0).cumsum(axis=1)
    left, right = xs / mask.scale_x, (xs + size) / mask.scale_x
    top, bottom = ys / mask.scale_y, (ys + size) / mask.scale_y
    area = (
        _bilinear(integral, bottom, right) - _bilinear(integral, bottom, left)
        - _bilinear(integral, top, right) + _bilinear(integral, top, left)
    )  # fmt: skip
    tile_area = (size / mask.scale_x) * (size / mask.scale_y)
    return np.clip(area / tile_area, 0.0, 1.0).astype(np.float32)


def _bilinear(table: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    rows = np.clip(rows, 0, table.shape[0] - 1)
    cols = np.clip(cols, 0, table.shape[1] - 1)
    r0 = np.minimum(np.floor(rows).astype(np.int64), table.shape[0] - 2)
    c0 = np.minimum(np.floor(cols).astype(np.int64), table.shape[1] - 2)
    fr, fc = rows - r0, cols - c0
    return (
        table[r0, c0] * (1 - fr) * (1 - fc) + table[r0 + 1, c0] * fr * (1 - fc)
        + table[r0, c0 + 1] * (1 - fr) * fc + table[r0 + 1, c0 + 1] * fr * fc
    )  # fmt: skip
