"""Settings dataclasses built from a section of the workflow's config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Self


class ConfigSection:
    """Mixin for a frozen dataclass of one config section: the section also holds keys
    for other stages (tiles.* feeds the grid and the embedder), which are left out."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
