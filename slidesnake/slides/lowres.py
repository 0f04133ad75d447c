"""Low-resolution views of a slide, read at bounded memory.

Tissue masking needs the whole slide at about 8 µm/px. A pyramid gives that cheaply from a
reduced level; a slide without one must decode level 0, which we do in strips so memory
stays bounded whatever the slide size, and say what it costs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from slidesnake.errors import SlideSizeError
from slidesnake.slides.scaled_jpeg import SHRINKS
from slidesnake.slides.slide import Slide

log = logging.getLogger(__name__)

# Bytes of RGBA decoded per read; bounds memory for slides of any size.
STRIP_BYTES = 64 * 2**20


@dataclass(frozen=True)
class LowRes:
    """An RGB picture of the whole slide and how its pixels map to level 0."""

    rgb: np.ndarray
    level: int
    scale_x: float  # level-0 px per picture px
    scale_y: float
    mpp: float  # µm per picture px


def read_lowres(
    slide: Slide, target_mpp: float, max_decode_mpx: float = math.inf, decode: str = "exact"
) -> LowRes:
    """The whole slide at about `target_mpp`, never reading level 0 of a pyramid, and never
    decoding more than `max_decode_mpx` megapixels: a small file can declare any size.
    With `decode` 'scaled', a level finer than `target_mpp` by 2, 4 or 8 (or a multiple)
    decodes its tiles at that scale, binning only what is left (see `scaled_shrink`)."""
    level, factor = reduced_level(slide, target_mpp)
    megapixels = slide.levels[level].width * slide.levels[level].height / 1e6
    if megapixels > max_decode_mpx:
        raise SlideSizeError(
            slide.slide_id,
            slide.path,
            f"masking would decode {megapixels:.0f} Mpx of level {level}, the smallest "
            f"level it may read, more than tissue.max_decode_mpx ({max_decode_mpx:g})",
            "convert the slide to a pyramidal TIFF (e.g. vips tiffsave --tile --pyramid) "
            "or, if it really is this large, raise tissue.max_decode_mpx",
        )
    if len(slide.levels) == 1:
        log.warning(
            "slide '%s' has no reduced-resolution level: masking decodes all %.0f Mpx of "
            "level 0 (a pyramidal export of the slide avoids this)",
            slide.slide_id,
            megapixels,
        )
    shrink = scaled_shrink(slide, level, factor) if decode == "scaled" else 1
    rgb = _read_binned(slide, level, factor, shrink)
    lv = slide.levels[level]
    w0, h0 = slide.dimensions
    scale_x = factor * w0 / lv.width
    scale_y = factor * h0 / lv.height
    return LowRes(rgb, level, scale_x, scale_y, slide.mpp * (scale_x + scale_y) / 2)


def reduced_level(slide: Slide, target_mpp: float) -> tuple[int, int]:
    """The level to read for pixels of about `target_mpp`, never level 0 of a pyramid, and
    the factor to bin its pixels by."""
    level = slide.level_for_mpp(target_mpp)
    if level == 0 and len(slide.levels) > 1:
        level = 1  # level 1 is coarser than asked but costs a fraction of level 0
    return level, max(1, round(target_mpp / slide.level_mpp(level)))


def scaled_shrink(slide: Slide, level: int, factor: int) -> int:
    """The largest of 8, 4 and 2 that divides `factor` and at which `level`'s tiles
    decode (1 where none does: the level is read exactly)."""
    for shrink in SHRINKS[::-1]:
        if factor % shrink == 0 and slide.tiled_level(level, shrink) is not None:
            return shrink
    return 1


def _read_binned(slide: Slide, level: int, factor: int, shrink: int = 1) -> np.ndarray:
    """Read `level` (decoded at 1/`shrink`) in horizontal strips, each averaged over
    blocks of `factor` px of the level."""
    lv, binned = slide.levels[level], factor // shrink
    out_w, out_h = lv.width // factor, lv.height // factor
    rows_per_strip = max(1, STRIP_BYTES // (4 * lv.width * factor)) * factor
    strips = []
    for top in range(0, out_h * factor, rows_per_strip):
        rows = min(rows_per_strip, out_h * factor - top)
        y0 = round(top * lv.downsample)
        strip = slide.read(level, 0, y0, out_w * binned, rows // shrink, shrink)
        strips.append(bin_pixels(strip, binned))
    if not strips:
        return np.full((out_h, out_w, 3), 255, np.uint8)
    return np.concatenate(strips, axis=0)


def bin_pixels(rgb: np.ndarray, factor: int) -> np.ndarray:
    """`rgb` averaged over factor x factor blocks (a partial block at an edge is dropped).

    Summed one strided slice at a time: numpy's mean over the axes of a reshaped block
    view is three to five times slower, and binning is most of the mask stage's work."""
    if factor == 1:
        return rgb
    h, w = rgb.shape[0] // factor, rgb.shape[1] // factor
    total = np.zeros((h, w, rgb.shape[2]), np.float32)
    for dy in range(factor):
        for dx in range(factor):
            total += rgb[dy : h * factor : factor, dx : w * factor : factor]
    return (total / (factor * factor)).round().astype(np.uint8)
