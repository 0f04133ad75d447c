"""Typed values for nested keys overridden with `snakemake --config`.

Snakemake parses `--config tiles={stride: 112}` with YAML's base loader, so nested values
arrive as strings ('112') and would fail schema validation. We re-read such strings as
YAML scalars, which is what the user typed.
"""

from __future__ import annotations

from typing import Any

import yaml


def typed_sections(config: dict[str, Any]) -> dict[str, Any]:
    """The config with string scalars inside its sections read as YAML numbers/bools/null."""
    return {
        key: _typed(value) if isinstance(value, dict) else value for key, value in config.items()
    }


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_typed(item) for item in value]
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            return value
        return parsed if parsed is None or isinstance(parsed, int | float | bool) else value
    return value
