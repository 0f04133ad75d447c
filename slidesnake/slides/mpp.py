"""Microns per pixel: where they come from and when to distrust them.

Tiles are defined in microns, so a wrong mpp silently embeds the wrong magnification.
We take it from the sample sheet first, then from the slide, and refuse values that no
slide scanner produces (a 72 dpi TIFF resolution tag reads as 352 µm/px).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slidesnake.errors import MppError

# Level-0 resolutions of real scanners lie well inside this range (0.1-2 µm/px typically).
PLAUSIBLE_MPP = (0.05, 20.0)

_UM_PER_UNIT = {"centimeter": 1e4, "inch": 25.4e3}
_ADD_MPP = "add the level-0 microns per pixel in the sample sheet's 'mpp' column"


@dataclass(frozen=True)
class Mpp:
    """A resolved level-0 resolution and where it was read."""

    value: float
    source: str


def resolve_mpp(
    properties: Mapping[str, str],
    sheet_mpp: float | None,
    slide_id: str,
    path: str | Path,
) -> Mpp:
    """Return the level-0 µm/px: sample sheet, then OpenSlide's mpp, then TIFF tags."""
    candidates = [
        ("sample sheet", _finite(sheet_mpp)),
        ("openslide.mpp-x/y", _openslide_mpp(properties)),
        ("TIFF resolution tags", _tiff_tag_mpp(properties)),
    ]
    for source, value in candidates:
        if value is None:
            continue
        low, high = PLAUSIBLE_MPP
        if not low <= value <= high:
            raise MppError(
                slide_id,
                path,
                f"{source} gives {value:.4g} µm/px, outside the plausible range "
                f"{low}-{high} µm/px of a slide scan",
                _ADD_MPP if source != "sample sheet" else "correct the 'mpp' column",
            )
        return Mpp(value, source)
    raise MppError(slide_id, path, "the slide does not record its microns per pixel", _ADD_MPP)


def _finite(value: float | str | None) -> float | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except ValueError:
        return math.nan
    if math.isnan(number) and not isinstance(value, str):
        return None  # an empty cell of the sample sheet
    return number


def _openslide_mpp(properties: Mapping[str, str]) -> float | None:
    x = _finite(properties.get("openslide.mpp-x"))
    y = _finite(properties.get("openslide.mpp-y"))
    if x is None or y is None:
        return x if y is None else y
    return (x + y) / 2


def _tiff_tag_mpp(properties: Mapping[str, str]) -> float | None:
    unit = properties.get("tiff.ResolutionUnit", "").lower()
    resolution = _finite(properties.get("tiff.XResolution"))
    if unit not in _UM_PER_UNIT or resolution is None or resolution <= 0:
        return None  # unit 'none' or no tag: the pixels have no physical size
    return _UM_PER_UNIT[unit] / resolution
