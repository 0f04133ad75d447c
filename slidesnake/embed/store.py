"""embeddings.zarr: features and coordinates of one slide, written as they are computed.

Rows arrive out of order (several loader workers), so each zarr chunk is assembled in
memory and written once, when all its rows are in: no chunk is ever read back or
rewritten, and memory holds only the chunks in flight, whatever the slide size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zarr

from slidesnake.atomic import atomic_output
from slidesnake.errors import EmbeddingsError
from slidesnake.finite import require_finite

CHUNK_ROWS = 4096
FIX = (
    "check model.checkpoint's weights (or the server's model); values beyond float16's "
    "range need output.dtype float32"
)


class EmbeddingWriter:
    """Streams (rows, features) into a zarr v3 group at `path`."""

    def __init__(
        self,
        path: str | Path,
        coords: np.ndarray,
        dim: int,
        dtype: str,
        chunk_rows: int = CHUNK_ROWS,
    ) -> None:
        self.rows = len(coords)
        self.chunk_rows = chunk_rows
        self.group = zarr.create_group(store=str(path), zarr_format=3, overwrite=True)
        self.group.create_array("coords", data=np.asarray(coords, np.int64), chunks=(chunk_rows, 2))
        self.features = self.group.create_array(
            "features", shape=(self.rows, dim), chunks=(chunk_rows, dim), dtype=dtype
        )
        self._pending: dict[int, tuple[np.ndarray, int]] = {}
        self._written = 0

    def put(self, rows: np.ndarray, features: np.ndarray) -> None:
        """Place `features[i]` at row `rows[i]`; write every chunk that became complete.
        Features that are not finite in the store's dtype (fp16 overflows at 65504) fail
        the slide: the store is a temporary that is then removed."""
        with np.errstate(over="ignore"):  # an overflow becomes inf, which is refused next
            features = features.astype(self.features.dtype, copy=False)
        require_finite(features, f"the model's tile features ({self.features.dtype})", FIX)
        chunks = rows // self.chunk_rows
        for chunk in np.unique(chunks):
            here = chunks == chunk
            buffer, filled = self._pending.get(chunk) or (self._empty_chunk(chunk), 0)
            buffer[rows[here] - chunk * self.chunk_rows] = features[here]
            filled += int(here.sum())
            if filled == len(buffer):
                start = chunk * self.chunk_rows
                self.features[start : start + len(buffer)] = buffer
                self._pending.pop(chunk, None)
                self._written += len(buffer)
            else:
                self._pending[chunk] = (buffer, filled)

    def _empty_chunk(self, chunk: int) -> np.ndarray:
        rows = min(self.chunk_rows, self.rows - chunk * self.chunk_rows)
        return np.empty((rows, self.features.shape[1]), self.features.dtype)

    def finish(self, attributes: dict[str, Any]) -> None:
        """Check every row arrived, then record the attributes."""
        if self._written != self.rows or self._pending:
            raise RuntimeError(f"only {self._written} of {self.rows} embeddings were written")
        self.group.attrs.update(attributes)


def load_embeddings(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(features N x D, coords N x 2 level-0 top-left, attributes) of an embeddings.zarr.

    Only a finished store: a job's hidden temporary (`.embeddings.zarr.tmp-<pid>`) may be
    half-written, and attributes are written last, so a store without them is unfinished.
    """
    group = open_embeddings(path)
    return group["features"][:], group["coords"][:], dict(group.attrs)


def open_embeddings(path: str | Path) -> zarr.Group:
    """A finished store opened for reading, its arrays not read: for reading in chunks."""
    path = Path(path)
    if path.name.startswith(".") and ".tmp-" in path.name:
        raise EmbeddingsError(
            f"{path} is the temporary store of an embedding job that is running or was "
            f"killed, possibly half-written; read {path.parent / 'embeddings.zarr'} instead"
        )
    try:
        group = zarr.open_group(str(path), mode="r")
        if not dict(group.attrs):
            raise EmbeddingsError(f"{path} is not a finished embeddings store (no attributes)")
        if not {"features", "coords"} <= set(group.array_keys()):
            raise KeyError("features or coords")
        return group
    except (FileNotFoundError, KeyError, ValueError, zarr.errors.BaseZarrError) as err:
        raise EmbeddingsError(
            f"{path} is not an embeddings store slidesnake wrote ({type(err).__name__})"
        ) from None


def export_h5(zarr_path: str | Path, h5_path: str | Path) -> None:
    """Write the HDF5 layout TRIDENT and CLAM read: datasets `features` and `coords`."""
    import h5py

    features, coords, attributes = load_embeddings(zarr_path)
    try:
        with atomic_output(h5_path) as tmp, h5py.File(tmp, "w") as f:
            f.create_dataset("features", data=features)
            dataset = f.create_dataset("coords", data=coords)
            for key in ("patch_size_level0", "target_mpp", "slide_id"):
                if key in attributes:
                    dataset.attrs[key] = attributes[key]
    except OSError as err:
        raise EmbeddingsError(f"{h5_path} cannot be written ({err.strerror or err})") from None
