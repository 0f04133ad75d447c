"""The CPU side of embedding: decode tiles in worker processes, hand over uint8 batches.

Tiles are read in blocks of adjacent tiles ("supertiles") with one read per block, so each
compressed slide tile is decoded about once instead of once per overlapping model tile.
Blocks are taken band by band in row-major order and dealt round-robin to the workers, so
the rows in flight stay close together and the output writer's buffer stays small.

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

from slidesnake.slide import Slide
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


def tile_blocks(coords: np.ndarray, geometry: TileGeometry, block: int) -> list[np.ndarray]:
    """Row indices of `coords` grouped into block x block cells of the grid, row-major."""
    if len(coords) == 0:
        return []
    cell = block * geometry.stride_level0
    keys = (coords[:, 1] // cell) * (coords[:, 0].max() // cell + 1) + coords[:, 0] // cell
    order = np.argsort(keys, kind="stable")
    bounds = np.flatnonzero(np.diff(keys[order])) + 1
    return np.split(order, bounds)


class TileBatches(IterableDataset):
    """Yields (row indices, uint8 tiles (B, h, w, 3)) batches; rows index the tile table."""

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
        self.blocks = tile_blocks(coords, geometry, block)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        mine = self.blocks[info.id :: info.num_workers] if info else self.blocks
        shared = info is not None
        rows, batch = self._new_batch(shared)
        filled = 0
        with Slide(self.slide_path, self.slide_id, self.geometry.slide_mpp) as slide:
            for block in mine:
                for row, tile in zip(block, self._read_block(slide, block), strict=True):
                    batch[filled], rows[filled] = torch.from_numpy(tile), int(row)
                    filled += 1
                    if filled == self.batch_size:
                        yield rows, batch
                        rows, batch = self._new_batch(shared)
                        filled = 0
        if filled:
            yield rows[:filled], batch[:filled]

    def _new_batch(self, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and tile buffers; in a worker, in shared memory, so that handing a batch
        to the main process copies nothing (a batch of 448 px tiles is ~20 MB)."""
        px = self.plan.tile_px
        rows = torch.empty(self.batch_size, dtype=torch.int64)
        tiles = torch.empty((self.batch_size, px, px, 3), dtype=torch.uint8)
        if shared:
            rows.share_memory_()
            tiles.share_memory_()
        return rows, tiles

    def _read_block(self, slide: Slide, block: np.ndarray) -> Iterator[np.ndarray]:
        """One read for the block's bounding box, cut into its tiles."""
        plan, xy = self.plan, self.coords[block]
        x0, y0 = xy.min(axis=0)
        span = xy.max(axis=0) - (x0, y0)
        width = round(span[0] / plan.downsample) + plan.tile_px
        height = round(span[1] / plan.downsample) + plan.tile_px
        pixels = slide.read(plan.level, int(x0), int(y0), width, height)
        for x, y in xy:
            left, top = round((x - x0) / plan.downsample), round((y - y0) / plan.downsample)
            yield pixels[top : top + plan.tile_px, left : left + plan.tile_px]


def make_loader(dataset: TileBatches, workers: int, prefetch: int, pin: bool) -> DataLoader:
    """A DataLoader over ready-made batches: `prefetch` batches queued per worker.

    Call iter() on it before starting threads: the workers fork then.
    """
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        pin_memory=pin,
        persistent_workers=False,
        multiprocessing_context="fork" if workers else None,
    )
