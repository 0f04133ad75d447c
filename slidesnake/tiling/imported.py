"""Tile coordinates made by another tool: TRIDENT's or CLAM's .h5, or a CSV or parquet of
x, y. They replace the tile grid for the slide; the result is an ordinary tiles.parquet
(with each tile's tissue fraction from our mask), so every later stage is unchanged.

Coordinates are level-0 pixels, top-left. An .h5 says its tile size (TRIDENT:
`patch_size_level0`; CLAM: `patch_size` at `patch_level`); it must be the size that
tiles.mpp and tiles.size give on this slide, or the embeddings would not be of the tiles
the user means.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pandas as pd

from slidesnake.errors import SlideError
from slidesnake.tiling.grid import TileGeometry, fractions_at
from slidesnake.tiling.mask_file import TissueMask

log = logging.getLogger(__name__)


class CoordsError(SlideError):
    """A slide's imported tile coordinates cannot be used as they are."""


def read_coords(
    path: str | Path, slide_id: str, level_downsamples: list[float]
) -> tuple[np.ndarray, int | None]:
    """(N x 2 int64 level-0 top-left coordinates, the file's level-0 tile size or None)."""
    path = Path(path)
    try:
        if path.suffix in (".h5", ".hdf5"):
            return _read_h5(path, slide_id, level_downsamples)
        table = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
        values = table[["x", "y"]].to_numpy()
    except (OSError, KeyError, ValueError) as err:
        raise CoordsError(
            slide_id, path, f"the coordinates cannot be read ({type(err).__name__}: {err})",
            "give TRIDENT's or CLAM's .h5 (dataset 'coords'), or a CSV/parquet with x and y",
        ) from None  # fmt: skip
    return _integers(values, slide_id, path), None


def _read_h5(
    path: Path, slide_id: str, level_downsamples: list[float]
) -> tuple[np.ndarray, int | None]:
    import h5py

    with h5py.File(path, "r") as f:
        dataset = f["coords"]
        values, attrs = dataset[:], dict(dataset.attrs)
    if "patch_size_level0" in attrs:
        size = int(attrs["patch_size_level0"])
    elif "patch_size" in attrs and "patch_level" in attrs:
        level = int(attrs["patch_level"])
        size = round(int(attrs["patch_size"]) * level_downsamples[level])
    else:
        size = None
    return _integers(values, slide_id, path), size


def _integers(values: np.ndarray, slide_id: str, path: Path) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] != 2:
        raise CoordsError(slide_id, path, f"coordinates of shape {values.shape}, not (N, 2)",
                          "give one x, y pair per tile")  # fmt: skip
    if not np.all(np.isfinite(values)) or not np.all(np.mod(values, 1) == 0):
        raise CoordsError(slide_id, path, "coordinates that are not whole level-0 pixels",
                          "give integer level-0 coordinates (top-left)")  # fmt: skip
    return values.astype(np.int64)


def imported_tiles(
    coords: np.ndarray,
    file_size: int | None,
    geometry: TileGeometry,
    mask: TissueMask,
    slide_id: str,
    path: str | Path,
) -> pd.DataFrame:
    """The tile table of imported coordinates: checked, duplicates dropped, with tissue."""
    size = geometry.size_level0
    if file_size is not None and abs(file_size - size) > 1:
        raise CoordsError(
            slide_id, path,
            f"its tiles are {file_size} level-0 px but tiles.mpp {geometry.target_mpp} and "
            f"tiles.size {geometry.size} give {size} px on this slide "
            f"({geometry.slide_mpp:.4g} µm/px)",
            "set tiles.mpp and tiles.size to what the coordinates were made with",
        )  # fmt: skip
    outside = (
        (coords[:, 0] < 0) | (coords[:, 1] < 0)
        | (coords[:, 0] + size > geometry.slide_width)
        | (coords[:, 1] + size > geometry.slide_height)
    )  # fmt: skip
    if outside.any():
        raise CoordsError(
            slide_id, path,
            f"{int(outside.sum())} of {len(coords)} tiles lie outside the slide "
            f"({geometry.slide_width} x {geometry.slide_height} level-0 px)",
            "check that the coordinates belong to this slide and are level-0 pixels",
        )  # fmt: skip
    unique, first = np.unique(coords, axis=0, return_index=True)
    if len(unique) < len(coords):
        log.warning("slide '%s': %d duplicate tiles in %s dropped",
                    slide_id, len(coords) - len(unique), path)  # fmt: skip
    kept = coords[np.sort(first)]  # the file's order, first occurrences
    return pd.DataFrame({
        "x": kept[:, 0], "y": kept[:, 1],
        "tissue_fraction": fractions_at(mask.mask, mask, kept[:, 0], kept[:, 1], size),
    })  # fmt: skip
