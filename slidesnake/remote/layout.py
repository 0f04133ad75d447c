"""What the client sends a served model, decided from the model's metadata.

Two layouts are understood: UINT8 (B, H, W, 3), tiles as read, which the server
normalises (slidesnake's own server, and the cheapest to send); and FP16/FP32
(B, 3, H, W), tiles normalised here with the model's mean and std, as an exported
network expects. Client-side preprocessing is the local backend's on a CPU, step for step,
so both backends give the same features for the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slidesnake.errors import ConfigError
from slidesnake.models.input_pixels import normalisation, resize_tiles_uint8
from slidesnake.models.registry import ModelSpec
from slidesnake.remote.protocol import ModelMetadata, TensorMetadata

_FLOAT = {"FP16": np.float16, "FP32": np.float32}


@dataclass(frozen=True)
class InputLayout:
    """The served model's input and output, and how tiles become its input."""

    input: TensorMetadata
    output: TensorMetadata
    size: int  # tiles are resized to size x size px
    normalised: bool  # False: UINT8 (B, H, W, 3); True: FP16/FP32 (B, 3, H, W)
    dim: int | None  # the output's width, when the server declares it

    def prepare(self, tiles: np.ndarray, spec: ModelSpec) -> np.ndarray:
        """uint8 (B, h, w, 3) tiles from the loader -> the array to send."""
        if tiles.shape[1] != self.size or tiles.shape[2] != self.size:
            tiles = resize_tiles_uint8(tiles, self.size)  # uint8 in and out, as on a CPU
        if not self.normalised:
            return np.ascontiguousarray(tiles)
        scale, shift = normalisation(spec)
        x = np.ascontiguousarray(tiles.transpose(0, 3, 1, 2), np.float32)
        x *= scale
        x -= shift
        return x.astype(_FLOAT[self.input.datatype], copy=False)


def choose_layout(
    metadata: ModelMetadata, spec: ModelSpec, tile_size: int, server: str
) -> InputLayout:
    """The layout of `metadata`, or a ConfigError naming the server, the model and what it
    offers when slidesnake cannot feed it or it does not fit the config."""

    def refuse(problem: str) -> ConfigError:
        return ConfigError(
            f"inference server {server}, model '{metadata.name}' ({metadata.describe()}): {problem}"
        )

    if len(metadata.inputs) != 1 or len(metadata.outputs) != 1:
        raise refuse("slidesnake sends one input and reads one output")
    tensor, output = metadata.inputs[0], metadata.outputs[0]
    shape = tensor.shape
    if tensor.datatype == "UINT8" and len(shape) == 4 and shape[3] == 3:
        height, width, normalised = shape[1], shape[2], False
    elif tensor.datatype in _FLOAT and len(shape) == 4 and shape[1] == 3:
        height, width, normalised = shape[2], shape[3], True
    else:
        raise refuse(
            "slidesnake sends tiles as UINT8 [-1, H, W, 3] or normalised FP16/FP32 "
            "[-1, 3, H, W]; serve the model with one of these inputs"
        )
    if shape[0] != -1 or height != width:
        raise refuse("the input must take any batch size and square tiles")
    size = tile_size if height == -1 else height
    if spec.input_size is not None and size != spec.input_size:
        raise refuse(f"model.name '{spec.name}' takes {spec.input_size} px tiles, not {size}")
    if len(output.shape) != 2 or output.datatype not in _FLOAT | {"FP64": None}:
        raise refuse("the output must be one float vector per tile, [-1, D]")
    dim = output.shape[1] if output.shape[1] > 0 else None
    if spec.dim is not None and dim is not None and dim != spec.dim:
        raise refuse(f"model.name '{spec.name}' gives {spec.dim}-d features, the server {dim}")
    return InputLayout(tensor, output, size, normalised, dim)
