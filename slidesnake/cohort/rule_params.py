"""The `params:` of each rule: only what decides its outputs, in one spelling.

Snakemake re-runs a rule for every slide when the text of its params changes. So a rule
gets its stage's settings as the stage's own dataclass gives them, field by field in a
fixed order, numbers typed as the field declares: keys in another order, `1` for `1.0`,
or a setting that cannot change a result (progress and watchdog intervals, loader
processes, GPU ids, the mask stage's decoding bound) re-run nothing. The params are for
Snakemake alone: a job reads all its settings from the config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from slidesnake.atomic import atomic_output
from slidesnake.cohort.decode_method import configured
from slidesnake.embed.settings import EmbedSettings
from slidesnake.side_files import file_digest
from slidesnake.tiling.artefacts import ArtefactParams
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.tissue import TissueParams

# What an embedding depends on; the loader's and the log's settings only change speed.
EMBEDDING_FIELDS = (
    "model",
    "weights",
    "checkpoint",
    "mean",
    "std",
    "precision",
    "batch_size",
    "output_dtype",
)
# What a model takes from each tile, where it does not take the whole tile as it is.
INPUT_FIELDS = ("input_size", "input_mpp")
# What the remote backend leaves to the server.
SERVER_FIELDS = ("weights", "checkpoint", "precision")


def tissue_params(config: Mapping[str, Any]) -> dict[str, Any]:
    params = _canonical(TissueParams.from_mapping(config["tissue"]))
    del params["max_decode_mpx"]  # decides whether a slide fails, never what a mask is
    if ArtefactParams.from_mapping(config["artefacts"]).pen:
        params["pen"] = True  # only when on: switching on a filter re-runs no other config
    if configured(config) == "scaled":
        params["decode"] = "scaled"  # only when scaled, as for the embeddings
    return params


def tile_params(config: Mapping[str, Any]) -> dict[str, Any]:
    params = _canonical(TileParams.from_mapping(config["tiles"]))
    if params["stride"] == params["size"]:
        params["stride"] = None  # spelled out, the default: the same grid
    artefacts = _canonical(ArtefactParams.from_mapping(config["artefacts"]))
    if artefacts["max_pen_fraction"] is not None:
        params["max_pen_fraction"] = artefacts["max_pen_fraction"]
    if artefacts["min_focus"] is not None:
        params |= {key: artefacts[key] for key in ("min_focus", "focus_mpp")}
    return params


def embedding_params(config: Mapping[str, Any]) -> dict[str, Any]:
    settings = EmbedSettings.from_config(config)
    canonical = _canonical(settings)
    params = {name: canonical[name] for name in EMBEDDING_FIELDS}
    # Only when set: a config that sets neither keeps the params it always had.
    params |= {name: canonical[name] for name in INPUT_FIELDS if canonical[name] is not None}
    # Only when scaled: the cohorts read exactly before the method existed keep their params.
    if settings.decode != "exact":
        params["decode"] = settings.decode
    if settings.remote is not None:
        # The server's address is not a result; its model is. Its weights and precision
        # are the server's business: a job never reads them.
        for name in SERVER_FIELDS:
            del params[name]
        params |= {"backend": "remote", "remote_model": settings.remote.model}
    return params


def _canonical(settings: object) -> dict[str, Any]:
    values = {}
    for field in fields(settings):
        value = getattr(settings, field.name)
        if isinstance(value, int) and not isinstance(value, bool) and "float" in str(field.type):
            value = float(value)
        elif isinstance(value, tuple | list):
            value = [float(item) for item in value]
        values[field.name] = value
    return values


def slide_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a slide's features: the poolings in order and the encoder program
    (with its digest: a replaced file re-runs pooling whatever its modification time)."""
    encoder = config["slide"]["encoder"]
    params = {"pooling": list(config["slide"]["pooling"]), "encoder": encoder}
    if encoder:
        params["encoder_sha256"] = file_digest(encoder)
    return params


def head_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a slide's predictions besides its embeddings: the head (and its
    digest) and its labels."""
    head = config["head"]
    params = {key: head[key] for key in ("checkpoint", "classes", "activation")}
    if head["checkpoint"]:
        params["checkpoint_sha256"] = file_digest(head["checkpoint"])
    return params


def write_model_cards(configs: Mapping[str, Mapping[str, Any]], folder: str | Path) -> None:
    """`folder`/<key>.json: each model's embedding params, rewritten only when they change.

    The folder is an input of the embedding jobs in place of params: a job's params and
    inputs are the same whatever models the list holds, so removing a model re-runs
    nothing, while a changed or added card makes the folder newer than the outputs and
    the jobs run, each embedding only the models whose outputs are not current. Cards of
    removed models stay: removing one would touch the folder."""
    folder = Path(folder)
    for key, config in configs.items():
        card = folder / f"{key}.json"
        text = json.dumps(embedding_params(config), indent=1, sort_keys=True) + "\n"
        if not card.is_file() or card.read_text() != text:
            with atomic_output(card) as tmp:
                tmp.write_text(text)
