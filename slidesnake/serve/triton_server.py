"""One warm model on one device, served by Triton with dynamic batching across requests.

Requests carry UINT8 tiles (B, H, W, 3), the cheapest form to send; resizing is the
client's, normalisation and the forward pass run on the server's device. Triton merges
requests from many slide jobs into batches of up to `max_batch` tiles, so the GPU sees
full batches even when each job sends small ones.
"""

from __future__ import annotations

import logging
import signal
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from slidesnake.models.embedder import Embedder, build_embedder
from slidesnake.models.registry import model_spec

log = logging.getLogger(__name__)

INPUT, OUTPUT = "tiles", "features"


@dataclass(frozen=True)
class ServeOptions:
    """What `slidesnake serve` serves, and where."""

    model: str
    checkpoint: str | None = None
    weights: str = "checkpoint"
    precision: str = "fp16"
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    tile_size: int | None = None  # default: the model's own input size, else 224
    device: str = "cuda:0"
    name: str = "slidesnake"
    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    max_batch: int = 256
    queue_delay_us: int = 2000


def serve(options: ServeOptions) -> None:
    """Load the weights, then serve until SIGTERM or SIGINT. Triton answers ready only once
    the model is bound, which is after its weights are on the device."""
    spec = model_spec(options.model, options.mean, options.std)
    size = options.tile_size or spec.input_size or 224
    device = torch.device(options.device)
    embedder = build_embedder(
        spec, options.weights, options.checkpoint, size, device, options.precision
    )
    batch_sizes: Counter[int] = Counter()
    config = TritonConfig(
        http_address=options.host,
        http_port=options.http_port,
        grpc_address=options.host,
        grpc_port=options.grpc_port,
        metrics_port=options.metrics_port,
        exit_on_error=True,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name=options.name,
            infer_func=_infer_function(embedder, batch_sizes),
            inputs=[Tensor(name=INPUT, dtype=np.uint8, shape=(size, size, 3))],
            outputs=[Tensor(name=OUTPUT, dtype=np.float32, shape=(embedder.dim,))],
            config=ModelConfig(
                max_batch_size=options.max_batch,
                batcher=DynamicBatcher(max_queue_delay_microseconds=options.queue_delay_us),
            ),
            strict=True,
        )
        signal.signal(signal.SIGTERM, _interrupt)  # Triton.serve stops cleanly on it
        log.info(
            "serving model '%s' (%s, %d-d, %s) as '%s' on %s, http %s:%d, tiles %d px, "
            "batches of up to %d tiles",
            spec.name, str(embedder.dtype).removeprefix("torch."), embedder.dim, device,
            options.name, options.host, options.http_port, size,
            options.max_batch,
        )  # fmt: skip
        triton.serve()
    log.info("stopped; batch sizes seen (tiles: executions): %s", dict(sorted(batch_sizes.items())))


def _infer_function(embedder: Embedder, batch_sizes: Counter[int]):
    @batch
    def infer(tiles: np.ndarray) -> dict[str, np.ndarray]:
        batch_sizes[len(tiles)] += 1
        features = embedder(torch.from_numpy(tiles))
        return {OUTPUT: features.float().cpu().numpy()}

    return infer


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
