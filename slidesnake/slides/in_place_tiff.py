"""A TIFF slide in a store, opened where it lies: its index read once, its tiles on demand.

OpenSlide reads only local files, so a slide given by URL is opened here, with tifffile
over the object's byte ranges, and described the way OpenSlide describes the same file
(vendor, level sizes and downsamples, the properties mpp comes from): the levels are the
tiled pages of its pyramid, and every one of them must be JPEG or JPEG 2000 tiles that
the same decoder as local slides reads (tiff_tiles), so a slide's pixels do not depend on
where it is kept.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import tifffile

from slidesnake.errors import SlideOpenError, one_line
from slidesnake.slides import stores
from slidesnake.slides.byte_ranges import RangeFile, RemoteRanges
from slidesnake.slides.tiff_tiles import CODECS, TiffTiledLevels, fits

_APERIO_MPP = re.compile(r"\|\s*MPP\s*=\s*([0-9.eE+-]+)")
_RESOLUTION_UNITS = {2: "inch", 3: "centimeter"}


@dataclass(frozen=True)
class InPlaceTiff:
    """What `Slide` needs of a slide read in place: OpenSlide-style properties and levels,
    and the decoder of its tiles."""

    properties: dict[str, str]
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    tiled: TiffTiledLevels


def open_in_place(url: str, slide_id: str) -> InPlaceTiff:
    """Open the TIFF slide at `url`; a format or layout it cannot read fails the slide with
    a line that says to copy it locally (where OpenSlide reads it) or convert it."""
    stores.check_format(url, slide_id)
    ranges = RemoteRanges(url, slide_id)
    damage = _Damage()
    tifffile_log = logging.getLogger("tifffile")
    tifffile_log.addHandler(damage)
    try:
        tiff = tifffile.TiffFile(RangeFile(ranges, stores.settings().block_kb * 1024))
        pages = _pyramid(tiff)
    except (tifffile.TiffFileError, ValueError, EOFError) as err:
        raise _not_readable(
            url, slide_id, f"it is not a TIFF file ({type(err).__name__})"
        ) from None
    finally:
        tifffile_log.removeHandler(damage)
    problem = damage.problem or _layout_problem(pages, ranges.size)
    if problem:
        tiff.close()
        raise _not_readable(url, slide_id, problem)
    dims = tuple((p.imagewidth, p.imagelength) for p in pages)
    w0, h0 = dims[0]
    downsamples = tuple((w0 / w + h0 / h) / 2 for w, h in dims)
    levels = TiffTiledLevels(tiff, dict(enumerate(pages)), ranges)
    return InPlaceTiff(_properties(pages[0]), dims, downsamples, levels)


def _pyramid(tiff: tifffile.TiffFile) -> list[tifffile.TiffPage]:
    """The pages of the main image, finest first: what OpenSlide calls the levels."""
    series = tiff.series[0] if tiff.series else None
    if series is None:
        return []
    return [level.keyframe for level in series.levels]


class _Damage(logging.Handler):
    """What tifffile logs, and reads past, while it parses a damaged index: an IFD offset
    past the end of the object drops the rest of the pyramid without an exception."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.problem: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.problem = self.problem or (
            f"its TIFF index is damaged ({one_line(record.getMessage(), 80)}); the object "
            "may be truncated (an interrupted upload or copy)"
        )


def _layout_problem(pages: list[tifffile.TiffPage], size: int) -> str | None:
    if not pages:
        return "it has no image"
    for index, page in enumerate(pages):
        spans = zip(page.dataoffsets, page.databytecounts, strict=True)
        end = max((offset + count for offset, count in spans), default=0)
        if end > size:
            return (
                f"it has {size} bytes but level {index}'s tiles reach byte {end}: it is "
                "truncated (an interrupted upload or copy)"
            )
        if not fits(page, (page.imagewidth, page.imagelength)):
            codec = CODECS.get(page.compression, f"TIFF compression {page.compression}")
            tiled = "tiled" if page.is_tiled else "not tiled (strips)"
            return (
                f"level {index} is {tiled}, {codec}, {page.samplesperpixel} samples of "
                f"{page.bitspersample} bits; in place we read tiled 8-bit RGB JPEG or "
                "JPEG 2000 levels only"
            )
    return None


def _properties(page: tifffile.TiffPage) -> dict[str, str]:
    """OpenSlide's properties of this slide that the workflow reads: vendor and mpp."""
    description = page.description or ""
    aperio = description.startswith("Aperio")
    properties = {"openslide.vendor": "aperio" if aperio else "generic-tiff"}
    match = _APERIO_MPP.search(description) if aperio else None
    if match:
        properties["openslide.mpp-x"] = properties["openslide.mpp-y"] = match.group(1)
    tags = page.tags
    unit = tags.get("ResolutionUnit")
    resolution = tags.get("XResolution")
    if unit is not None and resolution is not None and int(unit.value) in _RESOLUTION_UNITS:
        numerator, denominator = resolution.value
        properties["tiff.ResolutionUnit"] = _RESOLUTION_UNITS[int(unit.value)]
        properties["tiff.XResolution"] = str(numerator / denominator if denominator else 0)
    return properties


def _not_readable(url: str, slide_id: str, problem: str) -> SlideOpenError:
    return SlideOpenError(
        slide_id,
        stores.location(url),
        f"{problem}, so it cannot be read in place",
        "copy the slide to a local or shared filesystem and give that path (OpenSlide "
        "reads it there), or convert it to a pyramidal TIFF "
        "(vips tiffsave --tile --pyramid --compression jpeg)",
    )
