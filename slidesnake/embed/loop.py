"""The hot loop of an embedding job: loader workers -> every model -> zarr.

Three things run at once: loader worker processes decode tiles; the main thread hands
each batch to every model of the job (a local one runs it on the device and copies its
features back asynchronously, a served one keeps requests in flight); a writer thread
puts finished features into zarr. The main thread records how long it waited for data,
which answers "is the GPU the bottleneck?". No torch here: a served-only job imports none.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slidesnake.embed.progress import Progress
from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.loader.batches import BatchStream

Deliver = Callable[[np.ndarray, np.ndarray], None]


@dataclass
class Batch:
    """One batch as the models of a job take it: its rows of the tile table; its uint8
    pixels in the loader's ring slot (host memory, valid until the next batch; None where
    the device decoded them); and, where local models run, its tiles on their device and
    the inputs cut from them (by input key, each made once for the models sharing it)."""

    rows: np.ndarray
    pixels: Any
    tiles: Any = None
    shaped: dict | None = None


class ModelRun(Protocol):
    """One model of a job: local (`embed.local_run.LocalRun`) or served
    (`remote.served_run.ServedRun`)."""

    dim: int

    def feed(self, batch: Batch, deliver: Deliver) -> None:
        """Take this batch; `deliver(rows, features)` any batch whose features are ready."""

    def flush(self, deliver: Deliver) -> None:
        """Deliver every batch still under way."""

    def model_s(self) -> float:
        """Its seconds in the job so far (call after the loop)."""

    def attributes(self, listed: bool) -> dict[str, Any]:
        """Its part of the zarr attributes (`listed`: a model of `models:`)."""

    def metrics(self) -> dict[str, Any]:
        """Its part of metrics.json."""

    def describe(self) -> str:
        """What it is and where it runs, for the job's log."""

    def close(self) -> None:
        """Let go of what it holds (a server's connections)."""


def run_models(
    runs: list[ModelRun],
    writers: list[EmbeddingWriter],
    batches: BatchStream,
    settings: EmbedSettings,
    to_device: Callable[[Batch], None] | None = None,
) -> tuple[dict[str, float], dict[int, Exception]]:
    """From the models ready to the last feature handed to the writers: each batch goes to
    the device once (`to_device`, where local models run) and to every model. A model
    that fails (its forward pass, its server, the check of its features) drops out, the
    others go on. Returns the loop's timings (wall time, wait for data, when the first
    batch came, what the workers read) and the failed models' errors, by index. An error
    of the loader ends the loop: it raises."""
    started = time.perf_counter()
    progress = Progress(writers[0].rows, settings.progress_s, settings.watchdog_s)
    results: queue.Queue = queue.Queue(maxsize=8 * len(runs))
    failed: dict[int, Exception] = {}  # written by this thread and the writer's
    drain = _Drain(results, writers, failed)
    drain.start()
    waited, first_batch_at, delivers = 0.0, None, [_deliver(i, results) for i in range(len(runs))]
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
                batch = Batch(*item)
                progress.state("running the models")
                if to_device is not None:
                    to_device(batch)
                _each_model(runs, delivers, failed, "feed", batch)
                progress.advance(len(batch.rows))
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


def _deliver(index: int, results: queue.Queue) -> Deliver:
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
