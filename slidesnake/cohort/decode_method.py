"""Which decode method a cohort's embedding jobs use when the config leaves it unset.

The method is part of what a tile's pixels are (and a mask's), so a cohort never mixes
methods: a results folder that holds no embeddings and no masks yet takes the default
(scaled), one that does keeps the method its embeddings record, or else its masks
(exact for those written before the method was recorded), and a method set in the
config always wins. An upgrade therefore re-runs nothing and reads no new slide of an
old cohort another way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slidesnake.tiling.mask_file import mask_decode

DEFAULT = "scaled"
BEFORE_RECORDED = "exact"


def configured(config: Mapping[str, Any]) -> str:
    """The method a job's config names (unset, as the embedding settings read it: exact)."""
    return (config.get("loader") or {}).get("decode") or BEFORE_RECORDED


def cohort_decode(setting: str | None, slides: str | Path) -> str:
    """The decode method for the jobs writing under `slides` (results/slides)."""
    if setting is not None:
        return setting
    attributes = _first_store_attributes(Path(slides))
    if attributes is not None:
        return attributes.get("decode", BEFORE_RECORDED)
    mask = next(Path(slides).glob("*/tissue_mask.png"), None)  # masked, nothing embedded
    return DEFAULT if mask is None else _mask_decode(mask)


def _mask_decode(mask: Path) -> str:
    try:
        return mask_decode(mask)
    except (OSError, ValueError):  # unreadable: its own job says so
        return DEFAULT


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
