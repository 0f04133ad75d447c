"""Which decode method a cohort's embedding jobs use when the config leaves it unset.

The method is part of what a tile's pixels are, so a cohort never mixes methods: a
results folder that holds no embeddings yet takes the default (scaled), one that does
keeps the method its embeddings record (exact for those written before the method was
recorded), and a method set in the config always wins. An upgrade therefore re-runs
nothing and reads no new slide of an old cohort another way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT = "scaled"
BEFORE_RECORDED = "exact"


def cohort_decode(setting: str | None, slides: str | Path) -> str:
    """The decode method for the jobs writing under `slides` (results/slides)."""
    if setting is not None:
        return setting
    attributes = _first_store_attributes(Path(slides))
    if attributes is None:
        return DEFAULT
    return attributes.get("decode", BEFORE_RECORDED)


def _first_store_attributes(slides: Path) -> dict | None:
    """The attributes of the first embeddings store found (a slide's, or with several
    models a model's), reading only as far as the first one."""
    try:
        folders = os.scandir(slides)
    except OSError:
        return None
    with folders:
        for folder in folders:
            slide = Path(folder.path)
            for store in (slide / "embeddings.zarr", *slide.glob("*/embeddings.zarr")):
                attributes = _attributes(store)
                if attributes is not None:
                    return attributes
    return None


def _attributes(store: Path) -> dict | None:
    try:
        return json.loads((store / "zarr.json").read_text()).get("attributes", {})
    except (OSError, ValueError, AttributeError):
        return None
