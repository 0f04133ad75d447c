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

from slidesnake.errors import SlideError
from slidesnake.slides.slide import Slide
from slidesnake.slides.tiff_tiles import TiledLevel


class CompressedTiles:
    """Tiles of a slide level we decode ourselves; positions in read-level px."""

    def __init__(self, slide: Slide, level: int, tiled: TiledLevel, tile_px: int):
        self.slide, self.level, self.tiled, self.tile_px = slide, level, tiled, tile_px
        self.tile_grid = (tiled.tile_width, tiled.tile_height)  # compressed tile size
        # level-0 px per px of the decoded tiles
        self.scale = int(slide.levels[level].downsample) * tiled.shrink
        self.decoded = 0  # compressed tiles decoded, for the metrics and the tests
        self.spare: list[np.ndarray] = []  # buffers of decoded tiles no longer needed

    def open_cell(self, xy: np.ndarray) -> _CompressedCell:
        return _CompressedCell(self, xy)

    def batch(self, slot: np.ndarray) -> PixelBatch:
        return PixelBatch(slot)

    def decode(self, row: int, col: int) -> np.ndarray | None:
        """Compressed tile (row, col), into a spare buffer if there is one; a decoder's
        error names the slide and the place."""
        self.decoded += 1
        try:
            return self.tiled.decode(row, col, self.spare.pop() if self.spare else None)
        except SlideError:
            raise  # the store's failure, already said
        except Exception as err:
            x, y = col * self.tiled.tile_width, row * self.tiled.tile_height
            raise self.slide.read_error(self.level, x * self.scale, y * self.scale, err) from None

    def prefetch(self, xy: np.ndarray) -> None:
        """Fetch ahead the compressed tiles of the tiles at `xy` (a slide in a store)."""
        self.tiled.prefetch(sorted(self.needed(xy)))

    def needed(self, xy: np.ndarray) -> set[tuple[int, int]]:
        """(row, col) of every compressed tile that the tiles at `xy` overlap."""
        px = self.tile_px
        return {key for x, y in xy.tolist() for key in self.tiled.cut(x, y, px, px).tiles()}


class _CompressedCell:
    """The model tiles of one cell, in order; decoded compressed tiles are dropped after
    their last use, so a cell holds about two rows of them across its width."""

    def __init__(self, reader: CompressedTiles, xy: np.ndarray):
        self.reader = reader
        px = reader.tile_px
        self.cuts = [reader.tiled.cut(x, y, px, px) for x, y in xy.tolist()]
        last_use: dict[tuple[int, int], int] = {}
        for i, cut in enumerate(self.cuts):
            for key in cut.tiles():
                last_use[key] = i
        self.done_after: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for key, i in last_use.items():
            self.done_after[i].append(key)
        self.held: dict[tuple[int, int], np.ndarray | None] = {}

    def copy_tile(self, i: int, out: np.ndarray) -> None:
        """Write tile `i` of the cell into `out` (tile_px, tile_px, 3)."""
        self.cuts[i].paint(out, self._tile)
        for key in self.done_after.pop(i, ()):
            done = self.held.pop(key)
            if done is not None:
                self.reader.spare.append(done)

    def _tile(self, row: int, col: int) -> np.ndarray | None:
        key = (row, col)
        if key not in self.held:
            self.held[key] = self.reader.decode(row, col)
        return self.held[key]


class PixelBatch:
    """Fills one batch slot (B, h, w, 3) with decoded tiles."""

    def __init__(self, slot: np.ndarray):
        self.slot, self.count = slot, 0

    def add(self, cell: _CompressedCell | _RegionCell, i: int) -> bool:
        """Copy tile `i` of `cell` into the next place (a slot always has room for it)."""
        cell.copy_tile(i, self.slot[self.count])
        self.count += 1
        return True

    def table(self) -> None:
        """Nothing besides the pixels: the slot holds the batch."""


class RegionReads:
    """Tiles cut from one `Slide.read` of each cell's bounding box; positions level-0 px."""

    def __init__(self, slide: Slide, level: int, downsample: float, tile_px: int):
        self.slide, self.level, self.downsample, self.tile_px = slide, level, downsample, tile_px
        self.tile_grid = None  # OpenSlide's tiles are out of sight
        self.decoded = 0  # not known: OpenSlide decodes (and caches) out of sight

    def open_cell(self, xy: np.ndarray) -> _RegionCell:
        return _RegionCell(self, xy)

    def batch(self, slot: np.ndarray) -> PixelBatch:
        return PixelBatch(slot)

    def prefetch(self, xy: np.ndarray) -> None:
        """Nothing to fetch ahead: each cell is one read."""


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
