"""Artefact filters: tiles under pen ink, or out of focus, are scored and dropped.

Each filter is off unless its threshold is set, and costs nothing when off. A filter that
is on adds its score as a column of tiles.parquet (pen_fraction, focus), so a user can
choose a threshold from the scores of the tiles kept; the tiles it drops are counted in
the table's metadata and drawn in the QC picture.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from slidesnake.errors import SlideError
from slidesnake.slides.slide import Slide
from slidesnake.tiling.config_section import ConfigSection
from slidesnake.tiling.focus import focus_scores
from slidesnake.tiling.grid import TileGeometry, fractions_at
from slidesnake.tiling.mask_file import TissueMask

log = logging.getLogger(__name__)


class ArtefactError(SlideError):
    """A slide's artefact filter cannot run as configured."""


@dataclass(frozen=True)
class ArtefactParams(ConfigSection):
    """The config's artefacts section: None switches a filter off."""

    max_pen_fraction: float | None = None  # drop tiles with more of their area under ink
    min_focus: float | None = None  # drop tiles whose focus score is lower
    focus_mpp: float = 2.0  # resolution the focus score is computed at

    @property
    def pen(self) -> bool:
        """Whether the mask stage looks for pen ink."""
        return self.max_pen_fraction is not None


@dataclass(frozen=True)
class Filtered:
    """The tiles kept, the tiles dropped, and how many each filter dropped."""

    kept: pd.DataFrame
    dropped: pd.DataFrame
    counts: dict[str, int]


def filter_artefacts(
    tiles: pd.DataFrame,
    params: ArtefactParams,
    mask: TissueMask,
    geometry: TileGeometry,
    slide: Slide,
    mask_path: str | Path,
) -> Filtered:
    """Score the tiles with each filter that is on, then drop those past its threshold
    (a tile under ink and out of focus counts as pen)."""
    tiles = tiles.copy()
    drop, counts = pd.Series(False, index=tiles.index), {}
    if params.pen:
        tiles["pen_fraction"] = _pen_fractions(tiles, mask, geometry, slide.slide_id, mask_path)
        drop |= tiles["pen_fraction"] > params.max_pen_fraction
        counts["pen"] = int(drop.sum())
    if params.min_focus is not None:
        tiles["focus"] = focus_scores(slide, tiles, geometry.size_level0, params.focus_mpp)
        blurred = (tiles["focus"] < params.min_focus) & ~drop
        counts["focus"] = int(blurred.sum())
        drop |= blurred
    if counts:
        log.info("slide '%s': artefact filters dropped %s of %d tiles", slide.slide_id,
                 ", ".join(f"{n} ({name})" for name, n in counts.items()), len(tiles))  # fmt: skip
    return Filtered(tiles[~drop].reset_index(drop=True), tiles[drop], counts)


def _pen_fractions(
    tiles: pd.DataFrame, mask: TissueMask, geometry: TileGeometry, slide_id: str, mask_path
) -> pd.Series:
    if mask.pen is None:
        raise ArtefactError(
            slide_id,
            mask_path,
            "artefacts.max_pen_fraction is set but this tissue mask has no pen layer",
            "re-run the mask stage with artefacts.max_pen_fraction set (the workflow does)",
        )
    xs, ys = tiles["x"].to_numpy(), tiles["y"].to_numpy()
    return pd.Series(fractions_at(mask.pen, mask, xs, ys, geometry.size_level0), tiles.index)
