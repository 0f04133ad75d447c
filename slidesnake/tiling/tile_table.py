"""tiles.parquet: tile coordinates with the geometry they were made with.

The geometry travels in the file's key-value metadata, so the table alone says how to read
its tiles back, and downstream code never has to guess a magnification.
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
_SCHEMA = pa.schema([("x", pa.int64()), ("y", pa.int64()), ("tissue_fraction", pa.float32())])


def write_tiles(tiles: pd.DataFrame, geometry: TileGeometry, path: str | Path) -> None:
    table = pa.Table.from_pandas(tiles, schema=_SCHEMA, preserve_index=False)
    table = table.replace_schema_metadata({_METADATA_KEY: json.dumps(asdict(geometry))})
    with atomic_output(path) as tmp:
        pq.write_table(table, tmp)


def read_tiles(path: str | Path) -> tuple[pd.DataFrame, TileGeometry]:
    table = pq.read_table(path)
    geometry = TileGeometry(**json.loads(table.schema.metadata[_METADATA_KEY]))
    return table.to_pandas(), geometry
