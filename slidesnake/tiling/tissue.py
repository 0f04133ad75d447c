"""Tissue detection on a low-resolution RGB picture of a slide.

Stained tissue is coloured and glass is grey-white, so we threshold saturation with Otsu,
after a median blur that removes JPEG and sensor noise. A floor under the threshold keeps
an empty slide empty (Otsu always splits something), and morphology in µm makes the
result independent of the picture's resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage as ndi
from skimage.filters import threshold_otsu
from skimage.morphology import remove_small_holes, remove_small_objects

from slidesnake.tiling.config_section import ConfigSection


@dataclass(frozen=True)
class TissueParams(ConfigSection):
    """Knobs of tissue detection; the defaults suit H&E at about 8 µm/px."""

    mpp: float = 8.0  # resolution of the mask
    blur_um: float = 40.0  # median filter width
    min_saturation: float = 0.07  # below this saturation a pixel is never tissue
    min_object_um2: float = 20_000.0  # smaller islands are specks, not tissue
    max_hole_um2: float = 50_000.0  # smaller holes inside tissue are filled
    max_decode_mpx: float = 1000.0  # bound on pixels decoded when there is no reduced level


def saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation in [0, 1]; black counts as unsaturated."""
    high = rgb.max(axis=-1).astype(np.float32)
    low = rgb.min(axis=-1).astype(np.float32)
    return np.divide(high - low, high, out=np.zeros_like(high), where=high > 0)


def detect_tissue(rgb: np.ndarray, mpp: float, params: TissueParams) -> np.ndarray:
    """Boolean tissue mask of an RGB picture whose pixels are `mpp` µm wide."""
    if rgb.size == 0:
        return np.zeros(rgb.shape[:2], bool)
    px_area = mpp * mpp
    blur_px = max(1, round(params.blur_um / mpp)) | 1  # odd, so the filter is centred
    sat = ndi.median_filter(saturation(rgb), size=blur_px)
    threshold = max(_otsu(sat), params.min_saturation)
    mask = sat > threshold
    mask = remove_small_objects(mask, max_size=round(params.min_object_um2 / px_area))
    return remove_small_holes(mask, max_size=round(params.max_hole_um2 / px_area))


def _otsu(values: np.ndarray) -> float:
    if values.min() == values.max():
        return float(values.max())
    return float(threshold_otsu(values))
