"""The CPU side of embedding: decode tiles in worker processes, hand over uint8 batches.

Tiles are read cell by cell (see tile_cells): a cell is a patch of adjacent tiles whose
compressed slide tiles are decoded once and copied straight into the batch (see
tile_readers). Cells are taken band by band in row-major order and dealt round-robin to
the workers (see loader_workers; a slide in a store deals runs of cells, one round of
requests each), and their batches are received round-robin, so the
rows in flight stay close together and the output writer's buffer stays small.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from slidesnake.loader.batch_ring import BatchRing
from slidesnake.loader.cells import plan_cells
from slidesnake.loader.compressed_batches import (
    CompressedStreams,
    DeviceProbe,
    PackedBatch,
    PackedTable,
    StreamPacker,
)
from slidesnake.loader.readers import CompressedTiles, PixelBatch, RegionReads
from slidesnake.loader.workers import LoaderWorkers
from slidesnake.slides import stores
from slidesnake.slides.scaled_jpeg import SHRINKS
from slidesnake.slides.slide import Slide
from slidesnake.tiling.grid import TileGeometry


@dataclass(frozen=True)
class ReadPlan:
    """Where and how big tiles are at the level they are read from."""

    level: int
    downsample: float  # level-0 px per read px
    tile_px: int  # tile side in read px
    shrink: int = 1  # the level's JPEG tiles decoded at 1/shrink of their size

    @classmethod
    def from_geometry(cls, geometry: TileGeometry, decode: str = "exact") -> ReadPlan:
        """The plan for `geometry`; with `decode` 'scaled', one that decodes the read
        level's JPEG tiles at the largest fraction (1/2, 1/4, 1/8) that still gives the
        tile at least its model size in px (`exact` where none does)."""
        tile_px = max(1, round(geometry.size_level0 / geometry.read_downsample))
        plan = cls(geometry.read_level, geometry.read_downsample, tile_px)
        if decode == "scaled":
            shrinks = [s for s in SHRINKS if tile_px % s == 0 and tile_px // s >= geometry.size]
            if shrinks:
                return plan.scaled(max(shrinks))
        return plan

    def scaled(self, shrink: int) -> ReadPlan:
        return ReadPlan(self.level, self.downsample * shrink, self.tile_px // shrink, shrink)

    def exact(self) -> ReadPlan:
        """This plan with every pixel of the level decoded."""
        level_downsample = self.downsample / self.shrink
        return ReadPlan(self.level, level_downsample, self.tile_px * self.shrink)


Reader = CompressedStreams | CompressedTiles | RegionReads


def tile_reader(
    slide: Slide, plan: ReadPlan, coords: np.ndarray, packed: bool = False
) -> tuple[Reader, np.ndarray]:
    """The reader for these tiles and their positions in its units: read px where we
    decode the compressed tiles (every tile starts on a whole read pixel), level-0 px
    where OpenSlide reads regions (never for a scaled plan: see `planned_reader`). With
    `packed`, a JPEG level's tiles go to the device compressed (`CompressedStreams`)."""
    tiled = slide.tiled_level(plan.level, plan.shrink)
    d = int(plan.downsample)
    if tiled is not None and not (coords % d).any():
        kind = CompressedStreams if packed and tiled.streams_whole else CompressedTiles
        return kind(slide, plan.level, tiled, plan.tile_px), coords // d
    return RegionReads(slide, plan.level, plan.downsample, plan.tile_px), coords


def planned_reader(
    slide: Slide, plan: ReadPlan, coords: np.ndarray, packed: bool = False
) -> tuple[ReadPlan, Reader, np.ndarray]:
    """`plan`, or its exact form where this slide's level cannot be decoded scaled (not
    JPEG, not a TIFF we decode, tiles off the scaled pixel grid, colours that disagree),
    with its reader and the tiles' positions (`tile_reader`)."""
    reader, positions = tile_reader(slide, plan, coords, packed)
    if plan.shrink > 1 and not isinstance(reader, CompressedTiles):
        plan = plan.exact()
        reader, positions = tile_reader(slide, plan, coords)
    return plan, reader, positions


class TileBatches:
    """The tiles of one slide as uint8 batches; use `stream()` to read them."""

    def __init__(
        self,
        slide_path: str | Path,
        slide_id: str,
        coords: np.ndarray,
        geometry: TileGeometry,
        batch_size: int,
        block: int = 4,
        decode: str = "exact",
    ) -> None:
        self.slide_path = slide_path
        self.slide_id = slide_id
        self.coords = coords
        self.geometry = geometry
        self.batch_size = batch_size
        # A slide read in place is kept for the workers: it holds no OpenSlide handle,
        # and its index cost requests that the workers need not repeat.
        self._slide: Slide | None = self._open()
        self.decode = decode
        asked = ReadPlan.from_geometry(geometry, decode)
        self.plan, reader, _ = planned_reader(self._slide, asked, coords, decode == "gpu")
        # Batches handed over compressed, and what their device decoder checks first.
        self.packed = isinstance(reader, CompressedStreams)
        self.device_probe: DeviceProbe | None = reader.probe() if self.packed else None
        grid = reader.tile_grid
        self.planning_io = self._slide.io_counts()
        # In place: the version every worker's reads are pinned to, for the records.
        self.slide_stat = self._slide.pinned
        if not self._slide.in_place:
            self._slide.close()
            self._slide = None
        step = round(geometry.stride_level0 / self.plan.downsample)
        grid_xy = coords // geometry.stride_level0
        self.cells = plan_cells(grid_xy, step, self.plan.tile_px, grid, block)
        self.ring: BatchRing | None = None

    @property
    def read_attributes(self) -> dict[str, str | int]:
        """How the pixels were decoded, for the store: the method asked for (the one the
        cohort's later runs keep, see cohort.decode_method) and the fraction of its size
        this slide's level was decoded at (1 where it could only be read exactly); with
        `gpu`, where (`device`, or `loader` for a level the device does not decode)."""
        attributes: dict[str, str | int] = {
            "decode": self.decode,
            "decode_shrink": self.plan.shrink,
        }
        if self.decode == "gpu":
            attributes["decoded_on"] = "device" if self.packed else "loader"
        return attributes

    @property
    def batch_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.plan.tile_px, self.plan.tile_px, 3)

    def _open(self) -> Slide:
        return Slide(self.slide_path, self.slide_id, self.geometry.slide_mpp)

    def stream(self, workers: int, prefetch: int) -> BatchStream:
        """Start `workers` loader processes (0: read in this process), `prefetch` batches
        ahead each. Call it before this process starts any thread: the workers fork now."""
        self.ring = BatchRing(workers, prefetch + 1, self.batch_shape)
        return BatchStream(self, workers)

    def tickets(self, lane: int, lanes: int) -> Iterator[Ticket]:
        """Fill batches with every `lanes`-th cell from `lane` on, in `lane` of the ring; a
        ticket per batch."""
        with self._worker_slide() as slide:
            reader, positions = tile_reader(slide, self.plan, self.coords, self.packed)
            counts = _Counts(slide, reader)
            run = self._cells_ahead(slide)
            cells = self._dealt(lane, lanes, run)
            fill = _Filling(self.ring, lane, reader, self.batch_size)
            with _RunsAhead(reader, positions, cells, run, slide.in_place) as fetch:
                for index, cell in enumerate(cells):
                    if index % run == 0:
                        fetch.ready(index)
                    tiles = reader.open_cell(positions[cell])
                    for i, row in enumerate(cell):
                        yield from fill.add(tiles, i, row, counts)
            yield from fill.last(counts)

    def _worker_slide(self) -> AbstractContextManager[Slide]:
        """The slide as this process reads it: the planning one where it crosses a fork,
        else a handle of its own (OpenSlide handles must not cross a fork)."""
        return nullcontext(self._slide) if self._slide is not None else self._open()

    def _cells_ahead(self, slide: Slide) -> int:
        """Cells whose compressed tiles a worker fetches in one round: in place, enough
        for `storage.readahead_tiles` tiles; from disk one (the page cache reads ahead)."""
        if not slide.in_place or not self.cells:
            return 1
        per_cell = max(1, len(self.coords) // len(self.cells))
        return max(1, stores.settings().readahead_tiles // per_cell)

    def _dealt(self, lane: int, lanes: int, run: int) -> list[np.ndarray]:
        """The cells of worker `lane`: runs of `run` neighbouring cells, dealt in turn.
        From disk a run is one cell; in place a run is one round of requests, and
        neighbouring cells make neighbouring byte ranges, merged into few requests."""
        starts = range(lane * run, len(self.cells), lanes * run)
        return [cell for start in starts for cell in self.cells[start : start + run]]

    def close(self) -> None:
        if self._slide is not None:
            self._slide.close()
            self._slide = None


class Ticket(NamedTuple):
    """A worker's word for one filled batch: its rows in the tile table, its slot, the
    worker's reading so far and, for a packed batch, its table."""

    rows: np.ndarray
    slot: int
    counts: ReadCounts
    table: PackedTable | None


class _Filling:
    """A worker's batch being filled, slot by slot of its lane."""

    def __init__(self, ring: BatchRing, lane: int, reader: Reader, size: int):
        self.ring, self.lane, self.reader, self.size = ring, lane, reader, size
        self.rows = np.empty(size, np.int64)
        self.batch: PixelBatch | StreamPacker | None = None
        self.slot = 0

    def add(self, cell, i: int, row: int, counts: _Counts) -> Iterator[Ticket]:
        """Put tile `i` of `cell` in the batch; the ticket of each batch it fills."""
        if self.batch is None:
            self._claim()
        if not self.batch.add(cell, i):  # a packed batch out of room: send it as it is
            yield self._ticket(counts)
            self._claim()
            self.batch.add(cell, i)  # room for one tile: checked by the packer
        self.rows[self.batch.count - 1] = row
        if self.batch.count == self.size:
            yield self._ticket(counts)

    def last(self, counts: _Counts) -> Iterator[Ticket]:
        if self.batch is not None:
            yield self._ticket(counts)

    def _claim(self) -> None:
        self.slot = self.ring.claim(self.lane)
        self.batch = self.reader.batch(self.ring.tiles[self.lane, self.slot])

    def _ticket(self, counts: _Counts) -> Ticket:
        batch, self.batch = self.batch, None
        return Ticket(self.rows[: batch.count].copy(), self.slot, counts.now(), batch.table())


class _RunsAhead:
    """A worker's rounds of requests to a store, one run of cells ahead: a thread fetches
    the next run's bytes while this one is decoded (the decoder releases the GIL), so the
    store's round trip hides behind the decode. From disk it does nothing."""

    def __init__(
        self,
        reader: Reader,
        positions: np.ndarray,
        cells: list[np.ndarray],
        run: int,
        active: bool,
    ):
        self.reader, self.positions, self.cells, self.run = reader, positions, cells, run
        self._thread = ThreadPoolExecutor(1, "slidesnake-fetch") if active else None
        self._next: Future | None = None

    def ready(self, index: int) -> None:
        """Return once the run from cell `index` is fetched; start fetching the next."""
        if self._thread is None:
            return
        if self._next is None:
            self._fetch(index)
        else:
            self._next.result()
        following = index + self.run
        self._next = (
            self._thread.submit(self._fetch, following) if following < len(self.cells) else None
        )

    def _fetch(self, index: int) -> None:
        run = self.cells[index : index + self.run]
        self.reader.prefetch(self.positions[np.concatenate(run)])

    def __enter__(self) -> _RunsAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True, cancel_futures=True)


class ReadCounts(NamedTuple):
    """A worker's reading so far: compressed tiles decoded (0 where OpenSlide reads),
    bytes read and requests made for them."""

    decoded: int
    bytes_read: int
    requests: int


class _Counts:
    """A worker's `ReadCounts`, from when it started (a forked worker inherits the
    planning process's counters)."""

    def __init__(self, slide: Slide, reader: Reader):
        self.slide, self.reader = slide, reader
        self.start = slide.io_counts()

    def now(self) -> ReadCounts:
        bytes_read, requests = self.slide.io_counts()
        return ReadCounts(self.reader.decoded, bytes_read - self.start[0], requests - self.start[1])


class BatchStream:
    """(rows, tiles) batches: tiles (B, h, w, 3) uint8 in shared memory (a `PackedBatch`
    where the device decodes them), valid until the next batch is asked for (its slot is
    then handed back to its worker). Received from
    the workers in turn, as long as each has batches. Close it (or use it as a context
    manager) to stop the workers early; it closes itself after the last batch."""

    def __init__(self, dataset: TileBatches, workers: int):
        self.ring, self._dataset = dataset.ring, dataset
        self.packed = dataset.packed  # batches of compressed streams (`PackedBatch`) ...
        self.device_probe = dataset.device_probe  # ... and what their decoder checks first
        self._workers = LoaderWorkers(dataset.tickets, workers) if workers else None
        self._in_process = None if workers else dataset.tickets(0, 1)
        self._turns = deque(range(max(workers, 1)))  # lanes that still have batches
        self._held: int | None = None
        self._planning = dataset.planning_io
        self._counts: dict[int, ReadCounts] = {}

    def reads(self) -> dict[str, int]:
        """What all workers read so far, for metrics.json: compressed tiles decoded (0
        where OpenSlide reads), and bytes and requests for them and the slide's index."""
        counts = self._counts.values()
        return {
            "compressed_tiles_decoded": sum(c.decoded for c in counts),
            "bytes_read": self._planning[0] + sum(c.bytes_read for c in counts),
            "requests": self._planning[1] + sum(c.requests for c in counts),
        }

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray | PackedBatch]:
        if self._held is not None:
            self.ring.release(self._held)
            self._held = None
        while self._turns:
            lane = self._turns.popleft()
            try:
                ticket = self._receive(lane)
            except BaseException:
                self.close()  # the other workers would wait on their full lanes forever
                raise
            if ticket is not None:
                self._turns.append(lane)
                self._held, self._counts[lane] = lane, ticket.counts
                return ticket.rows, self._batch(lane, ticket)
        self.close()
        raise StopIteration

    def _batch(self, lane: int, ticket: Ticket) -> np.ndarray | PackedBatch:
        if ticket.table is None:
            return self.ring.view(lane, ticket.slot, len(ticket.rows))
        return PackedBatch(self.ring.tiles[lane, ticket.slot].reshape(-1), ticket.table)

    def _receive(self, lane: int) -> Ticket | None:
        if self._workers is not None:
            return self._workers.receive(lane)
        return next(self._in_process, None)

    def close(self) -> None:
        self._turns.clear()
        if self._workers is not None:
            self._workers.close()
        self._dataset.close()
        if self._in_process is not None:
            self._in_process.close()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
