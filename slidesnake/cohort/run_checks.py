"""What a run checks of its models before any job starts: each model against the tiles,
and a prediction head against the model whose embeddings it reads."""

from __future__ import annotations

from typing import Any

from slidesnake.embed.settings import model_configs
from slidesnake.errors import ConfigError
from slidesnake.models.registry import check_model_config, model_spec


def check_models_config(config: dict[str, Any]) -> None:
    """model.*, or each entry of models:, against the tiles."""
    models = model_configs(config)
    for key, model in models.items():
        check_model_config(model["model"], config["tiles"], model["remote"], key)
    if not models:
        check_model_config(config["model"], config["tiles"], config["remote"])


def head_model(config: dict[str, Any]) -> dict[str, Any]:
    """The model section whose embeddings the head reads: head.model's entry of models:."""
    key = config["head"]["model"]
    if not config["models"]:
        return config["model"]
    if key not in config["models"]:
        raise ConfigError(
            f"head.model {key!r} is not a key of models: ({', '.join(config['models'])}); "
            "set it to the key of the model the head was trained on"
        )
    return config["models"][key]


def check_head_config(config: dict[str, Any]) -> None:
    """A head that does not fit the model stops the run. Only with a head: the model's
    width may take torch and timm to find."""
    if not config["head"]["checkpoint"]:
        return
    from slidesnake.aggregate.head import check_head_fits
    from slidesnake.models.embedder import embedding_width

    model = head_model(config)
    spec = model_spec(model["name"], model["mean"], model["std"])
    local = model["backend"] == "local"
    width = embedding_width(spec, config["tiles"]["size"]) if local else None
    check_head_fits(config["head"], width)
