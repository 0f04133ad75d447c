"""JPEG tiles decoded at 1/2, 1/4 or 1/8 of their size, inside libjpeg-turbo's inverse DCT.

A 40x slide embedded at 0.5 µm/px needs a quarter of its pixels: decoding all of them
and resizing costs more than the decode that produces the smaller picture directly
(libvips' shrink-on-load). simplejpeg is the binding that exposes libjpeg-turbo's
scaling and decodes into a caller's buffer (imagecodecs has no scaling; Pillow's draft
mode allocates every picture). Its TurboJPEG API reads whole JPEG streams, so each
TIFF tile is made one (`jpeg_streams`). Full-size decodes through this path equal
imagecodecs' bit for bit (checked per level by `ScaledJpeg.agrees`); scaled ones are
within a grey level or two of the full picture's 2x2 (4x4, 8x8) means.
"""

from __future__ import annotations

import numpy as np
import simplejpeg
import tifffile

from slidesnake.slides.jpeg_streams import JpegStreams

SHRINKS = (2, 4, 8)
# A scaled decode's largest mean difference from the full picture's block means, per
# channel, before a level is read the exact way instead (grey levels).
AGREEMENT = 2.0


class ScaledJpeg:
    """Decodes the JPEG tiles of one TIFF page at 1/`shrink` of their size."""

    def __init__(self, page: tifffile.TiffPage, shrink: int) -> None:
        if shrink not in SHRINKS:
            raise ValueError(f"shrink {shrink}: libjpeg-turbo scales by 2, 4 or 8")
        self.shrink = shrink
        self.tile_height, self.tile_width = page.tilelength // shrink, page.tilewidth // shrink
        self.stream = JpegStreams(page)

    def __call__(self, data: bytes | memoryview, out: np.ndarray) -> np.ndarray:
        return simplejpeg.decode_jpeg(
            self.stream(data),
            min_height=self.tile_height,
            min_width=self.tile_width,
            min_factor=self.shrink,
            buffer=out,
        )

    def agrees(self, full: np.ndarray, scaled: np.ndarray) -> bool:
        """Whether a tile decoded this way matches its full decode's block means (a
        colour space guessed wrong differs by tens of grey levels)."""
        return agrees_at_scale(full, scaled, self.shrink)


def agrees_at_scale(full: np.ndarray, scaled: np.ndarray, shrink: int) -> bool:
    """Whether `scaled` is `full` at 1/`shrink` of its size: within `AGREEMENT` of its
    shrink x shrink block means, per channel on average."""
    height, width = scaled.shape[:2]
    if full.shape[:2] != (height * shrink, width * shrink):
        return False
    means = full.reshape(height, shrink, width, shrink, 3).mean(axis=(1, 3))
    return bool(np.abs(scaled - means).mean(axis=(0, 1)).max() <= AGREEMENT)
