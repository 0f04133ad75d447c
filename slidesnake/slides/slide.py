"""An open whole-slide image: levels, resolution and RGB pixel reads.

OpenSlide opens every format it supports; this class adds what the workflow needs on top:
a resolved mpp, level choice by resolution, RGB numpy arrays with transparent areas as
white background, and errors that name the slide. Reads of tiled JPEG and JPEG 2000 TIFF
levels skip OpenSlide's ARGB round trip (see tiff_tiles) wherever that gives OpenSlide's
own pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openslide

from slidesnake.errors import SlideOpenError, SlideReadError
from slidesnake.slides.mpp import Mpp, resolve_mpp
from slidesnake.slides.tiff_tiles import TiffTiledLevels, TiledLevel

# A level this much coarser than asked still counts as "at" the asked resolution
# (a 0.499 µm/px scan serves 0.5 µm/px tiles from level 0).
LEVEL_TOLERANCE = 0.02


@dataclass(frozen=True)
class Level:
    """One pyramid level: its index, size in its own pixels and level-0 px per pixel."""

    index: int
    width: int
    height: int
    downsample: float


class Slide:
    """A slide opened with OpenSlide, with its level-0 mpp resolved."""

    def __init__(self, path: str | Path, slide_id: str | None = None, mpp: float | None = None):
        self.path = Path(path)
        self.slide_id = slide_id or self.path.stem
        self._osr = self._open()
        self.mpp_info: Mpp = resolve_mpp(self._osr.properties, mpp, self.slide_id, self.path)
        self.levels = tuple(
            Level(i, w, h, float(d))
            for i, ((w, h), d) in enumerate(
                zip(self._osr.level_dimensions, self._osr.level_downsamples, strict=True)
            )
        )
        self._tiff = TiffTiledLevels.open(self.path, self.vendor, self._osr.level_dimensions)

    def _open(self) -> openslide.OpenSlide:
        if not self.path.is_file():
            raise SlideOpenError(
                self.slide_id, self.path, "the file does not exist", "correct the path"
            )
        try:
            return openslide.OpenSlide(self.path)
        except openslide.OpenSlideUnsupportedFormatError:
            raise SlideOpenError(
                self.slide_id,
                self.path,
                "OpenSlide does not recognise this file as a whole-slide image",
                "convert it to a tiled pyramidal TIFF (e.g. vips tiffsave --tile --pyramid "
                "--compression jpeg) or remove it from the sample sheet",
            ) from None
        except openslide.OpenSlideError as err:
            raise SlideOpenError(
                self.slide_id,
                self.path,
                f"OpenSlide cannot open it ({err})",
                "the file is corrupt, truncated or uses an unsupported encoding; "
                "copy or export it again",
            ) from None

    @property
    def mpp(self) -> float:
        """Level-0 microns per pixel."""
        return self.mpp_info.value

    @property
    def dimensions(self) -> tuple[int, int]:
        """Level-0 (width, height) in pixels."""
        return self.levels[0].width, self.levels[0].height

    @property
    def vendor(self) -> str:
        return self._osr.properties.get("openslide.vendor", "unknown")

    def level_mpp(self, level: int) -> float:
        return self.mpp * self.levels[level].downsample

    def level_for_mpp(self, target_mpp: float) -> int:
        """The coarsest level that is not coarser than `target_mpp` (level 0 if none is)."""
        fine_enough = [
            lv.index
            for lv in self.levels
            if self.level_mpp(lv.index) <= target_mpp * (1 + LEVEL_TOLERANCE)
        ]
        return max(fine_enough, default=0)

    def read(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """RGB uint8 pixels of `level`; (x, y) in level-0 px, size in `level` px.

        Transparent pixels (outside scanned areas) come back as white background.
        """
        tiled, d = self.tiled_level(level), self.levels[level].downsample
        try:
            if tiled is not None and x % d == 0 and y % d == 0:
                return tiled.read(int(x // d), int(y // d), width, height)
            rgba = np.asarray(self._osr.read_region((x, y), level, (width, height)))
        except Exception as err:
            raise self.read_error(level, x, y, err) from None
        rgb = rgba[..., :3].copy()
        if rgba[..., 3].min() < 255:
            rgb[rgba[..., 3] == 0] = 255
        return rgb

    def tiled_level(self, level: int) -> TiledLevel | None:
        """`level` as compressed tiles we decode ourselves, where that gives OpenSlide's
        pixels: a TIFF level of a codec we handle, at an integral downsample (OpenSlide
        resamples the others). Reads must also start on a whole pixel of the level."""
        if self._tiff is None or not self.levels[level].downsample.is_integer():
            return None
        return self._tiff.levels.get(level)

    def read_error(self, level: int, x: int, y: int, err: Exception) -> SlideReadError:
        """The error of a read at level-0 (x, y) (OpenSlide's, or a decoder's on a corrupt
        tile), naming the slide and the place."""
        return SlideReadError(
            self.slide_id,
            self.path,
            f"pixels at level {level}, ({x}, {y}) could not be decoded ({err})",
            "the file is corrupt; copy or export it again, or remove it from the sample sheet",
        )

    def close(self) -> None:
        self._osr.close()
        if self._tiff is not None:
            self._tiff.close()

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
