"""The run's config over the workflow's defaults, with typed `snakemake --config` values.

A module, a snakedeploy deployment or a run from another directory gives only the keys it
changes; the rest come from the workflow's own config/config.yaml. Snakemake parses
`--config tiles={stride: 112}` with YAML's base loader, so nested values arrive as
strings ('112') and would fail schema validation; we re-read such strings as YAML
scalars, which is what the user typed.
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


def with_defaults(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`config` over `defaults`, section by section (a section is one level of keys)."""
    merged = dict(defaults)
    for key, value in config.items():
        default = defaults.get(key)
        both_sections = isinstance(value, dict) and isinstance(default, dict)
        merged[key] = {**default, **value} if both_sections else value
    return merged
