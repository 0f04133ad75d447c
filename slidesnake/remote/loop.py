"""The embedding loop of one slide against an inference server.

Loader worker processes decode tiles as in the local backend; the main thread hands each
batch to one of `remote.max_concurrency` request threads and writes finished features to
zarr. It takes the next batch from the loader only when a request slot is free, so the
loader runs at most its own prefetch ahead of the requests in flight, and memory stays
flat however slow the server is. The slide job holds no GPU: it is a CPU client.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

from slidesnake.atomic import atomic_output
from slidesnake.embed.progress import Progress
from slidesnake.embed.records import loop_rates, peak_memory_mb, read_counts, slide_attributes
from slidesnake.embed.settings import EmbedSettings, RemoteSettings
from slidesnake.embed.startup import process_started
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.loader.batches import BatchStream, TileBatches
from slidesnake.models.registry import ModelSpec, model_spec
from slidesnake.remote.client import InferenceClient
from slidesnake.remote.layout import InputLayout, choose_layout
from slidesnake.remote.protocol import ModelMetadata
from slidesnake.tiling.tile_table import read_tiles

log = logging.getLogger(__name__)


def embed_slide_remote(
    slide_path: str | Path,
    slide_id: str,
    tiles_path: str | Path,
    zarr_path: str | Path,
    metrics_path: str | Path,
    settings: EmbedSettings,
) -> dict[str, Any]:
    """Embed every tile of `tiles_path` on the server of `settings.remote`; write the same
    zarr store and metrics.json as the local backend. The server and its model are
    checked before any tile is read."""
    started = process_started()
    remote = settings.remote
    tiles, geometry = read_tiles(tiles_path)
    spec = model_spec(settings.model, settings.mean, settings.std)
    client = InferenceClient(remote, remote.server_for(slide_id))
    try:
        client.wait_ready()
        metadata = client.metadata()
        layout = choose_layout(metadata, spec, geometry.size, client.url)
        dim = layout.dim or probe_width(client, layout, spec)
        coords = tiles[["x", "y"]].to_numpy(np.int64)
        log.info(
            "slide '%s': %d tiles, model '%s' (%d-d) on %s, input %s, %d requests in "
            "flight of %d tiles, %d loader workers",
            slide_id, len(coords), metadata.name, dim, client.url, layout.input.describe(),
            remote.max_concurrency, remote.batch_size, settings.workers,
        )  # fmt: skip
        dataset = TileBatches(
            slide_path,
            slide_id,
            coords,
            geometry,
            remote.batch_size,
            settings.block,
            settings.decode,
        )
        stream = dataset.stream(settings.workers, settings.prefetch)
        with stream as batches, atomic_output(zarr_path) as tmp:
            writer = EmbeddingWriter(tmp, coords, dim, settings.output_dtype)
            timings = _run(client, layout, spec, batches, writer, settings, dim)
            timings["startup_s"] = timings.pop("first_batch_at") - started
            writer.finish(
                slide_attributes(slide_path, slide_id, geometry, dataset.slide_stat)
                | dataset.read_attributes
                | model_attributes(client, metadata, spec, dim, settings)
                | {"timings": timings}
            )
    finally:
        client.close()
    metrics = _metrics(len(coords), timings, client, metadata, settings)
    metrics["job_s"] = round(time.perf_counter() - started, 3)
    with atomic_output(metrics_path) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    log.info(
        "slide '%s': %d tiles in %.1f s, %.1f tiles/s; requests %d, latency p50 %.3f s, "
        "p99 %.3f s, retries %d; loader wait %.0f%%, whole job %.1f s",
        slide_id, len(coords), metrics["wall_s"], metrics["tiles_per_s"], metrics["requests"],
        metrics["latency_p50_s"], metrics["latency_p99_s"], metrics["retries"],
        100 * metrics["loader_wait_fraction"], metrics["job_s"],
    )  # fmt: skip
    return metrics


def probe_width(client: InferenceClient, layout: InputLayout, spec: ModelSpec) -> int:
    """The feature width, from one blank tile, when the server's metadata leaves it open."""
    blank = np.zeros((1, layout.size, layout.size, 3), np.uint8)
    features = send_tiles(client, layout, spec, blank, None)
    return int(features.shape[1])


def send_tiles(
    client: InferenceClient,
    layout: InputLayout,
    spec: ModelSpec,
    tiles: np.ndarray,
    width: int | None,
) -> np.ndarray:
    """One batch: preprocess (in the request thread: Pillow and numpy release the GIL) and infer;
    the answer is checked against the declared output and `width`."""
    array = layout.prepare(tiles, spec)
    return client.infer(layout.input.name, layout.input.datatype, array, layout.output, width)


def _run(
    client: InferenceClient,
    layout: InputLayout,
    spec: ModelSpec,
    batches: BatchStream,
    writer: EmbeddingWriter,
    settings: EmbedSettings,
    dim: int,
) -> dict[str, float]:
    """The hot loop: at most max_concurrency requests in flight, features to zarr as
    they come back (in any order: each batch carries its rows)."""
    slots = settings.remote.max_concurrency
    progress = Progress(writer.rows, settings.progress_s, settings.watchdog_s)
    pending: dict[Future, np.ndarray] = {}
    started = time.perf_counter()
    loader_wait = slot_wait = 0.0
    first_batch_at = None

    def collect(return_when: str) -> float:
        t0 = time.perf_counter()
        done, _ = wait(pending, return_when=return_when)
        for future in done:
            rows = pending.pop(future)
            writer.put(rows, future.result())  # the store casts to its dtype, and checks
            progress.advance(len(rows))
        return time.perf_counter() - t0

    pool = ThreadPoolExecutor(slots, thread_name_prefix="infer")
    try:
        with progress:
            while True:
                if len(pending) >= slots:
                    progress.state("waiting for the server")
                    slot_wait += collect(FIRST_COMPLETED)
                progress.state("waiting for the loader")
                t0 = time.perf_counter()
                item = next(batches, None)
                loader_wait += time.perf_counter() - t0
                if item is None:
                    break
                first_batch_at = first_batch_at or time.perf_counter()
                rows, tiles = item
                # Copied here: the ring slot is the loader's again at the next batch,
                # while this request may not have been prepared or sent yet.
                pending[pool.submit(send_tiles, client, layout, spec, tiles.copy(), dim)] = rows
            while pending:
                progress.state("waiting for the server")
                slot_wait += collect(FIRST_COMPLETED)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    ended = time.perf_counter()
    return {
        "wall_s": ended - started,
        "loader_wait_s": loader_wait,
        "server_wait_s": slot_wait,
        "first_batch_at": first_batch_at or ended,
        **batches.reads(),
    }


def server_metrics(
    client: InferenceClient, metadata: ModelMetadata, remote: RemoteSettings
) -> dict[str, Any]:
    """The server's part of a served model's metrics: where, requests, latencies."""
    latencies = np.asarray(client.latencies_s or [0.0])
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    return {
        "server_url": client.url,
        "server_model": metadata.name,
        "server_model_versions": list(metadata.versions),
        "requests": len(client.latencies_s),
        "retries": client.retries,
        "latency_p50_s": round(float(p50), 4),
        "latency_p90_s": round(float(p90), 4),
        "latency_p99_s": round(float(p99), 4),
        "latency_max_s": round(float(latencies.max()), 4),
        "max_concurrency": remote.max_concurrency,
    }


def model_attributes(
    client: InferenceClient, metadata: ModelMetadata, spec: ModelSpec, dim: int, settings
) -> dict[str, Any]:
    return {
        "backend": "remote",
        "model": spec.name,
        "model_output": spec.output,
        "embedding_dim": dim,
        "server_url": client.url,
        "server_model": metadata.name,
        "server_model_versions": list(metadata.versions),
        "server_io": metadata.describe(),
        "features_dtype": settings.output_dtype,
    }


def _metrics(
    tiles: int, timings: dict, client: InferenceClient, metadata: ModelMetadata, settings
) -> dict[str, Any]:
    return {
        **loop_rates(tiles, timings),
        "server_wait_s": round(timings["server_wait_s"], 3),
        "startup_s": round(timings["startup_s"], 3),
        **read_counts(timings),
        "backend": "remote",
        "model": settings.model,
        **server_metrics(client, metadata, settings.remote),
        "batch_size": settings.remote.batch_size,
        "loader_workers": settings.workers,
        **peak_memory_mb(),
    }
