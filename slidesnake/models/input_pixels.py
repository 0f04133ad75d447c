"""A model's input pixels without torch: its normalisation constants, and the uint8 resize
a client runs before sending tiles to a served model.

A remote-backend job has no network to run, so it should not pay torch's import (1.5 s
here, per slide). The local backend resizes in torch, batched, on its device; this resize
is Pillow's bilinear filter (antialiased when it shrinks), the filter torch's uint8
antialiased resize was written to match: equal at whole-number factors (a 40x slide read
for a 20x model), within one grey level otherwise (tests/test_remote.py checks both).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from slidesnake.models.registry import ModelSpec


def normalisation(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """float32 (scale, shift), shaped (1, 3, 1, 1), such that x * scale - shift is
    (x / 255 - mean) / std: one multiply and one subtract, in place."""
    std = np.asarray(spec.std, np.float32).reshape(1, 3, 1, 1)
    shift = np.asarray(spec.mean, np.float32).reshape(1, 3, 1, 1) / std
    return np.float32(1.0) / (np.float32(255.0) * std), shift


def centre_box(height: int, width: int, crop: float) -> tuple[slice, slice]:
    """(rows, columns) of the centre `crop` of an h x w tile's sides: the part a model that
    sees less than the tile takes, cut alike on the device and for a served model."""
    side_y, side_x = round(height * crop), round(width * crop)
    top, left = (height - side_y) // 2, (width - side_x) // 2
    return slice(top, top + side_y), slice(left, left + side_x)


def resize_tiles_uint8(tiles: np.ndarray, size: int) -> np.ndarray:
    """uint8 (B, h, w, 3) tiles to (B, size, size, 3), tile by tile (Pillow releases the
    GIL while it resizes, so request threads resize in parallel)."""
    out = np.empty((len(tiles), size, size, 3), np.uint8)
    for tile, resized in zip(tiles, out, strict=True):
        image = Image.fromarray(tile).resize((size, size), Image.Resampling.BILINEAR)
        resized[...] = np.asarray(image)
    return out
