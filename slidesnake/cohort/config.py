"""The run's config: laid over the workflow's defaults, typed, and checked against the
schema with one line per problem.

A module, a snakedeploy deployment or a run from another directory gives only the keys it
changes; the rest come from the workflow's own config/config.yaml. Snakemake parses
`--config tiles={stride: 112}` with YAML's base loader, so nested values arrive as
strings ('112') and would fail schema validation; we re-read such strings as YAML
scalars, which is what the user typed.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import yaml

from slidesnake.errors import ConfigError


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


def check_config(config: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise one ConfigError with a line per schema violation, each naming its key."""
    validator = jsonschema.Draft202012Validator(schema)
    problems = sorted(validator.iter_errors(config), key=lambda error: list(error.path))
    if problems:
        raise ConfigError(
            "config:\n  " + "\n  ".join(f"{_key(p.path)}: {p.message}" for p in problems)
        )


def _key(path: Any) -> str:
    return ".".join(map(str, path)) or "(top level)"
