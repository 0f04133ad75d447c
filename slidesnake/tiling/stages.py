"""The workflow's stages as plain functions: one slide in, that slide's outputs written.

Each Snakemake rule script calls one of these; so can anyone without Snakemake.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from slidesnake.slides.lowres import read_lowres
from slidesnake.slides.slide import Slide
from slidesnake.tiling.artefacts import ArtefactParams, filter_artefacts
from slidesnake.tiling.grid import TileGeometry, TileParams, grid_tiles, tile_geometry
from slidesnake.tiling.imported import imported_tiles, max_tiles, read_coords
from slidesnake.tiling.mask_file import TissueMask, load_mask, save_mask
from slidesnake.tiling.pen import detect_pen
from slidesnake.tiling.qc import (
    DROPPED,
    PEN,
    REGION,
    draw_mask_contour,
    draw_tiles,
    load_picture,
    save_picture,
)
from slidesnake.tiling.regions import Regions, region_mask
from slidesnake.tiling.tile_table import write_tiles
from slidesnake.tiling.tissue import TissueParams, detect_tissue

log = logging.getLogger(__name__)


def make_tissue_mask(
    slide_path: str | Path,
    slide_id: str,
    mask_path: str | Path,
    qc_path: str | Path,
    params: TissueParams,
    sheet_mpp: float | None = None,
    pen: bool = False,
    decode: str = "exact",
) -> TissueMask:
    """Detect tissue at about `params.mpp`, and pen ink when `pen`; write the mask and its
    QC picture. `decode` as the loader's (`read_lowres`), recorded in the mask."""
    with Slide(slide_path, slide_id, sheet_mpp) as slide:
        log.info(
            "slide '%s': %s, %d x %d px, %d levels, %.4g µm/px (from %s)",
            slide_id,
            slide.vendor,
            *slide.dimensions,
            len(slide.levels),
            slide.mpp,
            slide.mpp_info.source,
        )
        lowres = read_lowres(slide, params.mpp, params.max_decode_mpx, decode)
        mask = TissueMask(
            mask=detect_tissue(lowres.rgb, lowres.mpp, params),
            mpp=lowres.mpp,
            scale_x=lowres.scale_x,
            scale_y=lowres.scale_y,
            slide_mpp=slide.mpp,
            slide_width=slide.dimensions[0],
            slide_height=slide.dimensions[1],
            read_level=lowres.level,
            pen=detect_pen(lowres.rgb, lowres.mpp) if pen else None,
            decode=decode,
        )
    log.info(
        "mask %d x %d px at %.3g µm/px from level %d: %.1f%% tissue",
        mask.mask.shape[1],
        mask.mask.shape[0],
        mask.mpp,
        mask.read_level,
        100 * mask.tissue_fraction,
    )
    save_mask(mask, mask_path)
    picture = draw_mask_contour(lowres.rgb, mask.mask)
    if mask.pen is not None:
        log.info("pen ink on %.1f%% of the slide", 100 * mask.pen.mean())
        picture = draw_mask_contour(picture, mask.pen, PEN)
    save_picture(picture, qc_path)
    return mask


def make_tile_coords(
    slide_path: str | Path,
    slide_id: str,
    mask_path: str | Path,
    mask_qc_path: str | Path,
    tiles_path: str | Path,
    qc_path: str | Path,
    params: TileParams,
    regions: Regions | None = None,
    regions_path: str | Path | None = None,
    coords_path: str | Path | None = None,
    artefacts: ArtefactParams | None = None,
) -> int:
    """Lay the tile grid and keep tiles on tissue (inside `regions`, when given: the tissue
    fraction then counts tissue inside them), or take the tiles of `coords_path` (another
    tool's coordinates) as they are; drop the tiles the artefact filters that are on find;
    write tiles.parquet and its QC picture."""
    mask = load_mask(mask_path)
    inside = None
    if regions is not None:
        inside = region_mask(regions, mask, slide_id, regions_path)
        mask = replace(mask, mask=mask.mask & inside)
    with Slide(slide_path, slide_id, mask.slide_mpp) as slide:
        read_level = slide.level_for_mpp(params.mpp)
        geometry = tile_geometry(mask, params, read_level, slide.levels[read_level].downsample)
        if coords_path:
            downsamples = [level.downsample for level in slide.levels]
            limit = max_tiles(geometry)
            coords, size = read_coords(coords_path, slide_id, downsamples, limit)
            tiles = imported_tiles(coords, size, geometry, mask, slide_id, coords_path)
            geometry = replace(geometry, coords_source=str(Path(coords_path).resolve()))
        else:
            tiles = grid_tiles(mask, geometry)
        _log_tiles(slide_id, tiles, geometry, mask)
        filtered = filter_artefacts(
            tiles, artefacts or ArtefactParams(), mask, geometry, slide, mask_path
        )
    write_tiles(filtered.kept, geometry, tiles_path, filtered.counts)
    picture = load_picture(mask_qc_path)
    if inside is not None:
        picture = draw_mask_contour(picture, inside, REGION)
    if not filtered.dropped.empty:
        picture = draw_tiles(picture, filtered.dropped, geometry.size_level0, mask, DROPPED)
    save_picture(draw_tiles(picture, filtered.kept, geometry.size_level0, mask), qc_path)
    return len(filtered.kept)


def _log_tiles(slide_id: str, tiles, geometry: TileGeometry, mask: TissueMask) -> None:
    if tiles.empty:
        log.warning(
            "slide '%s': no tile reaches mask_threshold %.2f (%.1f%% of the slide is tissue); "
            "writing an empty tile table",
            slide_id, geometry.mask_threshold, 100 * mask.tissue_fraction,
        )  # fmt: skip
        return
    log.info(
        "slide '%s': %d tiles of %d px at %.3g µm/px (%d level-0 px, read from level %d)%s",
        slide_id, len(tiles), geometry.size, geometry.target_mpp, geometry.size_level0,
        geometry.read_level,
        f", coordinates from {geometry.coords_source}" if geometry.coords_source else "",
    )  # fmt: skip
