"""The tissue mask on disk: a PNG whose text chunks record how it maps to the slide.

One file holds both the pixels and their geometry, so a mask can never be read with the
wrong scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from slidesnake.atomic import atomic_output

_PREFIX = "slidesnake."


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

    @property
    def tissue_fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    def geometry(self) -> dict[str, float | int]:
        """Everything but the pixels."""
        values = asdict(self)
        del values["mask"]
        return values


def save_mask(mask: TissueMask, path: str | Path) -> None:
    info = PngInfo()
    for key, value in mask.geometry().items():
        info.add_text(_PREFIX + key, repr(value))
    with atomic_output(path) as tmp:
        Image.fromarray(mask.mask.astype(np.uint8) * 255).save(tmp, format="PNG", pnginfo=info)


def load_mask(path: str | Path) -> TissueMask:
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("L")) > 127
        text = {k.removeprefix(_PREFIX): v for k, v in image.text.items() if k.startswith(_PREFIX)}
    geometry = {
        key: (int if key in {"slide_width", "slide_height", "read_level"} else float)(text[key])
        for key in TissueMask.__dataclass_fields__
        if key != "mask"
    }
    return TissueMask(mask=pixels, **geometry)
