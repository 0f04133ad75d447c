"""tiles.parquet: tile coordinates with the geometry they were made with.

The geometry travels in the file's key-value metadata, so the table alone says how to read
its tiles back, and downstream code never has to guess a magnification. The artefact
filters that ran add their score columns, and their counts of tiles dropped go in the
metadata too.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from slidesnake.atomic import atomic_output
from slidesnake.tiling.grid import TileGeometry

_METADATA_KEY = b"slidesnake.geometry"
_DROPPED_KEY = b"slidesnake.dropped"
_COLUMNS = [("x", pa.int64()), ("y", pa.int64()), ("tissue_fraction", pa.float32())]
_SCORES = [("pen_fraction", pa.float32()), ("focus", pa.float32())]  # where a filter ran


def write_tiles(
    tiles: pd.DataFrame,
    geometry: TileGeometry,
    path: str | Path,
    dropped: dict[str, int] | None = None,
) -> None:
    """Write the tiles; `dropped` counts the tiles each artefact filter removed."""
    schema = pa.schema(_COLUMNS + [score for score in _SCORES if score[0] in tiles.columns])
    table = pa.Table.from_pandas(tiles, schema=schema, preserve_index=False)
    metadata = {_METADATA_KEY: json.dumps(asdict(geometry))}
    if dropped:
        metadata[_DROPPED_KEY] = json.dumps(dropped)
    table = table.replace_schema_metadata(metadata)
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)


def read_tiles(path: str | Path) -> tuple[pd.DataFrame, TileGeometry]:
    table = pq.read_table(path)
    geometry = TileGeometry(**json.loads(table.schema.metadata[_METADATA_KEY]))
    return table.to_pandas(), geometry


def read_dropped(path: str | Path) -> dict[str, int]:
    """How many tiles each artefact filter dropped (empty when none ran); reads the file's
    footer only."""
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata.get(_DROPPED_KEY, b"{}"))
