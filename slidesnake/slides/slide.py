"""An open whole-slide image: levels, resolution and RGB pixel reads.

OpenSlide opens every format it supports from local disk; a URL (s3://, gs://, https://)
is a TIFF slide read in place (see in_place_tiff); a DICOM series in a folder or on a
DICOMweb server is read through wsidicom (see dicom_wsi). This class adds what the workflow needs
on top: a resolved mpp, level choice by resolution, RGB numpy arrays with transparent
areas as white background, and errors that name the slide. Reads of tiled JPEG and JPEG
2000 TIFF levels skip OpenSlide's ARGB round trip (see tiff_tiles) wherever that gives
OpenSlide's own pixels; a slide read in place is read that way only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openslide

from slidesnake.errors import SlideError, SlideOpenError, SlideReadError
from slidesnake.slides import stores
from slidesnake.slides.dicom_wsi import DicomSeries, bound_failure, open_series
from slidesnake.slides.in_place_tiff import open_in_place
from slidesnake.slides.locator import SlideKind, shown, slide_kind
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
    """A slide opened with OpenSlide, read in place from a store, or a DICOM series read
    through wsidicom, with its level-0 mpp resolved. `path` is where it may be shown: a URL
    without credentials."""

    def __init__(self, path: str | Path, slide_id: str | None = None, mpp: float | None = None):
        kind = slide_kind(path)
        # A TIFF read in place holds no handle that a fork would share: loader workers
        # reuse it, index and all. OpenSlide's and wsidicom's handles must not cross one.
        self.in_place = kind is SlideKind.IN_PLACE_TIFF
        self.path: str | Path = shown(path)
        self.slide_id = slide_id or Path(str(self.path)).stem
        self._osr: openslide.OpenSlide | None = None
        self._dicom: DicomSeries | None = None
        self._tiff: TiffTiledLevels | None = None
        if kind.dicom:
            self._dicom = open_series(path, self.slide_id)
            self.properties = self._dicom.properties
            sizes, downsamples = self._dicom.level_dimensions, self._dicom.level_downsamples
        elif self.in_place:
            found = open_in_place(str(path), self.slide_id)
            self.properties, self._tiff = found.properties, found.tiled
            sizes, downsamples = found.level_dimensions, found.level_downsamples
        else:
            self._osr = self._open()
            self.properties = self._osr.properties
            sizes, downsamples = self._osr.level_dimensions, self._osr.level_downsamples
        self.mpp_info: Mpp = resolve_mpp(self.properties, mpp, self.slide_id, self.path)
        self.levels = tuple(
            Level(i, w, h, float(d))
            for i, ((w, h), d) in enumerate(zip(sizes, downsamples, strict=True))
        )
        if self._osr is not None:
            self._tiff = TiffTiledLevels.open(self.path, self.vendor, sizes)

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
        return self.properties.get("openslide.vendor", "unknown")

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

    def read(
        self, level: int, x: int, y: int, width: int, height: int, shrink: int = 1
    ) -> np.ndarray:
        """RGB uint8 pixels of `level`; (x, y) in level-0 px, size in `level` px (with
        `shrink`, in px of the level decoded at 1/`shrink`: see `tiled_level`).

        Transparent pixels (outside scanned areas) come back as white background.
        """
        tiled, d = self.tiled_level(level, shrink), self.levels[level].downsample * shrink
        if shrink > 1 and (tiled is None or x % d or y % d):
            raise ValueError(f"level {level} cannot be read at 1/{shrink} from ({x}, {y})")
        try:
            if tiled is not None and x % d == 0 and y % d == 0:
                return tiled.read(int(x // d), int(y // d), width, height)
            if self._dicom is not None:  # wsidicom: the nearest whole pixel of the level
                return self._dicom.read(level, round(x / d), round(y / d), width, height)
            if self._osr is None:  # in place: the nearest whole pixel of the level
                return self._tiff.levels[level].read(round(x / d), round(y / d), width, height)
            rgba = np.asarray(self._osr.read_region((x, y), level, (width, height)))
        except SlideError:
            raise  # the store's failure, already said
        except Exception as err:
            bounded = bound_failure(err, self.slide_id, str(self.path))  # a server's answer
            raise (bounded or self.read_error(level, x, y, err)) from None
        rgb = rgba[..., :3].copy()
        if rgba[..., 3].min() < 255:
            rgb[rgba[..., 3] == 0] = 255
        return rgb

    def tiled_level(self, level: int, shrink: int = 1) -> TiledLevel | None:
        """`level` as compressed tiles we decode ourselves, where that gives OpenSlide's
        pixels: a TIFF level of a codec we handle, at an integral downsample (OpenSlide
        resamples the others). Reads must also start on a whole pixel of the level.
        `shrink` 2, 4 or 8: its JPEG tiles decoded at that fraction of their size."""
        if self._tiff is None or not self.levels[level].downsample.is_integer():
            return None
        if shrink > 1:
            return self._tiff.scaled(level, shrink)
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

    @property
    def pinned(self) -> stores.SlideStat | None:
        """Read in place: the size and version every read of this slide is pinned to."""
        return self._tiff.ranges.stat if self.in_place else None

    def io_counts(self) -> tuple[int, int]:
        """Bytes read and requests made for compressed tiles (and, in place, the index)
        by this process so far."""
        if self._tiff is None:
            return 0, 0
        return self._tiff.ranges.bytes_read, self._tiff.ranges.requests

    def close(self) -> None:
        if self._osr is not None:
            self._osr.close()
        if self._dicom is not None:
            self._dicom.close()
        if self._tiff is not None:
            self._tiff.close()

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
