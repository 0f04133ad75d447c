"""The run's config: laid over the workflow's defaults, typed, checked against the schema
with one line per problem, and its numbers put in the type each setting means.

A module, a snakedeploy deployment or a run from another directory gives only the keys it
changes; the rest come from the workflow's own config/config.yaml. Snakemake parses
`--config tiles={stride: 112}` with YAML's base loader, so nested values arrive as
strings ('112') and would fail schema validation; such a string is re-read as a YAML
scalar, which is what the user typed, but only where the schema does not take a string:
a class name "1" or "yes" stays the string it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from slidesnake.errors import ConfigError
from slidesnake.side_files import MAX_BYTES, side_file_problem

# The checkout: its config/config.yaml holds the defaults, its workflow/schemas the schema.
REPO = Path(__file__).resolve().parents[2]

Schema = dict[str, Any]


def typed_sections(config: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """The config with its string scalars read as YAML numbers, booleans or null wherever
    the schema wants one of those and not a string."""
    return _walk(config, schema, schema, _yaml_scalar)


def _walk(value: Any, node: Schema | None, root: Schema, scalar: Callable) -> Any:
    """`value` with `scalar(leaf, the types its schema allows)` in place of each leaf."""
    if isinstance(value, dict):
        return {k: _walk(item, _child(node, root, k), root, scalar) for k, item in value.items()}
    if isinstance(value, list):
        return [_walk(item, _items(node, root), root, scalar) for item in value]
    return scalar(value, _types(node, root))


def _yaml_scalar(value: Any, types: set[str]) -> Any:
    if not isinstance(value, str):
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    if parsed is not None and not isinstance(parsed, int | float | bool):
        return value
    if "string" not in types:
        return parsed
    return None if parsed is None and "null" in types else value


def _resolve(node: Schema | None, root: Schema) -> Schema:
    while node and "$ref" in node:
        node = root["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return node or {}


def _child(node: Schema | None, root: Schema, key: str) -> Schema | None:
    """The subschema of `key` in an object's schema: its own properties, those of what
    it refers to ($ref beside them), or the schema of any other key."""
    parts = list(_parts(node, root))
    for part in parts:
        if key in part.get("properties", {}):
            return part["properties"][key]
    extra = [part["additionalProperties"] for part in parts if "additionalProperties" in part]
    return extra[0] if extra and isinstance(extra[0], dict) else None


def _parts(node: Schema | None, root: Schema) -> Iterator[Schema]:
    while node:
        yield node
        ref = node.get("$ref")
        node = root["$defs"][ref.rsplit("/", 1)[-1]] if ref else None


def _items(node: Schema | None, root: Schema) -> Schema | None:
    return _resolve(node, root).get("items")


def _types(node: Schema | None, root: Schema) -> set[str]:
    """The JSON types a (sub)schema accepts; every type when it says nothing."""
    node = _resolve(node, root)
    if not node:
        return {"string", "number", "integer", "boolean", "null", "array", "object"}
    declared = node.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or ())
    for option in node.get("oneOf", []) + node.get("anyOf", []):
        types |= _types(option, root)
    for constant in node.get("enum", []):
        types.add("string" if isinstance(constant, str) else "number")
    return types


def with_defaults(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`config` over `defaults`, section by section (a section is one level of keys); each
    entry of `models:` over the default `model:` section (not the run's: a checkpoint set
    for one model must not become another's), and its `remote:` over the run's (a served
    model of the list names its own server and model there)."""
    merged = dict(defaults)
    for key, value in config.items():
        default = defaults.get(key)
        both_sections = isinstance(value, dict) and isinstance(default, dict)
        merged[key] = {**default, **value} if both_sections else value
    if isinstance(merged.get("models"), dict):
        merged["models"] = {
            key: _model_entry(entry, defaults["model"], merged["remote"])
            for key, entry in merged["models"].items()
        }
    return merged


def _model_entry(entry: Any, model: dict[str, Any], remote: Any) -> Any:
    if not isinstance(entry, dict):
        return entry  # the schema says what is wrong with it
    merged = {**model, **entry}
    if isinstance(entry.get("remote"), dict) and isinstance(remote, dict):
        merged["remote"] = {**remote, **entry["remote"]}
    return merged


def check_config(config: dict[str, Any], schema: Schema) -> None:
    """Raise one ConfigError with a line per problem, each naming its key: every schema
    violation, and every NaN or infinity (JSON Schema compares them as numbers, and NaN
    passes any minimum and maximum)."""
    not_finite = [
        (path, f"{value} is not a finite number; give one")
        for path, value in _leaves(config, [])
        if isinstance(value, float) and not math.isfinite(value)
    ]
    said = {_key(path) for path, _ in not_finite}
    validator = jsonschema.Draft202012Validator(schema)
    problems = not_finite + [
        (list(p.path), _message(p))
        for p in validator.iter_errors(config)
        if _key(p.path) not in said
    ]
    if problems:
        lines = [f"{_key(path)}: {message}" for path, message in sorted(problems, key=_order)]
        raise ConfigError("config:\n  " + "\n  ".join(lines))


# Limits whose message would quote the whole value: said by its size and the limit.
_LIMITS = {
    "maxProperties": ("entries", "at most"),
    "minProperties": ("entries", "at least"),
    "maxItems": ("items", "at most"),
    "minItems": ("items", "at least"),
    "maxLength": ("characters", "at most"),
    "minLength": ("characters", "at least"),
}
SHOWN_CHARS = 80


def _message(error: jsonschema.ValidationError) -> str:
    """The schema's message, with a value too long to read in a line cut short: a
    section of fifty models would otherwise fill a screen and hide the limit."""
    if error.validator in _LIMITS and hasattr(error.instance, "__len__"):
        unit, bound = _LIMITS[error.validator]
        return f"has {len(error.instance)} {unit}; {bound} {error.validator_value} allowed"
    shown = repr(error.instance)
    if len(shown) <= SHOWN_CHARS:
        return error.message
    return error.message.replace(shown, f"{shown[: SHOWN_CHARS - 20]}… ({len(shown)} characters)")


def _order(problem: tuple[list, str]) -> list[str]:
    return [str(part) for part in problem[0]]


def _leaves(value: Any, path: list) -> Iterator[tuple[list, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, [*path, key])
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, [*path, index])
    else:
        yield path, value


def whole_numbers(config: dict[str, Any], schema: Schema) -> dict[str, Any]:
    """The (checked) config with integer settings as ints: JSON Schema takes 32.0 as an
    integer, so `batch_size: 32.0` passes it, and a job would then fail on a float; params
    built from the same values make 32.0 and 32 the same run."""
    return _walk(config, schema, schema, _whole_scalar)


def _whole_scalar(value: Any, types: set[str]) -> Any:
    integer = "integer" in types and "number" not in types
    return int(value) if integer and isinstance(value, float) and value.is_integer() else value


def _key(path: Any) -> str:
    return ".".join(map(str, path)) or "(top level)"


# The files the config names: (section, key, the most bytes one may hold).
CONFIG_FILES = (
    ("model", "checkpoint", None),
    ("head", "checkpoint", MAX_BYTES["head"]),
    ("slide", "encoder", None),
)


def check_config_files(config: dict[str, Any]) -> None:
    """Before any job: every file the config names is a regular file of a size its kind
    can have (a FIFO would block every job, /dev/zero be read until memory runs out)."""
    models = {f"models.{key}": entry for key, entry in (config.get("models") or {}).items()}
    named = [(section, key, config[section], max_bytes) for section, key, max_bytes in CONFIG_FILES]
    named += [(name, "checkpoint", entry, None) for name, entry in models.items()]
    problems = []
    for section, key, values, max_bytes in named:
        path = values[key]
        if section.startswith("model") and (values["backend"] == "remote" or not path):
            continue  # the server's business, or the model's hub id
        if not path or str(path).startswith("hf-hub:"):
            continue
        problem = side_file_problem(path, max_bytes)
        if problem is not None:
            problems.append(f"{section}.{key}: {path} {problem}; correct the path")
    if problems:
        raise ConfigError("config:\n  " + "\n  ".join(problems))


def load_config(configfiles: list[Path]) -> dict[str, Any]:
    """The run's config as the workflow makes it: the files given, over the defaults."""
    config: dict[str, Any] = {}
    for path in configfiles:
        config.update(yaml.safe_load(path.read_text()) or {})
    defaults = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    config = with_defaults(typed_sections(config, schema), defaults)
    check_config(config, schema)
    return whole_numbers(config, schema)
