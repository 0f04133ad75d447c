"""What every embedding job records, whatever its backend: which slide and tiles its
store holds (zarr attributes), and its peak memory (metrics.json). No torch here: a
remote-backend job imports none."""

from __future__ import annotations

import resource
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

from slidesnake.slides import stores
from slidesnake.slides.locator import SlideKind, shown, slide_kind, stat_slide
from slidesnake.tiling.grid import TileGeometry


def slide_attributes(
    slide_path, slide_id: str, geometry: TileGeometry, pinned: stores.SlideStat | None = None
) -> dict[str, Any]:
    """The zarr attributes that say which slide and which tiles, whatever the backend.
    `pinned`: the version the reads were pinned to (a slide read in place), which is the
    version the store holds, whatever it holds now."""
    if slide_kind(slide_path) is not SlideKind.FILE:  # a store, a DICOM series
        stat = pinned or stat_slide(slide_path, slide_id)
        where = {"slide_path": str(shown(slide_path)), "slide_version": stat.version}
        size, mtime = stat.size, None
    else:
        status = Path(slide_path).stat()
        where = {"slide_path": str(Path(slide_path).resolve())}
        size, mtime = status.st_size, status.st_mtime
    return {
        "slide_id": slide_id,
        **where,
        "slide_bytes": size,
        "slide_mtime": mtime,
        **{f"tile_{k}": v for k, v in asdict(geometry).items()},
        "patch_size_level0": geometry.size_level0,
        "target_mpp": geometry.target_mpp,
        "slidesnake_version": version("slidesnake"),
    }


def read_counts(timings: dict[str, Any]) -> dict[str, int]:
    """What the loader read, as metrics.json says it: compressed tiles decoded, and the
    bytes and requests that brought them (and, for a slide in a store, its index)."""
    return {key: timings[key] for key in ("compressed_tiles_decoded", "bytes_read", "requests")}


def loop_rates(tiles: int, timings: dict[str, float]) -> dict[str, float]:
    """The loop's figures in every metrics.json: tiles, its wall time, tiles/s (tiles ÷
    that wall clock) and how long, and what share of it, it waited for the loader."""
    wall, waited = timings["wall_s"], timings["loader_wait_s"]
    return {
        "tiles": tiles,
        "wall_s": round(wall, 3),
        "tiles_per_s": round(tiles / wall, 2) if wall > 0 else 0.0,
        "loader_wait_s": round(waited, 3),
        "loader_wait_fraction": round(waited / wall, 4) if wall > 0 else 0.0,
    }


def model_time(model_s: float, tiles: int, job_s: float) -> dict[str, float]:
    """A model's own seconds in the job and its rate, and the share of the whole job
    (process start to last byte) its device spent in it: on a GPU, by CUDA events, the
    GPU's duty, which start-up and loader waits lower."""
    return {
        "model_s": round(model_s, 3),
        "model_tiles_per_s": round(tiles / model_s, 2) if model_s > 0 else 0.0,
        "model_busy_fraction": round(model_s / job_s, 4) if job_s > 0 else 0.0,
    }


def peak_memory_mb() -> dict[str, float]:
    """Peak resident memory of this process and of its largest loader worker."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"peak_host_mb": round(self_kb / 1024, 1), "peak_worker_mb": round(workers_kb / 1024, 1)}
