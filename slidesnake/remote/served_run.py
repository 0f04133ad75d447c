"""A served model's part of an embedding job: its batches sent to an inference server.

It takes each batch as the loader gave it (uint8, host memory) and keeps up to
`remote.max_concurrency` requests in flight; the job's loop waits for it only when all
its requests are in flight, so the loader runs at most its own prefetch ahead of them,
and memory stays flat however slow the server is. Its time in the job is that wait: what
the server cost the loop. A job of served models alone holds no GPU: it is a CPU client.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from slidesnake.embed.loop import Batch, Deliver
from slidesnake.embed.settings import EmbedSettings
from slidesnake.models.input_pixels import centre_box
from slidesnake.models.registry import ModelInput, ModelSpec
from slidesnake.remote.client import InferenceClient
from slidesnake.remote.layout import InputLayout, choose_layout


class ServedRun:
    """A served model's client, its input's layout and its requests in flight. Opening
    it waits for the server and its model, and learns the width of its features, before
    any tile is sent."""

    def __init__(
        self, settings: EmbedSettings, spec: ModelSpec, wanted: ModelInput, slide_id: str
    ) -> None:
        remote = settings.remote
        self.settings, self.spec, self.wanted = settings, spec, wanted
        self.client = InferenceClient(remote, remote.server_for(slide_id))
        self.pending: dict[Future, np.ndarray] = {}
        self.seconds = 0.0
        try:
            self.client.wait_ready()
            self.metadata = self.client.metadata()
            self.layout = choose_layout(self.metadata, spec, wanted.size, self.client.url)
            self.dim = self.layout.dim or probe_width(self.client, self.layout, spec)
        except BaseException:
            self.client.close()
            raise
        self.pool = ThreadPoolExecutor(remote.max_concurrency, "infer")

    def feed(self, batch: Batch, deliver: Deliver) -> None:
        """Send this batch once a request slot is free (delivering what came back)."""
        while len(self.pending) >= self.settings.remote.max_concurrency:
            self._collect(deliver)
        part = _centre(batch.pixels, self.wanted.crop)
        # Copied: the ring slot is the loader's again at the next batch.
        args = (self.client, self.layout, self.spec, part.copy(), self.dim)
        self.pending[self.pool.submit(send_tiles, *args)] = batch.rows

    def flush(self, deliver: Deliver) -> None:
        while self.pending:
            self._collect(deliver)

    def _collect(self, deliver: Deliver) -> None:
        started = time.perf_counter()
        done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
        self.seconds += time.perf_counter() - started
        for future in done:
            deliver(self.pending.pop(future), future.result())

    def model_s(self) -> float:
        return self.seconds

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def attributes(self, listed: bool) -> dict[str, Any]:
        return {
            "backend": "remote",
            "model": self.spec.name,
            "model_output": self.spec.output,
            "embedding_dim": self.dim,
            "server_url": self.client.url,
            "server_model": self.metadata.name,
            "server_model_versions": list(self.metadata.versions),
            "server_io": self.metadata.describe(),
            "features_dtype": self.settings.output_dtype,
        }

    def metrics(self) -> dict[str, Any]:
        """The server's part of the metrics: where, requests, latencies, the loop's wait."""
        latencies = np.asarray(self.client.latencies_s or [0.0])
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
        return {
            "model": self.spec.name,
            "backend": "remote",
            "server_wait_s": round(self.seconds, 3),
            "server_url": self.client.url,
            "server_model": self.metadata.name,
            "server_model_versions": list(self.metadata.versions),
            "requests": len(self.client.latencies_s),
            "retries": self.client.retries,
            "latency_p50_s": round(float(p50), 4),
            "latency_p90_s": round(float(p90), 4),
            "latency_p99_s": round(float(p99), 4),
            "latency_max_s": round(float(latencies.max()), 4),
            "max_concurrency": self.settings.remote.max_concurrency,
        }

    def describe(self) -> str:
        remote = self.settings.remote
        return (
            f"'{self.metadata.name}' ({self.dim}-d) on {self.client.url}, input "
            f"{self.layout.input.describe()}, {remote.max_concurrency} requests in flight"
        )


def probe_width(client: InferenceClient, layout: InputLayout, spec: ModelSpec) -> int:
    """The feature width, from one blank tile, when the server's metadata leaves it open."""
    blank = np.zeros((1, layout.size, layout.size, 3), np.uint8)
    return int(send_tiles(client, layout, spec, blank, None).shape[1])


def send_tiles(
    client: InferenceClient,
    layout: InputLayout,
    spec: ModelSpec,
    tiles: np.ndarray,
    width: int | None,
) -> np.ndarray:
    """One batch: preprocess (in the request thread: Pillow and numpy release the GIL) and
    infer; the answer is checked against the declared output and `width`."""
    array = layout.prepare(tiles, spec)
    return client.infer(layout.input.name, layout.input.datatype, array, layout.output, width)


def _centre(pixels: np.ndarray, crop: float) -> np.ndarray:
    """The centre `crop` of (B, h, w, 3) tiles' sides, as the local backend cuts it."""
    return pixels if crop >= 1.0 else pixels[(slice(None), *centre_box(*pixels.shape[1:3], crop))]
