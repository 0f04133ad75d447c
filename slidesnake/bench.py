"""`slidesnake bench`: where the time of an embedding job goes, measured in one run.

On one slide, in this process: the per-tile `read_region` + PIL resize loader that CLAM and
TRIDENT use (the baseline), our supertile loader alone, the model alone (device-side
preprocessing included), and the whole embedding job. Then peak memory of whole jobs on a
small and a large slide, each in its own process, since peak RSS only ever grows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import openslide
import torch
from PIL import Image

from slidesnake.embed_settings import EmbedSettings
from slidesnake.embedder import build_embedder
from slidesnake.embedding import embed_slide
from slidesnake.models import model_spec
from slidesnake.stages import make_tile_coords, make_tissue_mask
from slidesnake.synthetic import Rect, random_blobs, write_slide
from slidesnake.tile_loader import ReadPlan, TileBatches
from slidesnake.tile_table import read_tiles, write_tiles
from slidesnake.tiling import TileParams
from slidesnake.tissue import TissueParams


@dataclass(frozen=True)
class TiledSlide:
    """A slide with its tile table, ready to embed."""

    path: Path
    tiles: Path

    @property
    def count(self) -> int:
        return len(read_tiles(self.tiles)[0])


def synthetic_slide(
    directory: Path, width: int, height: int, mpp: float = 0.25, dense: bool = False
) -> Path:
    """A cached synthetic H&E-like Aperio slide; `dense`: tissue over 80% of it."""
    path = directory / f"bench-{width}x{height}-{mpp:g}{'-dense' * dense}.svs"
    if not path.exists():
        shapes = random_blobs(width, height, count=8, seed=5)
        if dense:
            shapes = [Rect(width // 20, height // 20, width * 19 // 20, height * 19 // 20)]
        write_slide(path, width, height, shapes, mpp=mpp, levels=3, seed=5)
    return path


def tile_slide(slide: Path, directory: Path, sheet_mpp: float | None = None) -> TiledSlide:
    out = directory / slide.stem
    out.mkdir(parents=True, exist_ok=True)
    make_tissue_mask(slide, slide.stem, out / "mask.png", out / "qc.png", TissueParams(), sheet_mpp)
    make_tile_coords(
        slide, slide.stem, out / "mask.png", out / "qc.png", out / "tiles.parquet",
        out / "qc_tiles.png", TileParams(),
    )  # fmt: skip
    return TiledSlide(slide, out / "tiles.parquet")


def limit_tiles(slide: TiledSlide, count: int | None) -> TiledSlide:
    """The first `count` tiles (row-major: a band of the slide), for a quicker run."""
    tiles, geometry = read_tiles(slide.tiles)
    if count is None or count >= len(tiles):
        return slide
    path = slide.tiles.with_name(f"tiles-first-{count}.parquet")
    write_tiles(tiles.iloc[:count].reset_index(drop=True), geometry, path)
    return replace(slide, tiles=path)


def per_tile_baseline(slide: TiledSlide) -> float:
    """Tiles/s of one read_region per tile, PIL resize, tensor: the CLAM/TRIDENT pattern."""
    tiles, geometry = read_tiles(slide.tiles)
    plan = ReadPlan.from_geometry(geometry)
    started = time.perf_counter()
    with openslide.OpenSlide(str(slide.path)) as osr:
        for x, y in tiles[["x", "y"]].to_numpy():
            region = osr.read_region((int(x), int(y)), plan.level, (plan.tile_px, plan.tile_px))
            rgb = region.convert("RGB").resize((geometry.size, geometry.size), Image.BILINEAR)
            torch.from_numpy(np.asarray(rgb)).permute(2, 0, 1)
    return len(tiles) / (time.perf_counter() - started)


def loader_only(slide: TiledSlide, settings: EmbedSettings) -> float:
    """Tiles/s our loader delivers with nothing consuming them (worker start-up included)."""
    tiles, geometry = read_tiles(slide.tiles)
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    dataset = TileBatches(
        slide.path, slide.path.stem, coords, geometry, settings.batch_size, settings.block
    )
    started = time.perf_counter()
    delivered = sum(len(rows) for rows, _ in dataset.stream(settings.workers, 4))
    return delivered / (time.perf_counter() - started)


def model_only(slide: TiledSlide, settings: EmbedSettings, batches: int = 4) -> float:
    """Tiles/s of preprocessing + forward pass on tiles already in memory."""
    _, geometry = read_tiles(slide.tiles)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = model_spec(settings.model, settings.mean, settings.std)
    embedder = build_embedder(
        spec, settings.weights, settings.checkpoint, geometry.size, device, settings.precision
    )
    px = ReadPlan.from_geometry(geometry).tile_px
    batch = torch.randint(0, 256, (settings.batch_size, px, px, 3), dtype=torch.uint8)
    embedder(batch)  # warm-up
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(batches):
        embedder(batch)
    _synchronize(device)
    return batches * settings.batch_size / (time.perf_counter() - started)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def end_to_end(slide: TiledSlide, settings: EmbedSettings, out: Path) -> dict[str, Any]:
    """metrics.json of a whole embedding job."""
    return embed_slide(
        slide.path, slide.path.stem, slide.tiles, out / "embeddings.zarr", out / "metrics.json",
        settings,
    )  # fmt: skip


def peak_memory(slide: TiledSlide, settings: EmbedSettings, out: Path) -> dict[str, Any]:
    """metrics.json of a whole embedding job run by `slidesnake embed` in a fresh process."""
    command = [
        sys.executable, "-m", "slidesnake", "embed", str(slide.path), str(slide.tiles), str(out),
        "--model", settings.model, "--weights", settings.weights,
        "--precision", settings.precision, "--batch-size", str(settings.batch_size),
        "--workers", str(settings.workers),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return json.loads((out / "metrics.json").read_text())


def run(
    slide: Path | None,
    sheet_mpp: float | None,
    workers: list[int],
    max_tiles: int | None,
    settings: EmbedSettings,
    workdir: Path,
    memory: bool,
) -> dict[str, Any]:
    """Every measurement, printed as it comes; returns them all."""
    slide = slide or synthetic_slide(workdir, 20000, 15000)
    tiled = limit_tiles(tile_slide(slide, workdir, sheet_mpp), max_tiles)
    _, geometry = read_tiles(tiled.tiles)
    plan = ReadPlan.from_geometry(geometry)
    print(
        f"{slide.name}: {tiled.count} tiles of {geometry.size} px at {geometry.target_mpp} "
        f"µm/px from a {geometry.slide_mpp:.3g} µm/px slide: read at level {plan.level} as "
        f"{plan.tile_px} px, resized on the device"
    )
    results: dict[str, Any] = {"slide": str(slide), "tiles": tiled.count, "tile_px": plan.tile_px}
    baseline = results["per_tile_baseline"] = per_tile_baseline(tiled)
    _line("per-tile read_region + PIL resize (baseline)", baseline, baseline)
    for count in workers:
        rate = results[f"loader_{count}_workers"] = loader_only(
            tiled, replace(settings, workers=count)
        )
        _line(f"our loader, {count} worker{'s' * (count > 1)}", rate, baseline)
    rate = results["model_only"] = model_only(tiled, settings)
    _line(f"model only ({settings.model}, {settings.precision})", rate, baseline)
    metrics = end_to_end(tiled, replace(settings, workers=max(workers)), workdir / "end-to-end")
    results["end_to_end"] = metrics
    _line(
        f"end to end, {max(workers)} workers (loader wait "
        f"{100 * metrics['loader_wait_fraction']:.0f}%)", metrics["tiles_per_s"], baseline
    )  # fmt: skip
    if memory:
        results["peak_memory"] = memory_by_slide_size(settings, workdir)
    return results


def _line(what: str, tiles_per_s: float, baseline: float) -> None:
    print(f"  {what:<58} {tiles_per_s:8.1f} tiles/s {tiles_per_s / baseline:6.2f}x")


def memory_by_slide_size(settings: EmbedSettings, workdir: Path) -> list[dict[str, Any]]:
    """Peak memory of whole jobs on a biopsy and on a dense slide with 100x the tiles."""
    fast = replace(settings, model="timm:test_vit")
    print("peak memory of an embedding job (timm:test_vit, a fresh process per job):")
    rows = []
    for width, height, dense in ((3000, 2250, False), (24000, 18000, True)):
        tiled = tile_slide(synthetic_slide(workdir, width, height, 0.5, dense), workdir)
        metrics = peak_memory(tiled, fast, workdir / f"memory-{width}")
        rows.append({"slide": tiled.path.name, **metrics})
        print(
            f"  {tiled.path.name:<34} {metrics['tiles']:6d} tiles: main process "
            f"{metrics['peak_host_mb']:6.0f} MB, largest loader worker "
            f"{metrics['peak_worker_mb']:6.0f} MB"
        )
    return rows


def default_workdir() -> Path:
    return Path(tempfile.gettempdir()) / "slidesnake-bench"
