"""The loader: cells cut along the slide's tile grid, each compressed tile decoded once,
every delivered tile equal to OpenSlide's pixels, batch buffers reused safely."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openslide
import pytest
from conftest import corrupted_copy

from slidesnake.errors import LoaderWorkerError, SlideReadError
from slidesnake.loader.batch_ring import ORPHAN_CHECK_S, BatchRing
from slidesnake.loader.batches import ReadPlan, TileBatches, tile_reader
from slidesnake.loader.cells import CELL_MAX_PX, plan_cells
from slidesnake.loader.readers import RegionReads
from slidesnake.loader.workers import LoaderWorkers
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import random_blobs, write_slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
from slidesnake.tiling.tissue import TissueParams


def tiled(slide: Path, out: Path, params: TileParams | None = None) -> Path:
    """The tile table of `slide` (masking and tiling as the workflow does them)."""
    out.mkdir(parents=True, exist_ok=True)
    make_tissue_mask(slide, "s", out / "mask.png", out / "qc.png", TissueParams())
    make_tile_coords(
        slide, "s", out / "mask.png", out / "qc.png", out / "tiles.parquet",
        out / "qc_tiles.png", params or TileParams(),
    )  # fmt: skip
    return out / "tiles.parquet"


@pytest.fixture(scope="module")
def slide_240(tmp_path_factory) -> Path:
    """20x, 240 px JPEG tiles (as many Aperio scanners write): 224 px tiles line up every 15."""
    path = tmp_path_factory.mktemp("slides") / "tiles240.svs"
    shapes = random_blobs(7000, 5000, count=5, seed=11)
    return write_slide(path, 7000, 5000, shapes, mpp=0.5, levels=2, tile=240, seed=11)


@pytest.fixture(scope="module")
def slide_40x(tmp_path_factory) -> Path:
    """40x, 256 px JPEG tiles: 0.5 µm/px tiles are 448 px at level 0."""
    path = tmp_path_factory.mktemp("slides") / "forty.svs"
    shapes = random_blobs(8000, 6000, count=12, seed=3)
    return write_slide(path, 8000, 6000, shapes, mpp=0.25, levels=3, seed=3)


def compressed_tiles_of(cell_xy: np.ndarray, step: int, px: int, tile: int) -> set:
    return {
        (r, c)
        for x, y in cell_xy * step
        for r in range(y // tile, (y + px - 1) // tile + 1)
        for c in range(x // tile, (x + px - 1) // tile + 1)
    }


@pytest.mark.parametrize(
    ("step", "px", "tile"), [(448, 448, 256), (224, 224, 240), (448, 448, 240), (224, 224, 512)]
)
def test_cells_share_no_compressed_tile_where_the_grids_line_up(step, px, tile):
    grid = np.stack(np.meshgrid(np.arange(60), np.arange(45)), -1).reshape(-1, 2)
    cells = plan_cells(grid, step, px, (tile, tile), block=4)
    assert sorted(np.concatenate(cells)) == list(range(len(grid)))
    seen: set = set()
    for cell in cells:
        mine = compressed_tiles_of(grid[cell], step, px, tile)
        assert not mine & seen, "a compressed tile in two cells would be decoded twice"
        seen |= mine
    assert len(cells) > 4  # and the slide is still split into units of work


def test_cells_are_cut_at_a_maximum_where_the_grids_never_line_up():
    grid = np.stack(np.meshgrid(np.arange(200), np.arange(3)), -1).reshape(-1, 2)
    cells = plan_cells(grid, 112, 224, (256, 256), block=4)  # overlapping tiles
    widths = [np.ptp(grid[cell, 0]) + 1 for cell in cells]
    assert max(widths) * 112 <= CELL_MAX_PX and len(cells) > 1


def test_cells_keep_row_major_order_inside():
    grid = np.stack(np.meshgrid(np.arange(10), np.arange(10)), -1).reshape(-1, 2)
    for cell in plan_cells(grid, 448, 448, (256, 256), block=4):
        assert list(cell) == sorted(cell)  # table rows are row-major, so rows ascend


def delivered(tiles_path: Path, slide: Path, workers: int, batch: int):
    """Every tile the loader delivers, by table row, and the decode count."""
    tiles, geometry = read_tiles(tiles_path)
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    dataset = TileBatches(slide, "s", coords, geometry, batch, block=3)
    got: dict[int, np.ndarray] = {}
    stream = dataset.stream(workers, prefetch=2)
    for rows, pixels in stream:
        for row, tile in zip(rows.tolist(), pixels, strict=True):
            assert row not in got
            got[row] = tile.copy()
    return coords, geometry, got, stream.reads()["compressed_tiles_decoded"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("slide", ["slide_40x", "slide_240"])
def test_every_tile_is_openslides_pixels_and_each_compressed_tile_decoded_once(
    request, tmp_path, slide, workers
):
    path = request.getfixturevalue(slide)
    coords, geometry, got, decoded = delivered(tiled(path, tmp_path), path, workers, batch=7)
    plan = ReadPlan.from_geometry(geometry)
    assert sorted(got) == list(range(len(coords))) and len(coords) > 50
    with openslide.OpenSlide(str(path)) as osr:
        for row in range(0, len(coords), 5):
            x, y = coords[row]
            rgba = osr.read_region((int(x), int(y)), plan.level, (plan.tile_px, plan.tile_px))
            np.testing.assert_array_equal(got[row], np.asarray(rgba)[..., :3])
    with Slide(path) as s:
        reader, at = tile_reader(s, plan, coords)
        assert decoded == len(reader.needed(at))


def test_tiles_at_a_level_above_0_come_from_its_compressed_tiles(tmp_path, slide_40x):
    coords, geometry, got, decoded = delivered(
        tiled(slide_40x, tmp_path, TileParams(mpp=1.0)), slide_40x, workers=0, batch=16
    )
    assert (geometry.read_level, ReadPlan.from_geometry(geometry).tile_px) == (1, 224)
    assert decoded > 0
    with Slide(slide_40x) as s:
        for row in (0, len(coords) // 2, len(coords) - 1):
            np.testing.assert_array_equal(got[row], s.read(1, *map(int, coords[row]), 224, 224))


def test_skipped_compressed_tiles_are_white_background(slide_40x):
    with Slide(slide_40x) as s:
        level = s.tiled_level(0)
        out = np.zeros((300, 300, 3), np.uint8)
        # The tile at (0, 1) is missing, as in scans that skip empty background.
        cut = level.cut(200, 0, 300, 300)
        cut.paint(out, lambda r, c: None if (r, c) == (0, 1) else level.decode(r, c))
        assert (out[:256, 56:] == 255).all()
        np.testing.assert_array_equal(out[:, :56], s.read(0, 200, 0, 56, 300))
        np.testing.assert_array_equal(out[256:, 56:], s.read(0, 256, 256, 244, 44))


@pytest.mark.parametrize("slide", ["slide_40x", "slide_240"])
def test_decoded_rows_start_off_the_boundaries_that_make_libjpeg_bypass_the_cache(request, slide):
    with Slide(request.getfixturevalue(slide)) as s:
        level = s.tiled_level(0)
        tile = level.decode(1, 1)
        rows = tile.ctypes.data + tile.strides[0] * np.arange(level.tile_height)
        assert not (rows % 16 == 0).any()
        x, y = level.tile_width, level.tile_height
        np.testing.assert_array_equal(tile, s.read(0, x, y, x, y))


def test_tiles_not_on_whole_pixels_of_their_level_are_read_through_openslide(tmp_path, slide_40x):
    # 1.1 µm/px tiles come from level 1 (4x) and are 986 level-0 px apart: not on a pixel.
    tiles_path = tiled(slide_40x, tmp_path, TileParams(mpp=1.1))
    coords, geometry, got, decoded = delivered(tiles_path, slide_40x, workers=0, batch=8)
    plan = ReadPlan.from_geometry(geometry)
    assert sorted(got) == list(range(len(coords))) and decoded == 0
    with Slide(slide_40x) as s:
        reader, at = tile_reader(s, plan, coords)
        assert isinstance(reader, RegionReads)
        for row in (0, len(coords) // 2):
            out = np.empty((plan.tile_px, plan.tile_px, 3), np.uint8)
            reader.open_cell(at[[row]]).copy_tile(0, out)
            x, y = map(int, coords[row])
            np.testing.assert_array_equal(out, s.read(1, x, y, plan.tile_px, plan.tile_px))


def test_a_slot_is_refilled_only_after_the_main_process_released_it():
    ring = BatchRing(workers=0, slots=2, batch_shape=(4, 8, 8, 3))
    assert [ring.claim(0), ring.claim(0)] == [0, 1]
    with pytest.raises(RuntimeError, match="in use"):
        ring.claim(0)  # both slots are held: a third batch would overwrite one
    ring.release(0)
    assert ring.claim(0) == 0


def test_a_batch_stays_intact_while_the_workers_read_ahead(tmp_path, slide_40x):
    tiles, geometry = read_tiles(tiled(slide_40x, tmp_path))
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    dataset = TileBatches(slide_40x, "s", coords, geometry, batch_size=4)
    stream = dataset.stream(workers=2, prefetch=1)  # two slots per worker
    rows, held = next(stream)
    before = held.copy()
    time.sleep(1.0)  # the workers fill whatever they may meanwhile
    assert (held == before).all()
    count = len(rows) + sum(len(r) for r, _ in stream)
    assert count == len(coords)


def loader_processes() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("slidesnake-loader")]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_compressed_tile_fails_the_slide_by_name_and_stops_the_workers(
    tmp_path, slide_40x, workers
):
    tiles_path = tiled(slide_40x, tmp_path)
    coords = read_tiles(tiles_path)[0][["x", "y"]].to_numpy()
    broken = corrupted_copy(slide_40x, tmp_path, *coords[len(coords) // 2])
    with pytest.raises(SlideReadError, match=r"slide 's' .* could not be decoded .* Fix:"):
        delivered(tiles_path, broken, workers, batch=7)
    assert loader_processes() == []


def test_a_worker_killed_midway_is_reported_and_the_others_stopped(tmp_path, slide_40x):
    tiles, geometry = read_tiles(tiled(slide_40x, tmp_path))
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    dataset = TileBatches(slide_40x, "s", coords, geometry, batch_size=4)
    stream = dataset.stream(workers=2, prefetch=1)  # each worker stays within 8 tiles ahead
    next(stream)
    victim = next(p for p in loader_processes() if p.name.endswith("-1"))
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(LoaderWorkerError, match=r"loader worker 1 was killed by SIGKILL .* Fix:"):
        for _ in stream:
            pass
    assert loader_processes() == []


def first_then_a_bug(lane: int, lanes: int):
    yield "first"
    raise ValueError("a bug, not the slide")


def test_an_unexpected_worker_error_arrives_with_the_workers_traceback():
    workers = LoaderWorkers(first_then_a_bug, 1)
    try:
        assert workers.receive(0) == "first"
        with pytest.raises(LoaderWorkerError, match=r"(?s)worker 0 failed.*ValueError: a bug"):
            workers.receive(0)
    finally:
        workers.close()


def test_closing_a_stream_early_stops_its_workers(tmp_path, slide_40x):
    tiles, geometry = read_tiles(tiled(slide_40x, tmp_path))
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    with TileBatches(slide_40x, "s", coords, geometry, batch_size=4).stream(2, 1) as stream:
        next(stream)
        assert len(loader_processes()) == 2
    assert loader_processes() == []


ORPHAN = """
import multiprocessing, os, sys
import numpy as np
from slidesnake.loader.batches import TileBatches
from slidesnake.tiling.tile_table import read_tiles
tiles, geometry = read_tiles(sys.argv[2])
coords = tiles[["x", "y"]].to_numpy(np.int64)
stream = TileBatches(sys.argv[1], "s", coords, geometry, 4).stream(2, 1)
next(stream)
print(*(p.pid for p in multiprocessing.active_children()), flush=True)
os.kill(os.getpid(), 9)
"""


def test_workers_of_a_killed_job_exit_by_themselves(tmp_path, slide_40x):
    tiles_path = tiled(slide_40x, tmp_path)
    with (tmp_path / "pids").open("w") as out:  # a pipe would stay open while they live
        job = subprocess.run(
            [sys.executable, "-c", ORPHAN, str(slide_40x), str(tiles_path)], stdout=out
        )
    assert job.returncode == -signal.SIGKILL
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10 * ORPHAN_CHECK_S
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in pids)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
