"""Batches of compressed tiles, for a decoder on the device (`loader.decode: gpu`).

A worker in this mode decodes nothing: it reads the compressed JPEG tiles that a batch's
model tiles overlap, each once per batch, writes them back to back into its batch slot
(a fraction of the decoded batch's size; a slot that cannot hold the next tile's streams
ends the batch early) and sends a table of where each model tile's pieces come from. The
main process decodes the streams on the device in one call and cuts the model tiles
there (`embed.device_decode`), so only compressed bytes cross to the GPU and no loader
core spends its time in Huffman decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from slidesnake.errors import ConfigError, SlideReadError
from slidesnake.loader.readers import CompressedTiles
from slidesnake.slides.tiff_tiles import Cut

# Columns of PackedTable.pieces.
TILE, STREAM, SOURCE, TARGET = 0, 1, slice(2, 6), slice(6, 10)
WHITE = -1  # the stream of a piece whose compressed tile the scanner skipped


class PackedTable(NamedTuple):
    """Where the model tiles of a packed batch come from.

    `ends`: (S,) end offset of each stream in the slot's bytes, back to back from 0.
    `sources`: (S, 2) (row, col) of each stream's compressed tile, to name a bad one.
    `pieces`: (P, 10) model tile, stream (`WHITE`: none), then source and target
    y0, y1, x0, x1 in px. `blank`: (T,) model tiles partly outside the level (white first).
    """

    ends: np.ndarray
    sources: np.ndarray
    pieces: np.ndarray
    blank: np.ndarray


class PackedBatch(NamedTuple):
    """A batch as compressed streams: the slot's bytes (valid until the next batch is
    asked for) and their table."""

    data: np.ndarray
    table: PackedTable

    def __len__(self) -> int:
        return len(self.table.blank)

    def streams(self) -> list[np.ndarray]:
        """Each stream's bytes, views of the slot."""
        ends = self.table.ends.tolist()
        return [self.data[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


@dataclass(frozen=True)
class DeviceProbe:
    """What a device decoder checks itself against before the first batch (one tile's
    stream and its exact decode on the CPU: a decoder that reads the colours another way
    is refused), and how to name a tile it fails on."""

    stream: bytes
    reference: np.ndarray
    slide_id: str
    path: str
    level: int
    tile_level0: tuple[int, int]  # a compressed tile's (width, height) in level-0 px

    def error(self, row: int, col: int, problem: str) -> SlideReadError:
        x, y = col * self.tile_level0[0], row * self.tile_level0[1]
        return SlideReadError(
            self.slide_id,
            self.path,
            f"pixels at level {self.level}, ({x}, {y}) could not be decoded on the device "
            f"({problem})",
            "set loader.decode to exact, which decodes on the CPU and names the damage; "
            "if it fails too, the file is corrupt: copy or export it again",
        )


class CompressedStreams(CompressedTiles):
    """Tiles of a JPEG level we hand over compressed: cells are packed, not decoded."""

    def open_cell(self, xy: np.ndarray) -> _StreamCell:
        return _StreamCell(self, xy)

    def batch(self, slot: np.ndarray) -> StreamPacker:
        return StreamPacker(self, slot.reshape(-1))

    def probe(self) -> DeviceProbe | None:
        """The level's middle non-empty tile as a `DeviceProbe` (None: the level is empty)."""
        tiled = self.tiled
        middle = tiled.middle_tile()
        if middle is None:
            return None
        row, col = middle
        tiled.prefetch([middle])
        stream, reference = tiled.stream(row, col), tiled.decode(row, col)
        size = (tiled.tile_width * self.scale, tiled.tile_height * self.scale)
        slide = self.slide
        return DeviceProbe(stream, reference, slide.slide_id, str(slide.path), self.level, size)


class _StreamCell:
    """The model tiles of one cell, as cuts of the compressed tiles."""

    def __init__(self, reader: CompressedStreams, xy: np.ndarray):
        px = reader.tile_px
        self.cuts = [reader.tiled.cut(x, y, px, px) for x, y in xy.tolist()]


class StreamPacker:
    """Fills one batch slot with the compressed streams of its model tiles."""

    def __init__(self, reader: CompressedStreams, data: np.ndarray):
        self.reader, self.data = reader, data
        self.count = 0
        self._used = 0
        self._index: dict[tuple[int, int], int] = {}  # compressed tile -> stream
        self._ends: list[int] = []
        self._sources: list[tuple[int, int]] = []
        self._pieces: list[list[int]] = []
        self._blank: list[bool] = []

    def add(self, cell: _StreamCell, i: int) -> bool:
        """Pack tile `i` of `cell`; False where its new streams do not fit (then nothing
        was packed: the batch is full)."""
        cut = cell.cuts[i]
        new = {key: self._read(key) for key in cut.tiles() if key not in self._index}
        size = sum(len(stream) for stream in new.values() if stream is not None)
        if self._used + size > len(self.data):
            if not self.count:
                raise ConfigError(
                    f"the compressed tiles of one model tile ({size} bytes) do not fit a "
                    f"batch slot ({len(self.data)} bytes). Fix: raise loader.batch_size, or "
                    "set loader.decode to exact or scaled"
                )
            return False
        for key, stream in new.items():
            self._index[key] = WHITE if stream is None else self._put(key, stream)
        self._pack(cut)
        return True

    def _read(self, key: tuple[int, int]) -> bytes | None:
        return self.reader.tiled.stream(*key)

    def _put(self, key: tuple[int, int], stream: bytes) -> int:
        end = self._used + len(stream)
        self.data[self._used : end] = np.frombuffer(stream, np.uint8)
        self._used = end
        self._ends.append(end)
        self.reader.decoded += 1  # on the device, but counted as the workers' decodes are
        self._sources.append(key)
        return len(self._ends) - 1

    def _pack(self, cut: Cut) -> None:
        for piece in cut.pieces:
            stream = self._index[(cut.row + piece.row, cut.col + piece.col)]
            (sy, sx), (ty, tx) = piece.source, piece.target
            bounds = (sy.start, sy.stop, sx.start, sx.stop, ty.start, ty.stop, tx.start, tx.stop)
            self._pieces.append([self.count, stream, *bounds])
        self._blank.append(not cut.inside)
        self.count += 1

    def table(self) -> PackedTable:
        return PackedTable(
            np.array(self._ends, np.int64),
            np.array(self._sources, np.int64).reshape(-1, 2),
            np.array(self._pieces, np.int64).reshape(-1, 10),
            np.array(self._blank, bool),
        )
