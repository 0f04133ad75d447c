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

from slidesnake.errors import SlideError, one_line
from slidesnake.side_files import MAX_BYTES, side_file_problem
from slidesnake.tiling.grid import TileGeometry, fractions_at
from slidesnake.tiling.mask_file import TissueMask

log = logging.getLogger(__name__)


class CoordsError(SlideError):
    """A slide's imported tile coordinates cannot be used as they are."""


class CoordsProblem(ValueError):
    """What is wrong in a coordinates file, said in full (CoordsError adds the file)."""


FORMATS = "TRIDENT's or CLAM's .h5 (dataset 'coords'), or a CSV/parquet with x and y"
# A slide holds (W / s) x (H / s) tiles of side s side by side; overlapping grids down to a
# quarter-tile stride hold 16 times as many. A file declaring more is not of this slide.
OVERLAP = 16
# Level-0 pixels: far beyond any slide, still exact in float64 and safe to add in int64.
MAX_COORDINATE = 2**40


def max_tiles(geometry: TileGeometry) -> int:
    """The most tiles a coordinates file of this slide can hold."""
    size = max(geometry.size_level0, 1)
    return OVERLAP * (geometry.slide_width // size + 1) * (geometry.slide_height // size + 1)


def read_coords(
    path: str | Path, slide_id: str, level_downsamples: list[float], limit: int
) -> tuple[np.ndarray, int | None]:
    """(N x 2 int64 level-0 top-left coordinates, the file's level-0 tile size or None).
    A file that declares more than `limit` tiles is refused before they are read."""
    path = Path(path)

    def fail(problem: str, fix: str = f"give {FORMATS}") -> CoordsError:
        return CoordsError(slide_id, path, problem, fix)

    problem = side_file_problem(path, MAX_BYTES["coordinates"])
    if problem is not None:
        raise fail(f"the coordinates file {problem}")
    try:
        if path.suffix in (".h5", ".hdf5"):
            values, size = _read_h5(path, level_downsamples, limit)
        else:
            values, size = _read_table(path, limit), None
    except CoordsProblem as err:
        raise fail(str(err)) from None
    except (OSError, KeyError, ValueError, TypeError, RecursionError) as err:
        problem = f"{type(err).__name__}: {one_line(err)}"
        raise fail(f"the coordinates cannot be read ({problem})") from None
    return _integers(values, fail), size


def _read_table(path: Path, limit: int) -> np.ndarray:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(path).metadata.num_rows
        _check_count(rows, limit)
        table = pd.read_parquet(path, columns=["x", "y"])
    else:
        try:
            table = pd.read_csv(path, usecols=["x", "y"])
        except pd.errors.EmptyDataError:
            raise CoordsProblem("the CSV is empty; it needs columns x and y") from None
        _check_count(len(table), limit)
    return table[["x", "y"]].to_numpy()


def _read_h5(
    path: Path, level_downsamples: list[float], limit: int
) -> tuple[np.ndarray, int | None]:
    import h5py

    with h5py.File(path, "r") as f:
        link = f.get("coords", getlink=True)
        if link is None:
            raise CoordsProblem("it has no dataset 'coords'")
        if not isinstance(link, h5py.HardLink):
            raise CoordsProblem(f"'coords' is a {type(link).__name__}, not a dataset of the file")
        dataset = f["coords"]
        if not isinstance(dataset, h5py.Dataset):
            raise CoordsProblem("'coords' is a group, not a dataset")
        if dataset.is_virtual or dataset.external:
            raise CoordsProblem("'coords' keeps its data in other files (virtual or external)")
        if len(dataset.shape) != 2 or dataset.shape[1] != 2:
            raise CoordsProblem(f"coordinates of shape {dataset.shape}, not (N, 2)")
        _check_count(dataset.shape[0], limit)
        size = _tile_size(dict(dataset.attrs), level_downsamples)
        return dataset[:], size


def _check_count(rows: int, limit: int) -> None:
    if rows > limit:
        raise CoordsProblem(
            f"it declares {rows:,} tiles, more than this slide can hold ({limit:,})"
        )


def _tile_size(attrs: dict, level_downsamples: list[float]) -> int | None:
    """The level-0 tile size an .h5 declares: TRIDENT's patch_size_level0, or CLAM's
    patch_size at patch_level."""
    if "patch_size_level0" in attrs:
        return _whole_attribute(attrs, "patch_size_level0", 1)
    if "patch_size" in attrs and "patch_level" in attrs:
        level = _whole_attribute(attrs, "patch_level", 0)
        if level >= len(level_downsamples):
            raise CoordsProblem(
                f"attribute patch_level {level} names no level of the slide "
                f"({len(level_downsamples)} levels)"
            )
        return round(_whole_attribute(attrs, "patch_size", 1) * level_downsamples[level])
    return None


def _whole_attribute(attrs: dict, name: str, minimum: int) -> int:
    value = np.asarray(attrs[name])
    if value.size != 1 or value.dtype.kind not in "iuf":
        raise CoordsProblem(f"attribute {name} is {value!r}, not a number")
    number = value.reshape(()).item()
    if not (np.isfinite(number) and number == int(number) and minimum <= number <= MAX_COORDINATE):
        raise CoordsProblem(f"attribute {name} is {number}, not a whole number >= {minimum}")
    return int(number)


def _integers(values: np.ndarray, fail) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] != 2:
        raise fail(
            f"coordinates of shape {values.shape}, not (N, 2)", "give one x, y pair per tile"
        )
    if values.dtype.kind not in "iuf":
        raise fail(f"coordinates of type {values.dtype}, not numbers",
                   "give integer level-0 coordinates (top-left)")  # fmt: skip
    whole = np.all(np.isfinite(values)) and np.all(np.mod(values, 1) == 0)
    if not whole or np.any(np.abs(values) > MAX_COORDINATE):
        raise fail("coordinates that are not whole level-0 pixels within the slide's reach",
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
    # |coords| <= MAX_COORDINATE: no sum below can overflow.
    outside = (
        (coords[:, 0] < 0) | (coords[:, 1] < 0)
        | (coords[:, 0] > geometry.slide_width - size)
        | (coords[:, 1] > geometry.slide_height - size)
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
