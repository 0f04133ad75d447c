"""Copy the model tiles of one cell into batch slots: the two ways a worker reads a slide.

`CompressedTiles` (tiled JPEG / JPEG 2000 TIFF levels): each compressed tile the cell
touches is decoded once, kept while a later tile of the cell still needs it, and copied
piece by piece straight into the batch: one decode and one copy per pixel, no
intermediate region, no RGBA. `RegionReads` (everything else, through OpenSlide): one
read of the cell's bounding box, cut into tiles.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from slidesnake.slide import Slide
from slidesnake.tiff_tiles import TiledLevel


class CompressedTiles:
    """Tiles of a slide level we decode ourselves; positions in read-level px."""

    def __init__(self, slide: Slide, level: int, tiled: TiledLevel, tile_px: int):
        self.slide, self.level, self.tiled, self.tile_px = slide, level, tiled, tile_px
        self.decoded = 0  # compressed tiles decoded, for the metrics and the tests

    def open_cell(self, xy: np.ndarray) -> _CompressedCell:
        return _CompressedCell(self, xy)


class _CompressedCell:
    """The model tiles of one cell, in order; decoded compressed tiles are dropped after
    their last use, so a cell holds about two rows of them across its width."""

    def __init__(self, reader: CompressedTiles, xy: np.ndarray):
        self.reader, self.xy = reader, xy
        last_use: dict[tuple[int, int], int] = {}
        for i, (x, y) in enumerate(xy):
            for key in reader.tiled.tiles_under(int(x), int(y), reader.tile_px, reader.tile_px):
                last_use[key] = i
        self.done_after: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for key, i in last_use.items():
            self.done_after[i].append(key)
        self.held: dict[tuple[int, int], np.ndarray | None] = {}

    def copy_tile(self, i: int, out: np.ndarray) -> None:
        """Write tile `i` of the cell into `out` (tile_px, tile_px, 3)."""
        x, y = int(self.xy[i, 0]), int(self.xy[i, 1])
        reader = self.reader
        with reader.slide.reading(reader.level, x, y):
            reader.tiled.paint(x, y, out, self._tile)
        for key in self.done_after.pop(i, ()):
            self.held.pop(key, None)

    def _tile(self, row: int, col: int) -> np.ndarray | None:
        key = (row, col)
        if key not in self.held:
            self.held[key] = self.reader.tiled.decode(row, col)
            self.reader.decoded += 1
        return self.held[key]


class RegionReads:
    """Tiles cut from one `Slide.read` of each cell's bounding box; positions level-0 px."""

    def __init__(self, slide: Slide, level: int, downsample: float, tile_px: int):
        self.slide, self.level, self.downsample, self.tile_px = slide, level, downsample, tile_px
        self.decoded = 0  # not known: OpenSlide decodes (and caches) out of sight

    def open_cell(self, xy: np.ndarray) -> _RegionCell:
        return _RegionCell(self, xy)


class _RegionCell:
    def __init__(self, reader: RegionReads, xy: np.ndarray):
        x0, y0 = xy.min(axis=0)
        span = xy.max(axis=0) - (x0, y0)
        size = np.round(span / reader.downsample).astype(int) + reader.tile_px
        self.pixels = reader.slide.read(reader.level, int(x0), int(y0), int(size[0]), int(size[1]))
        self.offsets = np.round((xy - (x0, y0)) / reader.downsample).astype(int)
        self.tile_px = reader.tile_px

    def copy_tile(self, i: int, out: np.ndarray) -> None:
        left, top = self.offsets[i]
        out[...] = self.pixels[top : top + self.tile_px, left : left + self.tile_px]
