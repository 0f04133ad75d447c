"""Tiled TIFF levels decoded straight to RGB: OpenSlide's pixels without its detours.

OpenSlide paints every read into a premultiplied ARGB surface and returns RGBA, and the
conversions around that cost more than decoding the JPEG tiles themselves (83 ms for a
1792 px read of which 21 ms is decoding, measured here). For Aperio and generic TIFF
slides whose level is tiled JPEG or Aperio's RGB JPEG 2000, we decode the compressed
tiles with the same codecs (tifffile + imagecodecs: libjpeg-turbo, OpenJPEG) and paste
them into RGB arrays. The tests check that the pixels are OpenSlide's, bit for bit.

Each compressed tile is exposed on its own (`TiledLevel.decode`) so that the loader can
decode every tile of a slide once and cut it into all the model tiles that overlap it.

Where a decoded tile lands in memory matters: libjpeg-turbo's SIMD colour conversion
writes each output row that starts on a 32-byte boundary with non-temporal stores, which
bypass the cache. The decode then takes 25% longer here (it fights the cache lines that
imagecodecs just zeroed) and the tile, about to be cut into model tiles, is no longer in
cache. `decode_buffer` places every row off that boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import imagecodecs
import numpy as np
import tifffile
from tifffile.tifffile import jpeg_decode_colorspace

from slidesnake.slides.byte_ranges import FileRanges, RemoteRanges
from slidesnake.slides.jpeg_streams import JpegStreams
from slidesnake.slides.reduced_jpeg2k import ReducedJpeg2k
from slidesnake.slides.scaled_jpeg import ScaledJpeg

ByteRanges = FileRanges | RemoteRanges

# TIFF compression codes we decode. Aperio's YCbCr JPEG 2000 (33003) is left to OpenSlide:
# it converts the colours itself and we have no such slide to check against.
CODECS = {7: "JPEG", 33005: "JPEG 2000"}
# Each codec's decoder at 1/2, 1/4 or 1/8 of the size.
SCALED = {"JPEG": ScaledJpeg, "JPEG 2000": ReducedJpeg2k}
VENDORS = {"aperio", "generic-tiff"}
# Where decoded rows start, in bytes past a 32-byte boundary: TIFF tiles are a multiple of
# 16 px wide, so RGB rows are a multiple of 48 bytes and every row starts 8 or 24 bytes past
# one (see the module docstring).
ROW_MISALIGNMENT = 8
# Cuts kept per level: tiles on a regular grid need a few dozen, reads of any size more.
MAX_CUTS_KEPT = 4096

# A compressed tile by (row, column) of its level's tile grid; None where the scanner
# skipped it (background).
TileSource = Callable[[int, int], "np.ndarray | None"]


class Piece(NamedTuple):
    """The part of a compressed tile that a read needs: the tile, as (rows, columns) from
    the read's first tile, where the part is in that tile (`source`) and where it goes in
    the read (`target`), as (rows, columns) slices."""

    row: int
    col: int
    source: tuple[slice, slice]
    target: tuple[slice, slice]


class Cut(NamedTuple):
    """How one read is cut from the compressed tiles: its pieces, counted from compressed
    tile (row, col), and whether they cover it (False: part of it is outside the level)."""

    row: int
    col: int
    pieces: tuple[Piece, ...]
    inside: bool

    def tiles(self) -> list[tuple[int, int]]:
        """(row, col) of each compressed tile the read overlaps."""
        return [(self.row + p.row, self.col + p.col) for p in self.pieces]

    def paint(self, out: np.ndarray, tiles: TileSource) -> None:
        """Copy each piece from its compressed tile into `out`; white where there is none."""
        if not self.inside:
            out.fill(255)
        for piece in self.pieces:
            tile = tiles(self.row + piece.row, self.col + piece.col)
            if tile is None:
                out[piece.target] = 255
            else:
                out[piece.target] = tile[piece.source]


class TiledLevel:
    """One tiled pyramid level: its compressed tile grid and a decoder for its tiles."""

    def __init__(self, page: tifffile.TiffPage, ranges: ByteRanges, shrink: int = 1):
        """`shrink` 2, 4 or 8: the level as its tiles decode at that fraction of their
        size (`scaled_jpeg`, `reduced_jpeg2k`); a pixel partly past the level's edge is
        left out."""
        self._page, self._ranges, self.shrink = page, ranges, shrink
        self.width, self.height = page.imagewidth // shrink, page.imagelength // shrink
        self.tile_width, self.tile_height = page.tilewidth // shrink, page.tilelength // shrink
        self.across = -(-page.imagewidth // page.tilewidth)
        self.codec = CODECS[page.compression]
        self._decode = _decoder(page) if shrink == 1 else SCALED[self.codec](page, shrink)
        # Whole streams for a decoder elsewhere (the GPU's): JPEG tiles, at full size.
        self._streams = JpegStreams(page) if self.codec == "JPEG" and shrink == 1 else None
        self._pieces: dict[tuple[int, int, int, int], tuple[Piece, ...]] = {}

    def decode(self, row: int, col: int, out: np.ndarray | None = None) -> np.ndarray | None:
        """The RGB pixels of compressed tile (row, col), full tile size even at the edges,
        into `out` if given (a reused buffer saves the allocation and its page faults)."""
        data = self._compressed(row, col)
        if data is None:
            return None
        if out is None:
            out = decode_buffer(self.tile_height, self.tile_width)
        return self._decode(data, out=out)

    @property
    def streams_whole(self) -> bool:
        """Whether `stream` serves this level's tiles (JPEG at full size)."""
        return self._streams is not None

    def stream(self, row: int, col: int) -> bytes | None:
        """Compressed tile (row, col) as a whole JPEG stream, for a decoder that reads
        only those (see `streams_whole`); None where the scanner skipped it."""
        data = self._compressed(row, col)
        return None if data is None else self._streams(data)

    def _compressed(self, row: int, col: int) -> bytes | memoryview | None:
        index = row * self.across + col
        count = self._page.databytecounts[index]
        if count == 0:
            return None
        return self._ranges.read(self._page.dataoffsets[index], count)

    def agrees_with(self, exact: TiledLevel) -> bool:
        """Whether this scaled level's middle non-empty tile agrees with its `exact`
        decode (a colour space libjpeg-turbo guessed wrong does not). A tile neither
        decoder reads is left to the exact path to report."""
        middle = self.middle_tile()
        if middle is None:
            return True
        row, col = middle
        self.prefetch([middle])  # a slide read in place reads only what was fetched
        try:
            full, small = exact.decode(row, col), self.decode(row, col)
        except (ValueError, RuntimeError, OSError):  # the codecs' errors (Pillow's: OSError)
            return False
        return self._decode.agrees(full, small)

    def middle_tile(self) -> tuple[int, int] | None:
        """(row, col) of the level's middle non-empty tile, the one its probes decode."""
        filled = [i for i, count in enumerate(self._page.databytecounts) if count]
        return divmod(filled[len(filled) // 2], self.across) if filled else None

    def prefetch(self, tiles: Iterable[tuple[int, int]]) -> None:
        """Fetch the compressed bytes of these (row, col) tiles ahead of their decode (a
        slide read in place fetches them merged, in one round of requests)."""
        offsets, counts = self._page.dataoffsets, self._page.databytecounts
        indices = (row * self.across + col for row, col in tiles)
        self._ranges.prefetch((offsets[i], counts[i]) for i in indices)

    def cut(self, x: int, y: int, width: int, height: int) -> Cut:
        """How a width x height read at (x, y) is cut from the compressed tiles. Reads at
        the same offset in their compressed tile are cut alike, so the pieces are worked
        out once per offset (a few dozen on a regular tile grid) and shared."""
        right, bottom = min(x + width, self.width), min(y + height, self.height)
        inside = x >= 0 and y >= 0 and right == x + width and bottom == y + height
        row, col = max(y, 0) // self.tile_height, max(x, 0) // self.tile_width
        left, top = col * self.tile_width, row * self.tile_height
        key = (x - left, y - top, right - left, bottom - top)
        pieces = self._pieces.get(key)
        if pieces is None:
            if len(self._pieces) >= MAX_CUTS_KEPT:
                self._pieces.clear()
            pieces = self._pieces[key] = self._cut_at(*key)
        return Cut(row, col, pieces, inside)

    def _cut_at(self, x: int, y: int, right: int, bottom: int) -> tuple[Piece, ...]:
        """The pieces of the read from (x, y) to (right, bottom), the level's part of it,
        in px from the corner of compressed tile (0, 0)."""
        if right <= max(x, 0) or bottom <= max(y, 0):
            return ()
        tw, th = self.tile_width, self.tile_height
        pieces = []
        for row in range(max(y, 0) // th, (bottom - 1) // th + 1):
            y0, y1 = max(y, row * th), min(bottom, (row + 1) * th)
            for col in range(max(x, 0) // tw, (right - 1) // tw + 1):
                x0, x1 = max(x, col * tw), min(right, (col + 1) * tw)
                source = (slice(y0 - row * th, y1 - row * th), slice(x0 - col * tw, x1 - col * tw))
                target = (slice(y0 - y, y1 - y), slice(x0 - x, x1 - x))
                pieces.append(Piece(row, col, source, target))
        return tuple(pieces)

    def read(self, x: int, y: int, width: int, height: int) -> np.ndarray:
        """RGB uint8 of this level from its pixel (x, y), each tile decoded for this read."""
        out = np.empty((height, width, 3), np.uint8)
        cut = self.cut(x, y, width, height)
        self.prefetch(cut.tiles())
        cut.paint(out, self.decode)
        return out


class TiffTiledLevels:
    """The tiled pages of a TIFF slide that we decode, by OpenSlide level (matched by size)."""

    def __init__(
        self, tiff: tifffile.TiffFile, pages: dict[int, tifffile.TiffPage], ranges: ByteRanges
    ):
        self._tiff, self.ranges, self._pages = tiff, ranges, pages
        self.levels = {level: TiledLevel(page, ranges) for level, page in pages.items()}
        self._scaled: dict[tuple[int, int], TiledLevel | None] = {}

    def scaled(self, level: int, shrink: int) -> TiledLevel | None:
        """`level` decoded at 1/`shrink` of its size, where its middle tile, decoded
        both ways, agrees (else None: read it the exact way)."""
        key = (level, shrink)
        if key not in self._scaled:
            page = self._pages.get(level)
            scaled = None if page is None else TiledLevel(page, self.ranges, shrink)
            if scaled is not None and not scaled.agrees_with(self.levels[level]):
                scaled = None
            self._scaled[key] = scaled
        return self._scaled[key]

    @classmethod
    def open(
        cls, path: Path, vendor: str, level_dimensions: tuple[tuple[int, int], ...]
    ) -> TiffTiledLevels | None:
        """The fast reader of this slide, or None where OpenSlide must do the work."""
        if vendor not in VENDORS:
            return None
        try:
            tiff = tifffile.TiffFile(path)
        except (tifffile.TiffFileError, OSError, ValueError):
            return None
        pages = {}
        for level, size in enumerate(level_dimensions):
            page = next((p for p in tiff.pages if fits(p, size)), None)
            if page is not None:
                pages[level] = page
        if not pages:
            tiff.close()
            return None
        return cls(tiff, pages, FileRanges(path))

    def close(self) -> None:
        self.ranges.close()
        self._tiff.close()


def decode_buffer(height: int, width: int) -> np.ndarray:
    """An empty (height, width, 3) uint8 array for a decoder to write into, starting
    `ROW_MISALIGNMENT` bytes past a 32-byte boundary, so libjpeg-turbo keeps it in cache."""
    size = height * width * 3
    raw = np.empty(size + 32, np.uint8)
    start = (ROW_MISALIGNMENT - raw.ctypes.data) % 32
    return raw[start : start + size].reshape(height, width, 3)


def _decoder(page: tifffile.TiffPage) -> Callable[..., np.ndarray]:
    """The codec call tifffile would make for this page's tiles, with an `out` buffer."""
    if CODECS[page.compression] == "JPEG 2000":
        return imagecodecs.jpeg2k_decode
    colorspace, outcolorspace = jpeg_decode_colorspace(
        page.photometric, page.planarconfig, page.extrasamples, page.is_jfif
    )
    return partial(
        imagecodecs.jpeg_decode,
        tables=page.jpegtables,
        colorspace=colorspace,
        outcolorspace=outcolorspace,
    )


def fits(page: tifffile.TiffPage, size: tuple[int, int]) -> bool:
    return (
        page.is_tiled
        and page.compression in CODECS
        and page.samplesperpixel == 3
        and page.planarconfig == 1
        and page.bitspersample == 8
        and page.imagedepth == 1
        and (page.imagewidth, page.imagelength) == tuple(size)
    )
