"""JPEG 2000 tiles decoded at 1/2, 1/4 or 1/8 of their size, by dropping wavelet levels.

A JPEG 2000 codestream holds its picture as a pyramid of wavelet resolutions: OpenJPEG's
`reduce` stops the inverse transform that many levels short of the full picture, so a
40x level read for 0.5 µm/px skips the finest level's work instead of decoding it and
resizing. imagecodecs and pylibjpeg-openjpeg do not expose `reduce` and glymur needs a
system OpenJPEG; Pillow does (its wheels carry OpenJPEG), at the cost of one picture it
allocates per tile, copied into the caller's buffer. Full-size decodes through Pillow
equal imagecodecs' bit for bit. A reduced one is the wavelet's low-pass band, a sharper
filter than a block mean or the exact path's resize: on tissue it differs from either by
several grey levels (docs/benchmarks.md), with the same colours.
"""

from __future__ import annotations

import io

import numpy as np
import tifffile
from PIL import Image

from slidesnake.slides.scaled_jpeg import AGREEMENT, SHRINKS


class ReducedJpeg2k:
    """Decodes the JPEG 2000 tiles of one TIFF page at 1/`shrink` of their size."""

    def __init__(self, page: tifffile.TiffPage, shrink: int) -> None:
        if shrink not in SHRINKS:
            raise ValueError(f"shrink {shrink}: a reduced decode halves the size 1 to 3 times")
        self.shrink, self._levels = shrink, shrink.bit_length() - 1
        self.tile_height, self.tile_width = page.tilelength // shrink, page.tilewidth // shrink

    def __call__(self, data: bytes | memoryview, out: np.ndarray) -> np.ndarray:
        with Image.open(io.BytesIO(data), formats=("JPEG2000",)) as picture:
            picture.reduce = self._levels
            picture.load()
            out[...] = np.asarray(picture)  # a tile of another size fails, as imagecodecs'
        return out

    def agrees(self, full: np.ndarray, scaled: np.ndarray) -> bool:
        """Whether a tile decoded this way has its full decode's size and colours (the
        codec converts colours itself, so this guards against a stream it misreads)."""
        height, width = scaled.shape[:2]
        if full.shape[:2] != (height * self.shrink, width * self.shrink):
            return False
        colours = full.mean(axis=(0, 1)) - scaled.mean(axis=(0, 1))
        return bool(np.abs(colours).max() <= AGREEMENT)
