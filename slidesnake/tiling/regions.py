"""Regions of interest: a slide's GeoJSON annotations (as QuPath exports them) as a mask on
the tissue mask's grid, so that tiles are kept by their tissue fraction inside the
regions, computed exactly as without regions.

Polygons are rasterised by scanlines (`polygon_fill`), in time linear in the mask's
pixels plus the edges' crossings of its rows, with the mask's own pixel-centre rule.
Coordinates are level-0 pixels. The file is held to what a region file can be: a regular
file of bounded size whose Polygon and MultiPolygon geometries are rings of finite
numbers; anything else fails the slide with what is wrong, before any tile is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slidesnake.errors import SlideError, one_line
from slidesnake.side_files import MAX_BYTES, read_capped, side_file_problem
from slidesnake.tiling.mask_file import TissueMask
from slidesnake.tiling.polygon_fill import RingTooComplexError, fill_ring

Ring = np.ndarray  # (n, 2) level-0 x, y
Polygon = list[Ring]  # exterior ring, then holes

# Level-0 pixels: ten times the widest slide scanned; beyond it a number is not a position.
MAX_COORDINATE = 2.0**24


class RegionError(SlideError):
    """The slide's GeoJSON of regions does not parse, holds no region, or misses the slide."""


@dataclass(frozen=True)
class Regions:
    """The polygons to keep and the polygons to cut out of them."""

    include: list[Polygon]
    exclude: list[Polygon]


def read_regions(
    path: str | Path,
    slide_id: str,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> Regions:
    """The slide's regions: features whose classification is in `include` (all, when
    None) and not in `exclude`, and those in `exclude` to cut out."""

    def fail(problem: str, fix: str = "export the annotations again as GeoJSON") -> RegionError:
        return RegionError(slide_id, path, problem, fix)

    document = _document(path, fail)
    features = _features(document, fail)
    kept, cut = [], []
    for index, feature in enumerate(features):
        name = _classification(feature)
        try:
            polygons = _polygons(feature.get("geometry"))
        except ValueError as err:
            raise fail(f"feature {index} has a malformed geometry ({err})") from None
        if name in exclude:
            cut += polygons
        elif include is None or name in include:
            kept += polygons
    if not kept:
        raise fail(
            f"no Polygon or MultiPolygon region is included ({len(features)} features; "
            f"roi.include {list(include) if include is not None else 'all'})",
            "check the file and roi.include against the annotations' classifications",
        )
    return Regions(kept, cut)


def _document(path: str | Path, fail) -> Any:
    problem = side_file_problem(path, MAX_BYTES["regions"])
    if problem is not None:
        raise fail(f"the regions file {problem}", "give a GeoJSON file of the slide's regions")
    try:
        return json.loads(read_capped(path, MAX_BYTES["regions"]))
    except RecursionError:
        raise fail("the regions file is nested too deeply to be GeoJSON") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise fail(f"the regions file cannot be read as GeoJSON ({one_line(err)})") from None


def _features(document: Any, fail) -> list[dict[str, Any]]:
    if isinstance(document, dict) and document.get("type") == "FeatureCollection":
        features = document.get("features", [])
    elif isinstance(document, dict) and document.get("type") == "Feature":
        features = [document]
    else:
        features = document  # QuPath's "export as array"
    if not isinstance(features, list) or not all(isinstance(f, dict) for f in features):
        raise fail(
            "it is not GeoJSON of features (a FeatureCollection, a Feature, or a list of Features)"
        )
    return features


def _classification(feature: dict[str, Any]) -> str | None:
    properties = feature.get("properties")
    classification = properties.get("classification") if isinstance(properties, dict) else None
    if isinstance(classification, dict):
        classification = classification.get("name")
    return classification if isinstance(classification, str) else None


def _polygons(geometry: Any) -> list[Polygon]:
    """The geometry's polygons; none for other geometries (points, lines); ValueError for
    a Polygon or MultiPolygon that is not rings of finite [x, y] numbers."""
    if not isinstance(geometry, dict) or geometry.get("type") not in ("Polygon", "MultiPolygon"):
        return []
    coordinates = geometry.get("coordinates")
    polygons = [coordinates] if geometry["type"] == "Polygon" else coordinates
    if not isinstance(polygons, list) or not all(isinstance(p, list) and p for p in polygons):
        raise ValueError(f"a {geometry['type']} needs a list of rings")
    return [[_ring(ring) for ring in polygon] for polygon in polygons]


def _ring(ring: Any) -> Ring:
    if not isinstance(ring, list) or len(ring) < 3:
        raise ValueError("a ring needs at least 3 positions")
    if not all(isinstance(p, list) and 2 <= len(p) <= 3 for p in ring):
        raise ValueError("a position is [x, y]")
    if not all(type(v) in (int, float) for p in ring for v in p):  # bool is no coordinate
        raise ValueError("positions must be numbers")
    xy = np.array([p[:2] for p in ring], np.float64)
    if not np.all(np.abs(xy) <= MAX_COORDINATE):
        raise ValueError(f"a position is not finite or lies beyond {MAX_COORDINATE:.0f} px")
    return xy


def region_mask(regions: Regions, mask: TissueMask, slide_id: str, path: str | Path) -> np.ndarray:
    """(h, w) bool on the mask's grid: inside an included region and outside every
    excluded one. A region set that covers none of the slide fails the slide."""
    try:
        inside = _raster(regions.include, mask) & ~_raster(regions.exclude, mask)
    except RingTooComplexError as err:
        raise RegionError(
            slide_id, path, f"a region is too complex to rasterise on the mask ({err})",
            "simplify the annotations (QuPath: Simplify shape) and export them again",
        ) from None  # fmt: skip
    if not inside.any():
        raise RegionError(
            slide_id, path,
            f"the regions cover none of the slide ({mask.slide_width} x {mask.slide_height} "
            "level-0 px)",
            "check that the coordinates are level-0 pixels of this slide",
        )  # fmt: skip
    return inside


def _raster(polygons: Iterable[Polygon], mask: TissueMask) -> np.ndarray:
    """Pixels whose centre lies inside a polygon's exterior and outside its holes."""
    out = np.zeros(mask.mask.shape, bool)
    for exterior, *holes in polygons:
        area = _filled(exterior, mask)
        for hole in holes:
            area &= ~_filled(hole, mask)
        out |= area
    return out


def _filled(ring: Ring, mask: TissueMask) -> np.ndarray:
    # Mask pixel (r, c) covers level-0 [c, c + 1) * scale.
    return fill_ring(ring[:, 0] / mask.scale_x, ring[:, 1] / mask.scale_y, mask.mask.shape)
