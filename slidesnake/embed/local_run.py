"""A local model's part of an embedding job, and the job's device.

Each batch goes to the device once for all the job's local models (`DeviceFeed`): on a
GPU from pinned memory, asynchronously, or decoded there (`loader.decode: gpu`); on a CPU
the ring slot is used in place. Each model's features are copied back to pinned memory
without waiting: they are delivered a batch later, when the copy has had the next batch's
kernels to finish behind. A model times its own kernels with CUDA events, so that timing
it never waits for the GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slidesnake.embed.device_decode import DeviceDecoder
from slidesnake.embed.loop import Batch, Deliver
from slidesnake.embed.model_list import check_memory
from slidesnake.embed.settings import EmbedSettings
from slidesnake.loader.batches import BatchStream
from slidesnake.models.embedder import DTYPES, Embedder, build_embedder, parameter_count
from slidesnake.models.registry import ModelInput, ModelSpec

# What a model needs on a GPU beyond its weights: activations of a batch, the allocator's
# slack. Generous on purpose: the check is there to refuse a list that cannot fit.
ACTIVATION_BYTES = 2 * 2**30
_HOST_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def slide_device() -> torch.device:
    """The job's device: its GPU (the one it claimed) where there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_device_mb(device: torch.device) -> float:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else 0


def weights_bytes(spec: ModelSpec, settings: EmbedSettings) -> int:
    """The bytes a model's weights take on its device: its parameters at its precision,
    or a program's file size."""
    if spec.architecture is None:
        return Path(settings.checkpoint).stat().st_size if settings.checkpoint else 0
    return parameter_count(spec) * DTYPES[settings.precision].itemsize


def check_fits(models: dict[str, tuple[ModelSpec, EmbedSettings]], device, jobs_on_gpu: int):
    """ModelError when the local models of a list cannot share this job's part of its GPU."""
    if device.type == "cuda":
        needs = {key: weights_bytes(*model) + ACTIVATION_BYTES for key, model in models.items()}
        check_memory(needs, *torch.cuda.mem_get_info(device), jobs_on_gpu)


class DeviceFeed:
    """Puts each batch on the job's device once, for all its local models; with several,
    each model input (crop and size) is made once, for the models that share it."""

    def __init__(self, device: torch.device, batches: BatchStream, shape, shared: bool) -> None:
        self.shared = shared
        self.decoder = (
            DeviceDecoder(device, shape[1], batches.device_probe) if batches.packed else None
        )
        cuda = device.type == "cuda" and self.decoder is None
        self.staging = _PinnedStaging(device, shape) if cuda else None

    def __call__(self, batch: Batch) -> None:
        if self.decoder is not None:
            batch.tiles, batch.pixels = self.decoder(batch.pixels), None
        else:
            batch.tiles = torch.from_numpy(batch.pixels)  # the ring's shared memory, not a copy
        if self.staging is not None:
            batch.tiles = self.staging.to_device(batch.tiles)
        batch.shaped = {} if self.shared else None


@dataclass
class LocalRun:
    """A model on this job's device: its embedder, its features' dtype, its kernels' time."""

    embedder: Embedder
    settings: EmbedSettings
    seconds: float = 0.0
    _events: list = field(default_factory=list)
    _in_flight: tuple | None = None  # the previous batch, its copy to the host under way

    def __post_init__(self) -> None:
        self.dim = self.embedder.dim
        self.digest = self.embedder.weights_digest()  # a thread: after the loader's fork

    def feed(self, batch: Batch, deliver: Deliver) -> None:
        """Embed this batch and deliver the previous one's features, whose copy to the
        host has had this batch's kernels to finish."""
        copied = self._timed(batch.tiles, batch.shaped)
        self.flush(deliver)
        self._in_flight = (batch.rows, copied)

    def flush(self, deliver: Deliver) -> None:
        if self._in_flight is not None:
            rows, (features, done) = self._in_flight
            if done is not None:
                done.synchronize()
            deliver(rows, features.numpy())
            self._in_flight = None

    def _timed(self, tiles: torch.Tensor, shaped: dict | None) -> tuple:
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
        """The batch's features, their copy to the host started. With `shaped`, an input
        another model made of this batch is used, and one made here kept for the others."""
        if shaped is None:
            features = self.embedder(tiles)
        else:
            key = self.embedder.input_key
            if key not in shaped:
                shaped[key] = self.embedder.shape(tiles)
            features = self.embedder(tiles, shaped[key])
        return _to_host(features.to(_HOST_DTYPES[self.settings.output_dtype]))

    def model_s(self) -> float:
        """Seconds of model time so far (it waits for the GPU)."""
        return self.seconds + sum(a.elapsed_time(b) for a, b in self._events) / 1000

    def attributes(self, listed: bool) -> dict[str, Any]:
        embedder = self.embedder
        shape = {"model_input_px": embedder.input_size, "model_input_crop": embedder.crop}
        return {
            "backend": "local",
            "model": embedder.spec.name,
            "model_output": embedder.spec.output,
            "embedding_dim": embedder.dim,
            **(shape if listed else {}),
            "weights": self.settings.weights,
            "precision": _dtype(embedder),
            "features_dtype": self.settings.output_dtype,
            "weights_sha256": self.digest.value() if self.digest else None,
        }

    def metrics(self) -> dict[str, Any]:
        return {
            **{name: round(seconds, 3) for name, seconds in self.embedder.load_s.items()},
            "precision": _dtype(self.embedder),
            "model": self.embedder.spec.name,
            "backend": "local",
            "peak_device_mb": peak_device_mb(self.embedder.device),
        }

    def describe(self) -> str:
        return f"{self.embedder.spec.name} ({self.dim}-d, {_dtype(self.embedder)})"

    def close(self) -> None:
        """Nothing to let go of: the model goes with the process."""


def open_local(
    settings: EmbedSettings, spec: ModelSpec, wanted: ModelInput, device: torch.device
) -> LocalRun:
    """A model built on `device`, taking its input (`wanted`) of each tile."""
    embedder = build_embedder(
        spec, settings.weights, settings.checkpoint, wanted.size, device, settings.precision
    )
    embedder.crop = wanted.crop
    return LocalRun(embedder, settings)


def _dtype(embedder: Embedder) -> str:
    return str(embedder.dtype).removeprefix("torch.")


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
