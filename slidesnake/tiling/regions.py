"""Regions of interest: a slide's GeoJSON annotations (as QuPath exports them) as a mask on
the tissue mask's grid, so that tiles are kept by their tissue fraction inside the
regions, computed exactly as without regions.

Polygons are rasterised with scikit-image's polygon drawing, already a dependency of the
mask stage: no second geometry stack for one operation, and its pixel-centre rule is the
one the mask itself follows. Coordinates are level-0 pixels.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from skimage.draw import polygon as fill_polygon

from slidesnake.errors import SlideError
from slidesnake.tiling.mask_file import TissueMask

Ring = np.ndarray  # (n, 2) level-0 x, y
Polygon = list[Ring]  # exterior ring, then holes


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

    def fail(problem: str, fix: str) -> RegionError:
        return RegionError(slide_id, path, problem, fix)

    try:
        document = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(f"the regions file cannot be read as GeoJSON ({err})",
                   "export the annotations again as GeoJSON") from None  # fmt: skip
    features = _features(document)
    kept, cut = [], []
    for feature in features:
        name = _classification(feature)
        polygons = _polygons(feature.get("geometry"))
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


def _features(document: Any) -> list[dict[str, Any]]:
    if isinstance(document, dict) and document.get("type") == "FeatureCollection":
        return [f for f in document.get("features", []) if isinstance(f, dict)]
    if isinstance(document, dict) and document.get("type") == "Feature":
        return [document]
    if isinstance(document, list):  # QuPath's "export as array"
        return [f for f in document if isinstance(f, dict)]
    return []


def _classification(feature: dict[str, Any]) -> str | None:
    classification = (feature.get("properties") or {}).get("classification")
    if isinstance(classification, dict):
        return classification.get("name")
    return classification if isinstance(classification, str) else None


def _polygons(geometry: Any) -> list[Polygon]:
    if not isinstance(geometry, dict):
        return []
    rings = {"Polygon": [geometry.get("coordinates")], "MultiPolygon": geometry.get("coordinates")}
    found = []
    for polygon in rings.get(geometry.get("type")) or []:
        try:
            found.append([np.asarray(ring, np.float64)[:, :2] for ring in polygon])
        except (TypeError, ValueError, IndexError):
            continue
    return [p for p in found if p and all(ring.ndim == 2 and len(ring) >= 3 for ring in p)]


def region_mask(regions: Regions, mask: TissueMask, slide_id: str, path: str | Path) -> np.ndarray:
    """(h, w) bool on the mask's grid: inside an included region and outside every
    excluded one. A region set that covers none of the slide fails the slide."""
    inside = _raster(regions.include, mask) & ~_raster(regions.exclude, mask)
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
    area = np.zeros(mask.mask.shape, bool)
    # Mask pixel (r, c) covers level-0 [c, c + 1) * scale; its centre is c + 0.5 there.
    rows = ring[:, 1] / mask.scale_y - 0.5
    cols = ring[:, 0] / mask.scale_x - 0.5
    rr, cc = fill_polygon(rows, cols, shape=area.shape)
    area[rr, cc] = True
    return area
