"""The embedding loop of one slide: loader workers -> device -> zarr, with its metrics.

Three things run at once: loader worker processes decode tiles; the main thread copies
each batch to the device and runs the model, whose results are copied back
asynchronously; a writer thread puts finished features into zarr. The main thread
records how long it waited for data, which answers "is the GPU the bottleneck?".
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidesnake.atomic import atomic_output
from slidesnake.embed.device_decode import DeviceDecoder
from slidesnake.embed.progress import Progress
from slidesnake.embed.records import (
    loop_rates,
    model_time,
    peak_memory_mb,
    read_counts,
    slide_attributes,
)
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.startup import process_started
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.loader.batches import BatchStream, TileBatches
from slidesnake.models.embedder import Embedder, build_embedder
from slidesnake.models.registry import model_input, model_spec
from slidesnake.tiling.tile_table import read_tiles

log = logging.getLogger(__name__)


def embed_slide(
    slide_path: str | Path,
    slide_id: str,
    tiles_path: str | Path,
    zarr_path: str | Path,
    metrics_path: str | Path,
    settings: EmbedSettings,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Embed every tile of `tiles_path`; write the zarr store and metrics.json.

    The loader workers fork first and decode while the model loads, so a job's fixed
    cost is the longer of the two, not their sum."""
    clock = {"process": process_started(), "entered": time.perf_counter()}
    device = device or slide_device()
    tiles, geometry = read_tiles(tiles_path)
    spec = model_spec(settings.model, settings.mean, settings.std)
    size, mpp = settings.input_size, settings.input_mpp
    wanted = model_input(spec, geometry.size, geometry.target_mpp, size, mpp)
    coords = tiles[["x", "y"]].to_numpy(np.int64)
    dataset = TileBatches(
        slide_path,
        slide_id,
        coords,
        geometry,
        settings.batch_size,
        settings.block,
        settings.decode,
    )
    clock["loader"] = time.perf_counter()
    with dataset.stream(settings.workers, settings.prefetch) as batches:  # forks: before threads
        embedder = build_embedder(
            spec, settings.weights, settings.checkpoint, wanted.size, device, settings.precision
        )
        embedder.crop = wanted.crop
        digest = embedder.weights_digest()  # a thread: after the fork
        clock["model_ready"] = time.perf_counter()
        _log_start(slide_id, len(coords), embedder, settings, device)
        with atomic_output(zarr_path) as tmp:
            writer = EmbeddingWriter(tmp, coords, embedder.dim, settings.output_dtype)
            run = ModelRun(embedder, writer, settings.output_dtype, timed=True)
            timings, failed = run_models([run], batches, dataset.batch_shape, settings, device)
            if failed:
                raise failed[0]
            model_s = run.model_s()
            startup = _startup(clock, timings, embedder)
            timings |= startup
            slide = slide_attributes(slide_path, slide_id, geometry, dataset.slide_stat)
            slide |= dataset.read_attributes
            attributes = _attributes(slide, embedder, settings, timings)
            attributes["weights_sha256"] = digest.value() if digest else None
            writer.finish(attributes)
    metrics = _metrics(len(coords), timings, startup, embedder, settings, device)
    metrics["job_s"] = round(time.perf_counter() - clock["process"], 3)
    metrics |= model_time(model_s, len(coords), metrics["job_s"])
    with atomic_output(metrics_path) as tmp:
        tmp.write_text(json.dumps(metrics, indent=2) + "\n")
    log.info(
        "slide '%s': %d tiles in %.1f s, %.1f tiles/s, loader wait %.0f%%; start-up %.1f s "
        "(imports %.1f, model %.1f), whole job %.1f s",
        slide_id,
        len(coords),
        metrics["wall_s"],
        metrics["tiles_per_s"],
        100 * metrics["loader_wait_fraction"],
        timings["startup_s"],
        timings["imports_s"],
        sum(embedder.load_s.values()),
        metrics["job_s"],
    )
    return metrics


def slide_device() -> torch.device:
    """The job's device: its GPU (the one it claimed) where there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _log_start(slide_id: str, tiles: int, embedder: Embedder, settings, device) -> None:
    log.info(
        "slide '%s': %d tiles, model %s (%d-d, %s) on %s (CUDA_VISIBLE_DEVICES=%s), "
        "%d loader workers, batch %d",
        slide_id,
        tiles,
        embedder.spec.name,
        embedder.dim,
        str(embedder.dtype).removeprefix("torch."),
        device,
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
        settings.workers,
        settings.batch_size,
    )


def _startup(clock: dict[str, float], timings: dict[str, float], embedder: Embedder) -> dict:
    """The fixed cost, process start to the first batch handed to the model, and its
    parts: imports (and the interpreter), the model (build, weights, to device, while
    the loader workers start) and the wait for the first batch after the model."""
    first_batch = timings.pop("first_batch_at")
    return {
        "startup_s": first_batch - clock["process"],
        "imports_s": clock["entered"] - clock["process"],
        "loader_start_s": clock["loader"] - clock["entered"],
        **embedder.load_s,
        "first_batch_after_model_s": first_batch - clock["model_ready"],
    }


@dataclass
class ModelRun:
    """One model of a job: its embedder, the store it streams into, and the time it took
    (on a GPU from events around its kernels, so that timing it never waits for it)."""

    embedder: Embedder
    writer: EmbeddingWriter
    output_dtype: str
    timed: bool = False  # its own time (model_s), for the models of one job
    seconds: float = 0.0
    _events: list = field(default_factory=list)
    _in_flight: tuple | None = None  # the previous batch, its copy to the host under way

    def feed(self, rows, pixels, tiles: torch.Tensor, shaped: dict | None, deliver) -> None:
        """Embed this batch (`tiles`, on the device) and deliver the previous batch's
        features, whose copy to the host has had this batch's kernels to finish."""
        copied = self.embed(tiles, shaped)
        self.flush(deliver)
        self._in_flight = (rows, copied)

    def flush(self, deliver) -> None:
        """Deliver the batch in flight, if any: `deliver(rows, features)`."""
        if self._in_flight is not None:
            rows, (features, done) = self._in_flight
            if done is not None:
                done.synchronize()
            deliver(rows, features.numpy())
            self._in_flight = None

    def embed(self, tiles: torch.Tensor, shaped: dict | None = None) -> tuple:
        """The batch's features, their copy to the host started. With `shaped` (by input
        key, for the models of one job), a crop and resize another model made of this
        batch is used, and one made here is kept for the others."""
        if not self.timed:
            return self._embed(tiles, shaped)
        if tiles.device.type != "cuda":
            started = time.perf_counter()
            copied = self._embed(tiles, shaped)
            self.seconds += time.perf_counter() - started
            return copied
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record()
        copied = self._embed(tiles, shaped)
        events[1].record()
        self._events.append(events)
        return copied

    def _embed(self, tiles: torch.Tensor, shaped: dict | None) -> tuple:
        if shaped is None:
            features = self.embedder(tiles)
        else:
            key = self.embedder.input_key
            if key not in shaped:
                shaped[key] = self.embedder.shape(tiles)
            features = self.embedder(tiles, shaped[key])
        return _to_host(features.to(_HOST_DTYPES[self.output_dtype]))

    def model_s(self) -> float:
        """Seconds of model time so far (call after the loop: it waits for the GPU)."""
        return self.seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000


def run_models(
    runs: list,
    batches: BatchStream,
    batch_shape: tuple[int, ...],
    settings: EmbedSettings,
    device: torch.device,
) -> tuple[dict[str, float], dict[int, Exception]]:
    """The hot loop, from the models ready to the last feature handed to the writers: each
    batch goes to the device once and to every model (a `ModelRun` here, or a served
    model's run, which takes the batch's uint8 `pixels`).

    A model that fails (its forward pass, its server, the check of its features) drops
    out and the others go on; the loop ends early when none is left. Returns the loop's
    timings (its wall time, the time it waited for data, when the first batch reached
    the models, how many compressed slide tiles the workers decoded) and the errors of
    the models that failed, by index. An error of the loader ends the loop: it raises."""
    decoder = (
        DeviceDecoder(device, batch_shape[1], batches.device_probe) if batches.packed else None
    )
    started = time.perf_counter()
    cuda = device.type == "cuda" and decoder is None
    staging = _PinnedStaging(device, batch_shape) if cuda else None
    progress = Progress(runs[0].writer.rows, settings.progress_s, settings.watchdog_s)
    results: queue.Queue = queue.Queue(maxsize=8 * len(runs))
    failed: dict[int, Exception] = {}  # written by this thread and the writer's
    drain = _Drain(results, [run.writer for run in runs], failed)
    drain.start()
    waited, first_batch_at = 0.0, None
    delivers = [_deliver(index, results) for index in range(len(runs))]
    with progress:
        try:
            while len(failed) < len(runs):
                progress.state("waiting for the loader")
                t0 = time.perf_counter()
                item = next(batches, None)
                waited += time.perf_counter() - t0
                if item is None:
                    break
                first_batch_at = first_batch_at or time.perf_counter()
                rows, pixels = item
                progress.state("running the model")
                if decoder is not None:
                    tiles, pixels = decoder(pixels), None  # served models: not with gpu
                else:
                    tiles = torch.from_numpy(pixels)  # the ring's shared memory, not a copy
                if staging is not None:
                    tiles = staging.to_device(tiles)
                shaped = {} if len(runs) > 1 else None  # each model input made once
                _each_model(runs, delivers, failed, "feed", rows, pixels, tiles, shaped)
                progress.advance(len(rows))
            _each_model(runs, delivers, failed, "flush")
        finally:
            # Also on an error or SIGTERM: no write may land in a store after its temporary
            # is removed, so the writer stops before this function is left.
            drain.finish(abandon=sys.exc_info()[0] is not None)
    ended = time.perf_counter()
    timings = {
        "wall_s": ended - started,
        "loader_wait_s": waited,
        "first_batch_at": first_batch_at or ended,
        **batches.reads(),
    }
    return timings, failed


def _each_model(runs: list, delivers: list, failed: dict, method: str, *args) -> None:
    """Call `method` of every model still in (with its `deliver` last); a model that
    raises drops out with its error. SIGTERM is not an Exception: it ends the job."""
    for index, (run, deliver) in enumerate(zip(runs, delivers, strict=True)):
        if index in failed:
            continue
        try:
            getattr(run, method)(*args, deliver)
        except Exception as err:
            failed.setdefault(index, err)


_HOST_DTYPES = {"float16": torch.float16, "float32": torch.float32}


class _PinnedStaging:
    """Batches go to the GPU from pinned memory, asynchronously; two pinned buffers take
    turns, so a batch is copied into one while the GPU may still be reading the other."""

    def __init__(self, device: torch.device, shape: tuple[int, ...]):
        self.device = device
        self.buffers = [torch.empty(shape, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def to_device(self, tiles: torch.Tensor) -> torch.Tensor:
        turn, self.turn = self.turn, 1 - self.turn
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()
        staged = self.buffers[turn][: len(tiles)]
        staged.copy_(tiles)
        on_device = staged.to(self.device, non_blocking=True)
        self.copied[turn] = torch.cuda.Event()
        self.copied[turn].record()
        return on_device


def _to_host(features: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying device features to pinned host memory without waiting for it."""
    if features.device.type != "cuda":
        return features, None
    host = torch.empty(features.shape, dtype=features.dtype, pin_memory=True)
    host.copy_(features, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _deliver(index: int, results: queue.Queue):
    """Model `index`'s hand-over of a batch's features to the writer thread."""

    def deliver(rows: np.ndarray, features: np.ndarray) -> None:
        results.put((index, rows, features))

    return deliver


class _Drain(threading.Thread):
    """Writer thread: zarr writes happen here, off the hot loop. A writer that refuses
    its features (not finite, say) records its model in `failed`, and gets no more."""

    def __init__(
        self, results: queue.Queue, writers: list[EmbeddingWriter], failed: dict[int, Exception]
    ) -> None:
        super().__init__(name="zarr-writer", daemon=True)
        self.results, self.writers, self.failed = results, writers, failed
        self.abandoned = False

    def finish(self, abandon: bool) -> None:
        """Write what is queued (or, when `abandon`, drop it) and stop."""
        self.abandoned = abandon
        self.results.put(None)
        self.join()

    def run(self) -> None:
        while (item := self.results.get()) is not None:
            index, rows, features = item
            if index in self.failed or self.abandoned:
                continue
            try:
                self.writers[index].put(rows, features)
            except Exception as err:  # the main thread drops the model at its next batch
                self.failed.setdefault(index, err)


def _attributes(slide: dict, embedder: Embedder, settings, timings) -> dict:
    return {
        **slide,
        "backend": "local",
        "model": embedder.spec.name,
        "model_output": embedder.spec.output,
        "embedding_dim": embedder.dim,
        "weights": settings.weights,
        "precision": str(embedder.dtype).removeprefix("torch."),
        "features_dtype": settings.output_dtype,
        "timings": timings,
    }


def _metrics(
    tiles: int, timings, startup: dict[str, float], embedder: Embedder, settings, device
) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        **loop_rates(tiles, timings),
        **{key: round(seconds, 3) for key, seconds in startup.items()},
        **read_counts(timings),
        "device": str(device),
        "device_name": device_name(device),
        "precision": str(embedder.dtype).removeprefix("torch."),
        "batch_size": settings.batch_size,
        "loader_workers": settings.workers,
        "model": embedder.spec.name,
        "backend": "local",
        **peak_memory_mb(),
        "peak_device_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if cuda else 0,
    }
