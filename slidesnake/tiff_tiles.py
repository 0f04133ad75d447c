"""Tiled JPEG TIFF levels decoded straight to RGB: OpenSlide's pixels without its detours.

OpenSlide paints every read into a premultiplied ARGB surface and returns RGBA, and the
conversions around that cost more than decoding the JPEG tiles themselves (83 ms for a
1792 px read of which 21 ms is decoding, measured here). For Aperio and generic TIFF
slides whose level is tiled JPEG, we decode the compressed tiles a read touches with the
same libjpeg-turbo (tifffile + imagecodecs) and paste them into an RGB array. The tests
check that the pixels are OpenSlide's, bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import tifffile

JPEG = 7
VENDORS = {"aperio", "generic-tiff"}


class TiffJpegLevels:
    """The tiled JPEG pages of a TIFF slide, by OpenSlide level (matched by size)."""

    def __init__(self, path: Path, pages: dict[int, tifffile.TiffPage], tiff: tifffile.TiffFile):
        self.pages = pages
        self._tiff = tiff
        self._fd = os.open(path, os.O_RDONLY)

    @classmethod
    def open(
        cls, path: Path, vendor: str, level_dimensions: tuple[tuple[int, int], ...]
    ) -> TiffJpegLevels | None:
        """The fast reader of this slide, or None where OpenSlide must do the work."""
        if vendor not in VENDORS:
            return None
        try:
            tiff = tifffile.TiffFile(path)
        except (tifffile.TiffFileError, OSError, ValueError):
            return None
        pages = {}
        for level, size in enumerate(level_dimensions):
            page = next((p for p in tiff.pages if _fits(p, size)), None)
            if page is not None:
                pages[level] = page
        if not pages:
            tiff.close()
            return None
        return cls(path, pages, tiff)

    def read(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """RGB uint8 of `level` from its pixel (x, y); outside the image is white."""
        page = self.pages[level]
        out = np.full((height, width, 3), 255, np.uint8)
        tw, th = page.tilewidth, page.tilelength
        right, bottom = min(x + width, page.imagewidth), min(y + height, page.imagelength)
        across = -(-page.imagewidth // tw)
        for row in range(max(y, 0) // th, (bottom - 1) // th + 1):
            for col in range(max(x, 0) // tw, (right - 1) // tw + 1):
                tile = self._decode(page, row * across + col)
                if tile is None:  # a tile the scanner skipped: background, as in OpenSlide
                    continue
                x0, y0 = max(x, col * tw), max(y, row * th)
                x1, y1 = min(right, (col + 1) * tw), min(bottom, (row + 1) * th)
                out[y0 - y : y1 - y, x0 - x : x1 - x] = tile[
                    y0 - row * th : y1 - row * th, x0 - col * tw : x1 - col * tw
                ]
        return out

    def _decode(self, page: tifffile.TiffPage, index: int) -> np.ndarray | None:
        count = page.databytecounts[index]
        if count == 0:
            return None
        data = os.pread(self._fd, count, page.dataoffsets[index])
        pixels, _, _ = page.decode(data, index, jpegtables=page.jpegtables)
        return pixels.reshape(pixels.shape[-3:])

    def close(self) -> None:
        os.close(self._fd)
        self._tiff.close()


def _fits(page: tifffile.TiffPage, size: tuple[int, int]) -> bool:
    return (
        page.is_tiled
        and page.compression == JPEG
        and page.samplesperpixel == 3
        and page.planarconfig == 1
        and page.bitspersample == 8
        and page.imagedepth == 1
        and (page.imagewidth, page.imagelength) == tuple(size)
    )
