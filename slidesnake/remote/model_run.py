"""A served model among the models of one embedding job (`models:` with a remote entry).

It takes each batch as the loader gave it (uint8, host memory) and keeps up to
`remote.max_concurrency` requests in flight, as the remote backend's own job does; the
job's loop waits for it only when all its requests are in flight. Its time in the job is
that wait: what the server cost the loop.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from slidesnake.embed.settings import EmbedSettings
from slidesnake.embed.store import EmbeddingWriter
from slidesnake.models.input_pixels import centre_box
from slidesnake.models.registry import ModelInput, ModelSpec
from slidesnake.remote.client import InferenceClient
from slidesnake.remote.layout import choose_layout
from slidesnake.remote.loop import model_attributes, probe_width, send_tiles, server_metrics


class RemoteRun:
    """A served model's part of the job: its client, its store, its requests in flight."""

    def __init__(
        self, settings: EmbedSettings, spec: ModelSpec, wanted: ModelInput, slide_id: str
    ) -> None:
        remote = settings.remote
        self.settings, self.spec, self.wanted = settings, spec, wanted
        self.client = InferenceClient(remote, remote.server_for(slide_id))
        self.pool: ThreadPoolExecutor | None = None
        self.pending: dict[Future, np.ndarray] = {}
        self.seconds = 0.0
        self.writer: EmbeddingWriter | None = None

    def connect(self) -> int:
        """Wait for the server and its model; the width of its features."""
        self.client.wait_ready()
        self.metadata = self.client.metadata()
        size = self.wanted.size
        self.layout = choose_layout(self.metadata, self.spec, size, self.client.url)
        self.dim = self.layout.dim or probe_width(self.client, self.layout, self.spec)
        self.pool = ThreadPoolExecutor(self.settings.remote.max_concurrency, "infer")
        return self.dim

    def feed(self, rows, pixels: np.ndarray, tiles, shaped, deliver) -> None:
        """Send this batch once a request slot is free (delivering what came back)."""
        while len(self.pending) >= self.settings.remote.max_concurrency:
            self._collect(deliver)
        part = _centre(pixels, self.wanted.crop)
        # Copied: the ring slot is the loader's again at the next batch.
        args = (self.client, self.layout, self.spec, part.copy(), self.dim)
        self.pending[self.pool.submit(send_tiles, *args)] = rows

    def flush(self, deliver) -> None:
        while self.pending:
            self._collect(deliver)

    def _collect(self, deliver) -> None:
        started = time.perf_counter()
        done, _ = wait(self.pending, return_when=FIRST_COMPLETED)
        self.seconds += time.perf_counter() - started
        for future in done:
            deliver(self.pending.pop(future), future.result())

    def model_s(self) -> float:
        return self.seconds

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def attributes(self) -> dict[str, Any]:
        return model_attributes(self.client, self.metadata, self.spec, self.dim, self.settings)

    def metrics(self) -> dict[str, Any]:
        return server_metrics(self.client, self.metadata, self.settings.remote)


def _centre(pixels: np.ndarray, crop: float) -> np.ndarray:
    """The centre `crop` of (B, h, w, 3) tiles' sides, as the local backend cuts it."""
    return pixels if crop >= 1.0 else pixels[(slice(None), *centre_box(*pixels.shape[1:3], crop))]
