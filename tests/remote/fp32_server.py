"""A Triton server (PyTriton) for the remote backend's tests, run in the server's
environment: the tests' model behind inputs that slidesnake's own server does not use.

- model `fp32`: normalised FP32 [-1, 3, H, W], as an exported network takes it. It counts
  the requests it holds at once and writes the most it saw to --stats, and sleeps
  --delay-s per call, so that requests pile up when a client sends them in parallel.
- model `nhwc_fp32`: FP32 [-1, H, W, 3], a layout slidesnake must refuse.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from slidesnake.models.embedder import build_embedder
from slidesnake.models.registry import model_spec
from slidesnake.serve import ensure_own_libpython


class Counter:
    """Requests held by the model at once, across its instances (threads)."""

    def __init__(self, stats: Path) -> None:
        self.stats, self.lock = stats, threading.Lock()
        self.now = self.most = self.total = 0

    def enter(self, count: int) -> None:
        with self.lock:
            self.now += count
            self.total += count
            self.most = max(self.most, self.now)
            tmp = self.stats.with_suffix(".tmp")
            tmp.write_text(json.dumps({"max_in_flight": self.most, "requests": self.total}))
            os.replace(tmp, self.stats)

    def leave(self, count: int) -> None:
        with self.lock:
            self.now -= count


def main() -> None:
    ensure_own_libpython()
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--ports", type=int, nargs=3, required=True)
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    embedder = build_embedder(
        model_spec("timm:test_vit"), "checkpoint", args.checkpoint, 224, torch.device("cpu"), "fp32"
    )
    counter = Counter(args.stats)
    lock = threading.Lock()  # one forward pass at a time: the instances share the network

    def fp32(requests):
        counter.enter(len(requests))
        try:
            time.sleep(args.delay_s)
            outputs = []
            for request in requests:
                with lock, torch.inference_mode():
                    x = torch.from_numpy(request["tiles"])
                    outputs.append({"features": embedder.network(x).numpy()})
            return outputs
        finally:
            counter.leave(len(requests))

    @batch
    def nhwc(tiles):
        return {"features": np.zeros((len(tiles), embedder.dim), np.float32)}

    http, grpc, metrics = args.ports
    config = TritonConfig(http_port=http, grpc_port=grpc, metrics_port=metrics)
    batcher = DynamicBatcher(max_queue_delay_microseconds=100)
    batching = ModelConfig(max_batch_size=64, batcher=batcher)
    with Triton(config=config) as triton:
        triton.bind(
            "fp32",
            [fp32] * 4,
            inputs=[Tensor(name="tiles", dtype=np.float32, shape=(3, 224, 224))],
            outputs=[Tensor(name="features", dtype=np.float32, shape=(-1,))],
            config=batching,
        )
        triton.bind(
            "nhwc_fp32",
            nhwc,
            inputs=[Tensor(name="tiles", dtype=np.float32, shape=(224, 224, 3))],
            outputs=[Tensor(name="features", dtype=np.float32, shape=(-1,))],
            config=batching,
        )
        triton.serve()


if __name__ == "__main__":
    main()
