"""Compressed tiles decoded where the model runs (`loader.decode: gpu`), through nvImageCodec.

On a GPU node the loader's cores, not the GPU, set the pace of a mid-size model: JPEG's
Huffman decoding dominates a worker's time. In this mode the workers only read and pack
the compressed tiles (`loader.compressed_batches`); here each batch's streams are decoded
in one nvImageCodec call (nvJPEG, on the job's CUDA stream) and the model tiles are cut
from them on the device, so the batch crosses to the GPU compressed (a tenth of its
pixels' bytes) and never through pinned host memory. A job on the CPU decodes the same
way through nvImageCodec's libjpeg-turbo backend, which is how the tests run this path.

nvImageCodec has no scaled JPEG decode: this mode decodes every pixel of the read level,
and the model's resize on the device does the rest.
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from slidesnake.errors import ConfigError
from slidesnake.loader.compressed_batches import (
    SOURCE,
    STREAM,
    TARGET,
    TILE,
    WHITE,
    DeviceProbe,
    PackedBatch,
)
from slidesnake.slides.scaled_jpeg import agrees_at_scale

INSTALL = "pip install 'slidesnake[gpu-decode]'"


class DeviceDecoder:
    """Decodes packed batches into (B, px, px, 3) uint8 tiles on `device`."""

    def __init__(self, device: torch.device, tile_px: int, probe: DeviceProbe | None):
        self.device, self.tile_px, self.probe = device, tile_px, probe
        self._codec = _nvimgcodec()
        self._decoder = self._open()
        if probe is not None:
            self._check(probe)

    def _open(self):
        codec = self._codec
        if self.device.type == "cuda":
            return codec.Decoder(device_id=self.device.index or torch.cuda.current_device())
        return codec.Decoder(
            device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY, backends=[codec.Backend(codec.CPU_ONLY)]
        )

    def _check(self, probe: DeviceProbe) -> None:
        """Refuse a decoder whose pixels are not the CPU's (a colour space read another
        way differs by tens of grey levels; nvJPEG's inverse DCT by about one)."""
        (decoded,) = self._decode([np.frombuffer(probe.stream, np.uint8)])
        if decoded is None or not agrees_at_scale(decoded.cpu().numpy(), probe.reference, 1):
            raise ConfigError(
                f"slide '{probe.slide_id}' ({probe.path}): its JPEG tiles decode to other "
                f"pixels on {self.device} than on the CPU. Fix: set loader.decode to exact"
            )

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        table, px = batch.table, self.tile_px
        images = self._decode(batch.streams())
        for index, image in enumerate(images):
            if image is None:
                row, col = table.sources[index].tolist()
                raise self.probe.error(row, col, "nvImageCodec could not decode it")
        tiles = torch.empty((len(batch), px, px, 3), dtype=torch.uint8, device=self.device)
        if table.blank.any():
            tiles[torch.from_numpy(table.blank).to(self.device)] = 255
        for piece in table.pieces.tolist():
            sy0, sy1, sx0, sx1 = piece[SOURCE]
            ty0, ty1, tx0, tx1 = piece[TARGET]
            target = tiles[piece[TILE], ty0:ty1, tx0:tx1]
            if piece[STREAM] == WHITE:
                target.fill_(255)
            else:
                target.copy_(images[piece[STREAM]][sy0:sy1, sx0:sx1])
        return tiles

    def _decode(self, streams: list[np.ndarray]) -> list[torch.Tensor | None]:
        """The streams decoded in one call, as (h, w, 3) uint8 tensors on the device."""
        codec = self._codec
        sources = [codec.CodeStream(stream) for stream in streams]
        if self.device.type != "cuda":
            images = self._decoder.decode(sources)
            return [None if im is None else torch.from_numpy(np.asarray(im)) for im in images]
        stream = torch.cuda.current_stream(self.device).cuda_stream
        images = self._decoder.decode(sources, cuda_stream=stream)
        return [None if im is None else torch.from_dlpack(im) for im in images]


def _nvimgcodec():
    try:
        nvimgcodec = importlib.import_module("nvidia.nvimgcodec")
    except ImportError:
        raise ConfigError(
            f"loader.decode gpu needs nvImageCodec, which is not installed. Fix: {INSTALL}, "
            "or set loader.decode to exact or scaled"
        ) from None
    return nvimgcodec
