"""`slidesnake bench`: where the time of an embedding job goes, measured in one run.

On one slide, in this process: the limit (each compressed slide tile the tiles need,
decoded once, nothing else), our loader with 1..N worker processes, the per-tile
`read_region` + PIL resize loader that CLAM and TRIDENT use (the baseline), the model
alone (device-side preprocessing included) and the whole embedding job; then the ratios.
The machine is shared and noisy, so the limit and the loader, and then the model and the
whole job, are measured in alternating rounds: tiles/s are the best round's, ratios the
median of the ratios within a round. Then peak memory of whole jobs on a small and a large
slide, each in its own process, since peak RSS only ever grows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import openslide
import torch
from PIL import Image

from slidesnake.embed.job import ONE_MODEL, embed_slide
from slidesnake.embed.model_outputs import ModelOutputs
from slidesnake.embed.settings import EmbedSettings
from slidesnake.loader.batches import ReadPlan, TileBatches, planned_reader
from slidesnake.loader.readers import CompressedTiles
from slidesnake.models.embedder import build_embedder
from slidesnake.models.registry import model_spec
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import BENCH_SLIDES, Rect, random_blobs, write_slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles, write_tiles
from slidesnake.tiling.tissue import TissueParams


@dataclass(frozen=True)
class BenchOptions:
    workers: tuple[int, ...] = (1, 2)
    repeats: int = 3  # rounds of limit + loaders, then of model + whole job
    max_tiles: int | None = None  # only the first N tiles of the slide
    baseline_tiles: int = 400  # the per-tile baseline runs on the first N tiles
    end_to_end_s: float = 20.0  # the whole job runs on as many tiles as the model does in this
    memory: bool = True


@dataclass(frozen=True)
class TiledSlide:
    """A slide with its tile table, ready to embed."""

    path: Path
    tiles: Path

    def coords(self) -> tuple[np.ndarray, Any]:
        tiles, geometry = read_tiles(self.tiles)
        return tiles[["x", "y"]].to_numpy(np.int64), geometry


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


def embed_job(slide: TiledSlide, out: Path, *options: str) -> dict[str, Any]:
    """`slidesnake embed` on `slide` in a fresh process, as Snakemake runs a job: its
    metrics.json, plus `process_s`, the whole process timed from outside."""
    command = [sys.executable, "-m", "slidesnake", "embed", str(slide.path), str(slide.tiles),
               str(out), *options]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    metrics["process_s"] = time.perf_counter() - started
    return metrics


def limit_tiles(slide: TiledSlide, count: int | None) -> TiledSlide:
    """The first `count` tiles (row-major: a band of the slide), for a quicker run."""
    tiles, geometry = read_tiles(slide.tiles)
    if count is None or count >= len(tiles):
        return slide
    path = slide.tiles.with_name(f"tiles-first-{count}.parquet")
    write_tiles(tiles.iloc[:count].reset_index(drop=True), geometry, path)
    return replace(slide, tiles=path)


def describe(slide: TiledSlide, decode: str = "exact") -> dict[str, Any]:
    """What the tiles cost to read: level, size, codec, compressed tiles per tile."""
    coords, geometry = slide.coords()
    with Slide(slide.path, slide.path.stem, geometry.slide_mpp) as opened:
        plan, reader, at = planned_reader(opened, ReadPlan.from_geometry(geometry, decode), coords)
        compressed = isinstance(reader, CompressedTiles)
        codec = reader.tiled.codec if compressed else f"read by OpenSlide ({opened.vendor})"
        needed = len(reader.needed(at)) if compressed else None
    return {
        "slide": str(slide.path), "tiles": len(coords), "tile_size": geometry.size,
        "target_mpp": geometry.target_mpp, "slide_mpp": geometry.slide_mpp,
        "read_level": plan.level, "read_px": plan.tile_px, "codec": codec,
        "decode": decode, "decode_shrink": plan.shrink,
        "compressed_tile": reader.tile_grid, "compressed_tiles_needed": needed,
    }  # fmt: skip


def decode_only(slide: TiledSlide, decode: str = "exact") -> float | None:
    """Tiles/s if each compressed tile the tiles overlap is decoded once, in file order,
    and nothing else is done (one process); None where OpenSlide reads the slide."""
    coords, geometry = slide.coords()
    with Slide(slide.path, slide.path.stem, geometry.slide_mpp) as opened:
        _, reader, at = planned_reader(opened, ReadPlan.from_geometry(geometry, decode), coords)
        if not isinstance(reader, CompressedTiles):
            return None
        needed = sorted(reader.needed(at))
        started = time.perf_counter()
        for row, col in needed:
            reader.tiled.decode(row, col)
        return len(coords) / (time.perf_counter() - started)


def per_tile_baseline(slide: TiledSlide) -> float:
    """Tiles/s of one read_region per tile, PIL resize, tensor: the CLAM/TRIDENT pattern."""
    coords, geometry = slide.coords()
    plan = ReadPlan.from_geometry(geometry)
    started = time.perf_counter()
    with openslide.OpenSlide(str(slide.path)) as osr:
        for x, y in coords:
            region = osr.read_region((int(x), int(y)), plan.level, (plan.tile_px, plan.tile_px))
            rgb = region.convert("RGB").resize((geometry.size, geometry.size), Image.BILINEAR)
            torch.from_numpy(np.array(rgb)).permute(2, 0, 1)
    return len(coords) / (time.perf_counter() - started)


def loader_only(slide: TiledSlide, settings: EmbedSettings) -> float:
    """Tiles/s our loader delivers with nothing consuming them, from planning the cells and
    forking the workers to the last batch."""
    coords, geometry = slide.coords()
    started = time.perf_counter()
    dataset = TileBatches(
        slide.path, slide.path.stem, coords, geometry, settings.batch_size, settings.block,
        settings.decode,
    )  # fmt: skip
    with dataset.stream(settings.workers, settings.prefetch) as batches:
        delivered = sum(len(rows) for rows, _ in batches)
    return delivered / (time.perf_counter() - started)


def model_only(slide: TiledSlide, settings: EmbedSettings, seconds: float = 5.0) -> float:
    """Tiles/s of preprocessing + forward pass on tiles already in memory, over at least
    `seconds` (a few batches alone vary by ±15% on a shared machine)."""
    _, geometry = slide.coords()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = model_spec(settings.model, settings.mean, settings.std)
    embedder = build_embedder(
        spec, settings.weights, settings.checkpoint, geometry.size, device, settings.precision
    )
    px = ReadPlan.from_geometry(geometry).tile_px
    batch = torch.randint(0, 256, (settings.batch_size, px, px, 3), dtype=torch.uint8)
    embedder(batch)  # warm-up
    _synchronize(device)
    started, done = time.perf_counter(), 0
    while done < 2 or time.perf_counter() - started < seconds:
        embedder(batch)
        done += 1
        if done % 4 == 0:
            _synchronize(device)
    _synchronize(device)
    return done * settings.batch_size / (time.perf_counter() - started)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def end_to_end(slide: TiledSlide, settings: EmbedSettings, out: Path) -> dict[str, Any]:
    """metrics.json of a whole embedding job."""
    outputs = {ONE_MODEL: ModelOutputs(out / "embeddings.zarr", out / "metrics.json")}
    return embed_slide(slide.path, slide.path.stem, slide.tiles, outputs, {ONE_MODEL: settings})[
        ONE_MODEL
    ]


def peak_memory(slide: TiledSlide, settings: EmbedSettings, out: Path) -> dict[str, Any]:
    """metrics.json of a whole embedding job run by `slidesnake embed` in a fresh process."""
    command = [
        sys.executable, "-m", "slidesnake", "embed", str(slide.path), str(slide.tiles), str(out),
        "--model", settings.model, "--weights", settings.weights,
        "--precision", settings.precision, "--batch-size", str(settings.batch_size),
        "--workers", str(settings.workers),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "metrics.json").read_text())


def run(
    slide: Path | None,
    sheet_mpp: float | None,
    synthetic: str,
    options: BenchOptions,
    settings: EmbedSettings,
    workdir: Path,
) -> dict[str, Any]:
    """Every measurement; prints the table and returns the figures."""
    slide = slide or synthetic_slide(workdir, *BENCH_SLIDES[synthetic], dense=True)
    tiled = limit_tiles(tile_slide(slide, workdir, sheet_mpp), options.max_tiles)
    results = describe(tiled, settings.decode)
    _progress("the per-tile baseline")
    results["per_tile_baseline"] = per_tile_baseline(limit_tiles(tiled, options.baseline_tiles))
    results.update(best_rounds(tiled, settings, options))
    results.update(model_and_job_rounds(tiled, settings, options, workdir))
    results["end_to_end_share"] = end_to_end_share(results)
    print_table(results, settings)
    if options.memory:
        results["peak_memory"] = memory_by_slide_size(settings, workdir)
    return results


def best_rounds(
    slide: TiledSlide, settings: EmbedSettings, options: BenchOptions
) -> dict[str, Any]:
    """The decode-only limit and the loader with each worker count in rounds: tiles/s of
    the best round, and each worker's share of the limit as the median of its ratio
    within a round (measured a few seconds apart, the two share the machine's mood)."""
    rounds = []
    for round_ in range(options.repeats):
        _progress(f"decode-only limit and loader, round {round_ + 1} of {options.repeats}")
        rates = {"decode_only": decode_only(slide, settings.decode)}
        for count in options.workers:
            rates[f"loader_{count}_workers"] = loader_only(slide, replace(settings, workers=count))
        if settings.decode != "exact":  # today's way, in the same rounds, for the ratio
            exact = replace(settings, workers=1, decode="exact")
            rates["exact_loader_1_worker"] = loader_only(slide, exact)
        rounds.append(rates)
    results: dict[str, Any] = {key: _best(r[key] for r in rounds) for key in rounds[0]}
    if results["decode_only"]:
        results["share_of_limit"] = {
            count: median(r[f"loader_{count}_workers"] / count / r["decode_only"] for r in rounds)
            for count in options.workers
        }
    return results | {"limit_and_loader_rounds": rounds}


def model_and_job_rounds(
    slide: TiledSlide, settings: EmbedSettings, options: BenchOptions, workdir: Path
) -> dict[str, Any]:
    """Model-only and the whole job (with the most workers, on the tiles the model does in
    `end_to_end_s`) in alternating rounds: the best of each, and the job's share of the
    model's speed as the median of its ratio within a round."""
    rounds, job, tiles = [], None, None
    workers = max(options.workers)
    for round_ in range(options.repeats):
        _progress(f"the model ({settings.model}), round {round_ + 1} of {options.repeats}")
        model = model_only(slide, settings)
        tiles = tiles or max(4 * settings.batch_size, round(model * options.end_to_end_s))
        _progress(f"the whole job on up to {tiles} tiles, {workers} workers")
        metrics = end_to_end(
            limit_tiles(slide, tiles), replace(settings, workers=workers), workdir / "end-to-end"
        )
        if job is None or metrics["tiles_per_s"] > job["tiles_per_s"]:
            job = metrics
        rounds.append({"model_only": model, "end_to_end": metrics["tiles_per_s"]})
    return {
        "model_only": max(r["model_only"] for r in rounds),
        "end_to_end": job,
        "model_and_job_rounds": rounds,
    }


def end_to_end_share(results: dict[str, Any]) -> float:
    """The whole job's tiles/s over min(loader, model), the median over the rounds."""
    workers = results["end_to_end"]["loader_workers"]
    loader = results[f"loader_{workers}_workers"]
    return median(
        r["end_to_end"] / min(r["model_only"], loader) for r in results["model_and_job_rounds"]
    )


def _best(rates: Iterable[float | None]) -> float | None:
    rates = list(rates)
    return None if None in rates else max(rates)


def _progress(what: str) -> None:
    print(f"measuring {what} ...", file=sys.stderr, flush=True)


def print_table(results: dict[str, Any], settings: EmbedSettings) -> None:
    r = results
    tile = r["compressed_tile"]
    reading = (
        f"{r['codec']} tiles of {tile[0]} px, {r['compressed_tiles_needed'] / r['tiles']:.2f} "
        "per tile" if tile else r["codec"]
    )  # fmt: skip
    print(
        f"{Path(r['slide']).name}: {r['tiles']} tiles of {r['tile_size']} px at "
        f"{r['target_mpp']:g} µm/px from a {r['slide_mpp']:.3g} µm/px slide, read at level "
        f"{r['read_level']} as {r['read_px']} px ({reading}; decode {r['decode']}, "
        f"at 1/{r['decode_shrink']} size)"
    )
    print(f"  {'':<58} {'tiles/s':>9} {'x baseline':>11} {'of limit':>9}")
    limit, baseline = r["decode_only"], r["per_tile_baseline"]
    _row("decode-only limit: each compressed tile once, 1 process", limit, baseline, None)
    _row("per-tile read_region + PIL resize (baseline)", baseline, baseline, None)
    packs = " (packs: the device decodes)" if settings.decode == "gpu" else ""
    for count in sorted({int(k.split("_")[1]) for k in r if k.startswith("loader_")}):
        share = r["share_of_limit"][count] if limit else None
        _row(f"our loader, {count} worker{'s' * (count > 1)}{packs}", r[f"loader_{count}_workers"],
             baseline, share)  # fmt: skip
    if "exact_loader_1_worker" in r and "loader_1_workers" in r:
        exact = r["exact_loader_1_worker"]
        _row("our loader, 1 worker, exact decode (before)", exact, baseline, None)
        rounds = r["limit_and_loader_rounds"]
        gain = median(x["loader_1_workers"] / x["exact_loader_1_worker"] for x in rounds)
        what = f"{settings.decode} over exact decode, 1 worker (median of rounds)"
        print(f"  {what:<58} {gain:>8.2f}x")
    _row(f"model only ({settings.model}, {settings.precision})", r["model_only"], baseline, None)
    e2e = r["end_to_end"]
    _row(
        f"end to end, {e2e['tiles']} tiles, {e2e['loader_workers']} workers "
        f"(loader wait {100 * e2e['loader_wait_fraction']:.0f}%)",
        e2e["tiles_per_s"], baseline, None,
    )  # fmt: skip
    print(
        f"  tiles/s: the best of {len(r['limit_and_loader_rounds'])} rounds. Of limit: a "
        "worker's share of the decode-only limit; end to end is "
        f"{r['end_to_end_share']:.2f} of min(loader, model): medians of the ratios within a round."
    )


def _row(what: str, rate: float | None, baseline: float, of_limit: float | None) -> None:
    shown = f"{rate:9.1f} {rate / baseline:10.2f}x" if rate else f"{'n/a':>9} {'':>11}"
    print(f"  {what:<58} {shown} {'' if of_limit is None else f'{of_limit:9.2f}'}")


def memory_by_slide_size(settings: EmbedSettings, workdir: Path) -> list[dict[str, Any]]:
    """Peak memory of whole jobs on a biopsy and on a dense slide with 190x its tiles."""
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
