"""A prediction head over tile embeddings: tile probabilities, and two slide predictions.

A head is a state dict of Linear layers (one: a linear probe; several: an MLP with ReLU
between them, in the order of their keys, as nn.Sequential saves them), loaded with the
same checks as a tile model, or a .pt2 / TorchScript program mapping (B, D) to (B, C).
Per slide it gives each tile's probabilities, the mean of those ("mean_of_tiles"), and the
head applied to the mean embedding ("head_of_mean"): the first says how much of the slide
looks like a class, the second what the slide's average tile is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from slidesnake.aggregate.class_names import check_class_names
from slidesnake.atomic import atomic_output
from slidesnake.embed.store import open_embeddings
from slidesnake.errors import ConfigError, ModelError
from slidesnake.finite import require_finite
from slidesnake.models.checkpoints import is_program, load_program, load_state_dict

ACTIVATIONS = ("softmax", "sigmoid", "none")
# A column per class in every tile's predictions: 1,000 classes of 100,000 tiles is 400 MB.
MAX_CLASSES = 1000


@dataclass
class Head:
    """A loaded head, ready to map (B, D) features to (B, C) outputs."""

    network: torch.nn.Module
    path: Path
    in_dim: int | None  # None for a program: known only once run
    classes: list[str]
    activation: str

    @torch.inference_mode()
    def __call__(self, features: np.ndarray) -> np.ndarray:
        out = self.network(torch.from_numpy(features.astype(np.float32)))
        if self.activation == "softmax":
            out = out.softmax(dim=1)
        elif self.activation == "sigmoid":
            out = out.sigmoid()
        return out.float().numpy()


def linear_layers(state: dict[str, torch.Tensor], path: Path) -> list[torch.nn.Linear]:
    """The Linear layers of a state dict, in key order, their shapes from the file."""
    weights = sorted((k for k, v in state.items() if k.endswith("weight") and v.ndim == 2),
                     key=_natural)  # fmt: skip
    if not weights:
        raise ModelError(f"head {path} holds no Linear weights (2-D '...weight' tensors)")
    layers = []
    for key in weights:
        weight = state[key]
        bias = state.get(key[: -len("weight")] + "bias")
        _check_layer(key, weight, bias, path)
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        layer.load_state_dict({"weight": weight, **({"bias": bias} if bias is not None else {})})
        if layers and layers[-1].out_features != layer.in_features:
            raise ModelError(
                f"head {path}: layer '{key}' takes {layer.in_features} inputs but the layer "
                f"before gives {layers[-1].out_features}"
            )
        layers.append(layer.float())
    if layers[-1].out_features > MAX_CLASSES:
        raise ModelError(
            f"head {path} has {layers[-1].out_features} outputs, more than the "
            f"{MAX_CLASSES} classes a prediction table holds"
        )
    return layers


def _check_layer(key: str, weight: torch.Tensor, bias: torch.Tensor | None, path: Path) -> None:
    """A layer that maps something to something, with finite numbers of the right shape."""
    if 0 in weight.shape:
        raise ModelError(f"head {path}: layer '{key}' has shape {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ModelError(
            f"head {path}: the bias of layer '{key}' has shape {tuple(bias.shape)}, not "
            f"({weight.shape[0]},)"
        )
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and not torch.isfinite(tensor.float()).all():
            raise ModelError(
                f"head {path}: the {name} of layer '{key}' holds NaN or infinite values; "
                "every prediction would be NaN; train or save the head again"
            )


def _natural(key: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def load_head(path: str | Path, classes: list[str] | None, activation: str) -> Head:
    check_class_names(classes)
    path = Path(path)
    if is_program(path):
        network, in_dim = load_program(path, torch.device("cpu")), None
    else:
        layers = linear_layers(load_state_dict(path), path)
        parts: list[torch.nn.Module] = []
        for layer in layers:
            parts += [layer, torch.nn.ReLU()]
        network, in_dim = torch.nn.Sequential(*parts[:-1]).eval(), layers[0].in_features
        classes = _class_names(classes, layers[-1].out_features, path)
    return Head(network, path, in_dim, classes or [], activation)


def _class_names(classes: list[str] | None, outputs: int, path: Path) -> list[str]:
    if classes is None:
        return [f"class_{i}" for i in range(outputs)]
    if len(classes) != outputs:
        raise ConfigError(
            f"head.classes names {len(classes)} classes but head {path} has {outputs} outputs"
        )
    return list(classes)


def check_head_fits(head: dict[str, Any], model_dim: int | None) -> None:
    """Before any job: a head whose input width is not the model's is a config error."""
    if not head.get("checkpoint"):
        return
    path = Path(head["checkpoint"])
    if not path.is_file():
        raise ConfigError(f"head.checkpoint {path} does not exist; correct the path")
    loaded = load_head(path, head.get("classes"), head.get("activation", "softmax"))
    if model_dim is not None and loaded.in_dim is not None and loaded.in_dim != model_dim:
        raise ConfigError(
            f"head.checkpoint {path} takes {loaded.in_dim}-d features but the model gives "
            f"{model_dim}-d; use a head trained on this model's embeddings"
        )


def predict_slide(head: Head, zarr_path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(tile predictions: x, y and a column per class; slide predictions: a row per
    method). Tiles are read in chunks; a slide of 0 tiles gives no rows."""
    group = open_embeddings(zarr_path)
    features, coords = group["features"], group["coords"][:]
    step = features.chunks[0]
    chunks, total = [], np.zeros(features.shape[1])
    for start in range(0, features.shape[0], step):
        chunk = features[start : start + step]
        total += chunk.astype(np.float64).sum(axis=0)
        chunks.append(_checked(head, chunk))
    if not chunks:
        tiles = pd.DataFrame({"x": coords[:, 0], "y": coords[:, 1]})
        return tiles, pd.DataFrame(columns=["method", *head.classes])
    outputs = np.concatenate(chunks)
    names = _class_names(head.classes or None, outputs.shape[1], head.path)
    tiles = pd.DataFrame(outputs, columns=names)
    tiles.insert(0, "x", coords[:, 0])
    tiles.insert(1, "y", coords[:, 1])
    head_of_mean = _checked(head, (total / features.shape[0])[None, :])[0]
    slide = pd.DataFrame([outputs.mean(axis=0), head_of_mean], columns=names)
    slide.insert(0, "method", ["mean_of_tiles", "head_of_mean"])
    return tiles, slide


def _checked(head: Head, features: np.ndarray) -> np.ndarray:
    try:
        out = head(features)
    except Exception as err:
        raise ModelError(f"the head fails on {features.shape[1]}-d features ({err})") from None
    if out.ndim != 2 or len(out) != len(features):
        raise ModelError(f"the head returns shape {out.shape}; it must map (B, D) to (B, C)")
    if out.shape[1] > MAX_CLASSES:
        raise ModelError(f"the head returns {out.shape[1]} classes, more than {MAX_CLASSES}")
    fix = "check the head's weights: one NaN or infinite weight spoils every tile"
    require_finite(out, f"head {head.path}'s predictions", fix)
    return out


def write_predictions(tiles: pd.DataFrame, slide: pd.DataFrame, tiles_path, slide_path) -> None:
    with atomic_output(tiles_path) as tmp:
        tiles.to_parquet(tmp, index=False)
    with atomic_output(slide_path) as tmp:
        slide.to_csv(tmp, sep="\t", index=False)
