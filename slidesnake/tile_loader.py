"""The CPU side of embedding: decode tiles in worker processes, hand over uint8 batches.

Tiles are read cell by cell (see tile_cells): a cell is a patch of adjacent tiles whose
compressed slide tiles are decoded once and copied straight into the batch (see
tile_readers). Cells are taken band by band in row-major order and dealt round-robin to
the workers, so the rows in flight stay close together and the output writer's buffer
stays small.

Workers are forked: a spawned worker re-imports torch (seconds per worker and per slide)
and re-runs the caller's main module, which breaks Snakemake scripts and notebooks. Forking
is safe here because workers never touch CUDA (pinning runs in the parent) and each opens
its own slide handle (OpenSlide handles must not cross a fork); the caller starts the
workers before it starts any thread of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from slidesnake.batch_ring import BatchRing
from slidesnake.slide import Slide
from slidesnake.tile_cells import plan_cells
from slidesnake.tile_readers import CompressedTiles, RegionReads
from slidesnake.tiling import TileGeometry


@dataclass(frozen=True)
class ReadPlan:
    """Where and how big tiles are at the level they are read from."""

    level: int
    downsample: float  # level-0 px per read-level px
    tile_px: int  # tile side at the read level

    @classmethod
    def from_geometry(cls, geometry: TileGeometry) -> ReadPlan:
        tile_px = max(1, round(geometry.size_level0 / geometry.read_downsample))
        return cls(geometry.read_level, geometry.read_downsample, tile_px)


def tile_reader(
    slide: Slide, plan: ReadPlan, coords: np.ndarray
) -> tuple[CompressedTiles | RegionReads, np.ndarray]:
    """The reader for these tiles and their positions in its units: read-level px where
    we decode the compressed tiles (every tile starts on a whole pixel of the level),
    level-0 px where OpenSlide reads regions."""
    tiled = slide.tiled_level(plan.level)
    d = int(plan.downsample)
    if tiled is not None and not (coords % d).any():
        return CompressedTiles(slide, plan.level, tiled, plan.tile_px), coords // d
    return RegionReads(slide, plan.level, plan.downsample, plan.tile_px), coords


class TileBatches(IterableDataset):
    """The tiles of one slide as uint8 batches; use `stream()` to read them.

    Iterating it (in a worker) yields tickets for the batches it filled in the shared
    BatchRing: (row indices in the tile table, lane, slot, compressed tiles decoded so far).
    """

    def __init__(
        self,
        slide_path: str | Path,
        slide_id: str,
        coords: np.ndarray,
        geometry: TileGeometry,
        batch_size: int,
        block: int = 4,
    ) -> None:
        self.slide_path = Path(slide_path)
        self.slide_id = slide_id
        self.coords = coords
        self.geometry = geometry
        self.plan = ReadPlan.from_geometry(geometry)
        self.batch_size = batch_size
        with self._open() as slide:
            grid = tile_reader(slide, self.plan, coords)[0].tile_grid
        step = round(geometry.stride_level0 / self.plan.downsample)
        grid_xy = coords // geometry.stride_level0
        self.cells = plan_cells(grid_xy, step, self.plan.tile_px, grid, block)
        self.ring: BatchRing | None = None

    @property
    def batch_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.plan.tile_px, self.plan.tile_px, 3)

    def _open(self) -> Slide:
        return Slide(self.slide_path, self.slide_id, self.geometry.slide_mpp)

    def stream(self, workers: int, prefetch: int) -> BatchStream:
        """Start `workers` loader processes (0: read in this process), `prefetch` batches
        ahead each. Call it before this process starts any thread: the workers fork now."""
        self.ring = BatchRing(workers, prefetch + 1, self.batch_shape)
        return BatchStream(self, workers, prefetch)

    def __iter__(self) -> Iterator[tuple[np.ndarray, int, int, int]]:
        info = get_worker_info()
        lane = info.id if info else 0
        mine = self.cells[lane :: info.num_workers] if info else self.cells
        rows = np.empty(self.batch_size, np.int64)
        filled, slot = 0, None
        with self._open() as slide:
            reader, positions = tile_reader(slide, self.plan, self.coords)
            for cell in mine:
                tiles = reader.open_cell(positions[cell])
                for i, row in enumerate(cell):
                    if slot is None:
                        slot = self.ring.claim(lane)
                    tiles.copy_tile(i, self.ring.tiles[lane, slot, filled])
                    rows[filled] = row
                    filled += 1
                    if filled == self.batch_size:
                        yield rows.copy(), lane, slot, reader.decoded
                        filled, slot = 0, None
            if filled:
                yield rows[:filled].copy(), lane, slot, reader.decoded


class BatchStream:
    """(rows, tiles) batches: tiles (B, h, w, 3) uint8 in shared memory, valid until the
    next batch is asked for (its slot is then handed back to its worker)."""

    def __init__(self, dataset: TileBatches, workers: int, prefetch: int):
        self.ring = dataset.ring
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            prefetch_factor=prefetch if workers else None,
            persistent_workers=False,
            multiprocessing_context="fork" if workers else None,
        )
        self._tickets = iter(loader)  # forks the workers
        self._held: int | None = None
        self._decoded: dict[int, int] = {}

    @property
    def decoded(self) -> int:
        """Compressed slide tiles decoded so far by all workers (0 where OpenSlide reads)."""
        return sum(self._decoded.values())

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._held is not None:
            self.ring.release(self._held)
            self._held = None
        rows, lane, slot, decoded = next(self._tickets)
        self._held, self._decoded[lane] = lane, decoded
        return torch.as_tensor(rows), self.ring.view(lane, slot, len(rows))
