"""Hostile settings: numbers that are not numbers, names that collide, spellings that are
the same setting. Each is refused (or settled) before any job, with one line naming its key.
"""

from __future__ import annotations

import math

import pytest
import yaml
from conftest import REPO

from slidesnake.aggregate.class_names import check_class_names
from slidesnake.cohort.config import check_config, typed_sections, whole_numbers, with_defaults
from slidesnake.cohort.rule_params import embedding_params, tile_params
from slidesnake.errors import ConfigError

SCHEMA = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
DEFAULTS = yaml.safe_load((REPO / "config/config.yaml").read_text())


def settled(overrides: dict) -> dict:
    """What common.smk makes of `overrides` (as --config or a config file gives them)."""
    config = with_defaults(typed_sections(overrides, SCHEMA), DEFAULTS)
    check_config(config, SCHEMA)
    return whole_numbers(config, SCHEMA)


def problems(overrides: dict) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        settled(overrides)
    return [line.strip() for line in str(raised.value).splitlines()[1:]]


def numeric_settings(node: dict, path: str = "") -> list[tuple[str, dict]]:
    node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node
    found = []
    types = node.get("type", [])
    if {"number", "integer"} & set([types] if isinstance(types, str) else types):
        found.append((path, node))
    for key, child in node.get("properties", {}).items():
        found += numeric_settings(child, f"{path}.{key}".lstrip("."))
    if isinstance(node.get("items"), dict):
        found += numeric_settings(node["items"], f"{path}[]")
    return found


def test_every_numeric_setting_has_a_range():
    settings = numeric_settings(SCHEMA)
    assert len(settings) > 25
    for path, node in settings:
        assert "maximum" in node or "exclusiveMaximum" in node, path
        assert "minimum" in node or "exclusiveMinimum" in node, path


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("artefacts", "max_pen_fraction", ".nan"),
        ("artefacts", "min_focus", ".nan"),
        ("artefacts", "focus_mpp", ".inf"),
        ("tiles", "mask_threshold", ".nan"),
        ("tiles", "mpp", "-.inf"),
        ("remote", "timeout_s", ".inf"),
        ("embed", "watchdog_s", ".nan"),
    ],
)
def test_nan_and_infinities_are_refused_before_any_job(section, key, value):
    # As --config gives them (strings), and as a config file does (floats).
    for spelled in (value, yaml.safe_load(value)):
        lines = problems({section: {key: spelled}})
        assert lines == [f"{section}.{key}: {yaml.safe_load(value)} is not a finite number; "
                         "give one"]  # fmt: skip


def test_a_setting_that_would_never_end_is_out_of_range():
    assert problems({"artefacts": {"focus_mpp": 1e9}}) == [
        "artefacts.focus_mpp: 1000000000.0 is greater than the maximum of 16"
    ]


@pytest.mark.parametrize(
    ("section", "key"), [("tiles", "size"), ("model", "batch_size"), ("tiles", "mpp")]
)
def test_booleans_are_not_numbers(section, key):
    for value in (True, "true", "yes"):
        (line,) = problems({section: {key: value}})
        assert line.startswith(f"{section}.{key}: True is not of type")


def test_quoted_strings_that_look_like_numbers_stay_strings():
    config = settled({
        "head": {"classes": ["1", "yes", "null"]},
        "roi": {"include": ["1", "no"], "exclude": ["0.5"]},
    })  # fmt: skip
    assert config["head"]["classes"] == ["1", "yes", "null"]
    assert config["roi"] == {"include": ["1", "no"], "exclude": ["0.5"]}
    # Settings that take no string still get the YAML type the user typed.
    assert settled({"tiles": {"stride": "112"}})["tiles"]["stride"] == 112
    assert settled({"model": {"checkpoint": "null"}})["model"]["checkpoint"] is None


def test_integer_settings_spelled_as_floats_become_integers():
    config = settled({"model": {"batch_size": 32.0}, "tiles": {"size": "224.0", "stride": 112.0}})
    for value, expected in [
        (config["model"]["batch_size"], 32),
        (config["tiles"]["size"], 224),
        (config["tiles"]["stride"], 112),
    ]:
        assert value == expected and type(value) is int
    assert type(config["tiles"]["mpp"]) is float  # a number stays a number
    assert problems({"model": {"batch_size": 32.5}}) == [
        "model.batch_size: 32.5 is not of type 'integer'"
    ]


@pytest.mark.parametrize(
    ("classes", "problem"),
    [
        (["slide_id", "b", "c"], "'slide_id' is a column of the prediction tables"),
        (["x", "y", "z"], "'x' is a column of the prediction tables"),
        (["method", "b"], "'method' is a column of the prediction tables"),
    ],
)
def test_class_names_that_are_columns_are_refused(classes, problem):
    with pytest.raises(ConfigError, match=problem):
        check_class_names(classes)


def test_every_schema_pattern_is_anchored_at_the_true_end():
    """A pattern ending in `$` lets a final newline through (`re.search` matches `$`
    before it); a name with one passes its check and stops the cohort later."""
    samples = yaml.safe_load((REPO / "workflow/schemas/samples.schema.yaml").read_text())
    patterns = [value for schema in (SCHEMA, samples) for value in _patterns(schema)]
    assert patterns and not [p for p in patterns if p.endswith("$")]


def _patterns(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        return own + [p for value in node.values() for p in _patterns(value)]
    if isinstance(node, list):
        return [p for value in node for p in _patterns(value)]
    return []


@pytest.mark.parametrize(
    ("overrides", "where"),
    [
        ({"models": {"m\n": {"name": "vit_tiny_patch16_224"}}}, "models: "),
        ({"head": {"classes": ["tumour\n", "stroma"]}}, "head.classes.0: "),
        ({"roi": {"include": ["tumour\n"]}}, "roi.include.0: "),
        ({"roi": {"exclude": ["pen\n"]}}, "roi.exclude.0: "),
        ({"remote": {"token_env": "TOKEN\n"}}, "remote.token_env: "),
    ],
)
def test_names_with_a_final_newline_are_refused(overrides, where):
    (line,) = problems(overrides)
    assert line.startswith(where) and "does not match" in line


def test_class_names_with_control_characters_are_refused():
    with pytest.raises(ConfigError, match="holds a control character"):
        check_class_names(["tumour\n", "stroma"])


def test_repeated_and_empty_class_names_are_refused():
    (line,) = problems({"head": {"classes": ["a", "b", "a"]}})
    assert line.startswith("head.classes: ") and "non-unique" in line
    (line,) = problems({"head": {"classes": ["a", ""]}})
    assert line.startswith("head.classes.1: ")
    with pytest.raises(ConfigError, match="'a' appears more than once"):
        check_class_names(["a", "b", "a"])


def test_a_spelled_out_default_stride_is_the_same_tiling():
    default = tile_params(settled({}))
    assert tile_params(settled({"tiles": {"stride": 224}})) == default
    assert tile_params(settled({"tiles": {"stride": "224.0", "size": 224.0}})) == default
    assert tile_params(settled({"tiles": {"stride": 112}})) != default


def test_the_servers_business_changes_no_remote_params():
    remote = {"model": {"backend": "remote"}, "remote": {"url": "http://h:8000", "model": "m"}}
    base = embedding_params(settled(remote))
    for change in ({"precision": "fp32"}, {"checkpoint": "/elsewhere.pt2"}, {"weights": "random"}):
        changed = settled({**remote, "model": {"backend": "remote", **change}})
        assert embedding_params(changed) == base, change
    other_model = settled({**remote, "remote": {**remote["remote"], "model": "other"}})
    assert embedding_params(other_model) != base
    # The local backend's own weights and precision are its results.
    assert embedding_params(settled({"model": {"precision": "fp32"}})) != embedding_params(
        settled({})
    )


def test_finite_numbers_pass():
    config = settled({"artefacts": {"max_pen_fraction": 0.1, "min_focus": 30}})
    assert math.isclose(config["artefacts"]["max_pen_fraction"], 0.1)


def test_a_value_over_a_size_limit_is_said_by_its_size_and_the_limit():
    """Fifty models: one short line that gives the limit, not the fifty entries."""
    models = {f"m{i}": {"name": "timm:test_vit", "weights": "random"} for i in range(50)}
    lines = problems({"models": models})
    assert lines == ["models: has 50 entries; at most 16 allowed"]
    long = "x" * 5000
    (line,) = problems({"tiles": {"size": long}})
    assert line.startswith("tiles.size: 'xxxx") and "(5002 characters)" in line
    assert len(line) < 200
