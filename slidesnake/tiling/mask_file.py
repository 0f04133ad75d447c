"""The tissue mask on disk: a PNG whose text chunks record how it maps to the slide.

One file holds both the pixels and their geometry, so a mask can never be read with the
wrong scale. Tissue is 255 and glass 0; where the mask stage also looked for pen ink, ink
on tissue is 192 and ink on glass 64, so the tissue is still every value of 128 or more.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from slidesnake.atomic import atomic_output

_PREFIX = "slidesnake."
_PEN_LAYER = _PREFIX + "pen_layer"
_DECODE = _PREFIX + "decode"
_PEN = 64  # a pixel's value modulo 128 when it is ink


@dataclass(frozen=True)
class TissueMask:
    """A boolean tissue mask of a whole slide and its geometry."""

    mask: np.ndarray  # (h, w) bool, True = tissue
    mpp: float  # µm per mask px
    scale_x: float  # level-0 px per mask px
    scale_y: float
    slide_mpp: float  # level-0 µm/px of the slide
    slide_width: int  # level-0 px
    slide_height: int
    read_level: int  # the pyramid level the mask was computed from
    pen: np.ndarray | None = None  # (h, w) bool, True = pen ink; None = not looked for
    decode: str = "exact"  # how the level was decoded (loader.decode; before it: exact)

    @property
    def tissue_fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    def geometry(self) -> dict[str, float | int]:
        """Everything but the pixels."""
        return {name: getattr(self, name) for name in _GEOMETRY}


def save_mask(mask: TissueMask, path: str | Path) -> None:
    info = PngInfo()
    for key, value in mask.geometry().items():
        info.add_text(_PREFIX + key, repr(value))
    info.add_text(_DECODE, mask.decode)
    pixels = mask.mask.astype(np.uint8) * 255
    if mask.pen is not None:
        info.add_text(_PEN_LAYER, "1")
        pixels = np.where(mask.pen, mask.mask * 128 + _PEN, pixels).astype(np.uint8)
    with atomic_output(path) as tmp:
        Image.fromarray(pixels).save(tmp, format="PNG", pnginfo=info)


def load_mask(path: str | Path) -> TissueMask:
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("L"))
        has_pen = _PEN_LAYER in image.text
        decode = image.text.get(_DECODE, "exact")
        text = {k.removeprefix(_PREFIX): v for k, v in image.text.items() if k.startswith(_PREFIX)}
    geometry = {
        key: (int if key in {"slide_width", "slide_height", "read_level"} else float)(text[key])
        for key in _GEOMETRY
    }
    pen = pixels % 128 == _PEN if has_pen else None
    return TissueMask(mask=pixels >= 128, pen=pen, decode=decode, **geometry)


def mask_decode(path: str | Path) -> str:
    """How a mask file's level was decoded, reading only its text chunks."""
    with Image.open(path) as image:
        return image.text.get(_DECODE, "exact")


_GEOMETRY = [
    name for name in TissueMask.__dataclass_fields__ if name not in {"mask", "pen", "decode"}
]
