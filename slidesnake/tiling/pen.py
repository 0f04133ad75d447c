"""Pen ink on a low-resolution picture of a slide.

Pathologists circle tumour with markers on the glass: green, blue and black ink. On H&E
the stains are pink to purple (hues of 260-360 degrees), so strongly saturated green to
blue hues are ink, and so is what is nearly black, which neither stain becomes at the
mask's resolution. Specks smaller than any marker stroke are dropped.
"""

from __future__ import annotations

import numpy as np
from skimage.morphology import remove_small_objects

from slidesnake.tiling.tissue import saturation

INK_HUES = (90.0, 250.0)  # degrees: green through blue
MIN_INK_SATURATION = 0.3  # haematoxylin's blue-purple edge stays below this
MAX_BLACK_VALUE = 0.2  # brightness (max channel / 255) below which a pixel is black ink
MIN_MARK_UM2 = 10_000.0  # a marker stroke is 0.3-1 mm wide: anything smaller is a speck


def detect_pen(rgb: np.ndarray, mpp: float) -> np.ndarray:
    """Boolean mask of pen ink in an RGB picture whose pixels are `mpp` µm wide."""
    if rgb.size == 0:
        return np.zeros(rgb.shape[:2], bool)
    hue = hue_degrees(rgb)
    coloured = (hue >= INK_HUES[0]) & (hue < INK_HUES[1]) & (saturation(rgb) > MIN_INK_SATURATION)
    black = rgb.max(axis=-1) < MAX_BLACK_VALUE * 255
    return remove_small_objects(coloured | black, max_size=round(MIN_MARK_UM2 / (mpp * mpp)))


def hue_degrees(rgb: np.ndarray) -> np.ndarray:
    """HSV hue in [0, 360), float32; grey pixels get 0. (skimage's rgb2hsv converts all
    three channels to float64, twice the memory of these float32 planes and more work.)"""
    r, g, b = (rgb[..., i].astype(np.float32) for i in range(3))
    high, low = np.maximum(np.maximum(r, g), b), np.minimum(np.minimum(r, g), b)
    chroma = np.where(high > low, high - low, 1.0)
    hue = np.where(high == r, ((g - b) / chroma) % 6, 0.0)
    hue = np.where((high == g) & (high != r), (b - r) / chroma + 2, hue)
    hue = np.where((high == b) & (high != r) & (high != g), (r - g) / chroma + 4, hue)
    return np.where(high > low, 60 * hue, 0.0).astype(np.float32)
