"""The model registry: what each foundation model expects and what it returns.

Pure data, no torch import, so the workflow can check a config against a model before
any job starts. Constants come from the models' cards; weights are never bundled.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from slidesnake.errors import ConfigError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BIOPTIMUS_MEAN = (0.707223, 0.578729, 0.703617)
BIOPTIMUS_STD = (0.211883, 0.230117, 0.177517)

# "cls": the class token; "cls+mean": class token concatenated with the mean of the patch
# tokens (register tokens excluded), as Virchow recommends.
Output = Literal["cls", "cls+mean"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model and feed it."""

    name: str
    architecture: str | None  # timm name; None for whole-program checkpoints
    input_size: int | None  # px; None = any (set by tiles.size)
    mpp: float | None  # µm/px the model was trained at; None = any
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    output: Output
    dim: int | None  # embedding width; None = known only once built
    hub_id: str | None = None
    timm_kwargs: dict[str, Any] = field(default_factory=dict)


def _vit_swiglu(**kwargs: Any) -> dict[str, Any]:
    """timm kwargs of ViTs with packed SwiGLU MLPs (UNI2-h, Virchow2); resolved at build."""
    return {"mlp_layer": "SwiGLUPacked", "act_layer": "SiLU", **kwargs}


# fmt: off
REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("h-optimus-0", "vit_giant_patch14_reg4_dinov2", 224, 0.5, BIOPTIMUS_MEAN,
                  BIOPTIMUS_STD, "cls", 1536, "hf-hub:bioptimus/H-optimus-0",
                  {"img_size": 224, "init_values": 1e-5, "dynamic_img_size": False}),
        ModelSpec("h-optimus-1", "vit_giant_patch14_reg4_dinov2", 224, 0.5, BIOPTIMUS_MEAN,
                  BIOPTIMUS_STD, "cls", 1536, "hf-hub:bioptimus/H-optimus-1",
                  {"img_size": 224, "init_values": 1e-5, "dynamic_img_size": False}),
        ModelSpec("h0-mini", "vit_base_patch14_reg4_dinov2", 224, 0.5, BIOPTIMUS_MEAN,
                  BIOPTIMUS_STD, "cls", 768, "hf-hub:bioptimus/H0-mini",
                  {"img_size": 224, "init_values": 1e-5, "dynamic_img_size": False}),
        ModelSpec("uni", "vit_large_patch16_224", 224, 0.5, IMAGENET_MEAN, IMAGENET_STD,
                  "cls", 1024, "hf-hub:MahmoodLab/UNI",
                  {"init_values": 1e-5, "dynamic_img_size": True}),
        ModelSpec("uni2-h", "vit_giant_patch14_224", 224, 0.5, IMAGENET_MEAN, IMAGENET_STD,
                  "cls", 1536, "hf-hub:MahmoodLab/UNI2-h",
                  _vit_swiglu(img_size=224, patch_size=14, depth=24, num_heads=24,
                              init_values=1e-5, embed_dim=1536, mlp_ratio=2.66667 * 2,
                              no_embed_class=True, reg_tokens=8, dynamic_img_size=True)),
        ModelSpec("virchow2", "vit_huge_patch14_224", 224, 0.5, IMAGENET_MEAN, IMAGENET_STD,
                  "cls+mean", 2560, "hf-hub:paige-ai/Virchow2",
                  _vit_swiglu(img_size=224, init_values=1e-5, mlp_ratio=5.3375,
                              reg_tokens=4, dynamic_img_size=True)),
        # Phikon-v2 is published in Hugging Face transformers' DINOv2 layout; its weights
        # need converting to timm's ViT-L/16 keys before use here.
        ModelSpec("phikon-v2", "vit_large_patch16_224", 224, 0.5, IMAGENET_MEAN, IMAGENET_STD,
                  "cls", 1024, "hf-hub:owkin/phikon-v2", {"dynamic_img_size": True}),
    )
}
# fmt: on


def model_spec(
    name: str,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> ModelSpec:
    """The spec of a registry name, of `timm:<architecture>`, or of `custom` (a program)."""
    if name in REGISTRY:
        spec = REGISTRY[name]
    elif name.startswith("timm:"):
        spec = ModelSpec(
            name, name.removeprefix("timm:"), None, None, IMAGENET_MEAN, IMAGENET_STD, "cls", None
        )
    elif name == "custom":
        spec = ModelSpec("custom", None, None, None, IMAGENET_MEAN, IMAGENET_STD, "cls", None)
    else:
        known = ", ".join([*REGISTRY, "timm:<architecture>", "custom"])
        raise ConfigError(f"model.name '{name}' is unknown; choose one of: {known}")
    return _with_normalisation(spec, mean, std)


def _with_normalisation(spec: ModelSpec, mean, std) -> ModelSpec:
    return replace(
        spec,
        mean=tuple(mean) if mean is not None else spec.mean,
        std=tuple(std) if std is not None else spec.std,
    )


@dataclass(frozen=True)
class ModelInput:
    """What a model takes from each tile: the centre `crop` of the tile's side (1.0: the
    whole tile), resized to `size` px, which is then `mpp` µm/px. Several models share one
    read of each tile this way: tiles.* reads the finest µm/px and the largest field of
    view the models need, and each model cuts and resizes its own input from it."""

    size: int
    mpp: float
    crop: float


def model_input(
    spec: ModelSpec,
    tile_size: int,
    tile_mpp: float,
    input_size: int | None = None,
    input_mpp: float | None = None,
    label: str = "model",
) -> ModelInput:
    """The input of `spec` from tiles of `tile_size` px at `tile_mpp`: the registry's size
    and µm/px, or `input_size`/`input_mpp`, or the whole tile. ConfigError, naming the
    tiles.* setting to change, when the tiles are too coarse or too small for it."""
    for given, fixed, what in ((input_size, spec.input_size, "px"), (input_mpp, spec.mpp, "µm/px")):
        if given is not None and fixed is not None and abs(given - fixed) > 0.02 * fixed:
            raise ConfigError(f"{label} '{spec.name}' takes {fixed} {what}, not {given}")
    size = input_size or spec.input_size or tile_size
    mpp = input_mpp or spec.mpp or tile_size * tile_mpp / size
    crop = size * mpp / (tile_size * tile_mpp)
    if mpp < 0.98 * tile_mpp:
        raise ConfigError(
            f"{label} '{spec.name}' needs {mpp} µm/px but tiles.mpp is {tile_mpp}; set "
            f"tiles.mpp: {mpp} (the finest µm/px the models need) and tiles.size to match"
        )
    if crop > 1.001:
        raise ConfigError(
            f"{label} '{spec.name}' sees {size * mpp:g} µm ({size} px at {mpp} µm/px) but "
            f"tiles are {tile_size * tile_mpp:g} µm; set tiles.size: "
            f"{math.ceil(size * mpp / tile_mpp)} (the largest field of view the models need)"
        )
    return ModelInput(size, mpp, min(crop, 1.0))


def check_tiles_fit(spec: ModelSpec, tile_size: int, tile_mpp: float) -> None:
    """Raise ConfigError when tiles.* would feed a single `model:` inputs it was not made
    for: it reads its tiles alone, so they are its input exactly."""
    if spec.input_size is not None and spec.input_size != tile_size:
        raise ConfigError(
            f"model '{spec.name}' takes {spec.input_size} px tiles but tiles.size is "
            f"{tile_size}; set tiles.size: {spec.input_size}"
        )
    if spec.mpp is not None and abs(spec.mpp - tile_mpp) > 0.02 * spec.mpp:
        raise ConfigError(
            f"model '{spec.name}' was trained at {spec.mpp} µm/px but tiles.mpp is "
            f"{tile_mpp}; set tiles.mpp: {spec.mpp}"
        )


def check_model_config(
    model: dict[str, Any],
    tiles: dict[str, Any],
    remote: dict[str, Any] | None = None,
    key: str | None = None,
) -> None:
    """Config errors of model.* (or of models.`key`) found before any job runs: unknown
    model, wrong tiles, no weights file, or no server for the remote backend (whose
    weights are the server's)."""
    spec = model_spec(model["name"], model.get("mean"), model.get("std"))
    size, mpp = model.get("input_size"), model.get("input_mpp")
    label = "model" if key is None else f"models.{key}"
    if key is None and size is None and mpp is None:
        check_tiles_fit(spec, tiles["size"], tiles["mpp"])
    else:
        model_input(spec, tiles["size"], tiles["mpp"], size, mpp, label)
    if model.get("backend", "local") == "remote":
        section = "remote" if key is None else f"models.{key}.remote"
        missing = [f"{section}.{name}" for name in ("url", "model") if not (remote or {}).get(name)]
        if missing:
            raise ConfigError(f"{label}.backend remote needs {' and '.join(missing)}")
        return
    if spec.name.startswith("timm:"):
        _check_timm_architecture(spec.architecture)
    weights_source(spec, model.get("weights", "checkpoint"), model.get("checkpoint"))


def _check_timm_architecture(architecture: str) -> None:
    """timm must know the architecture. Importing timm costs seconds (torch, torchvision)
    at every start of the workflow, so a name found once is remembered per timm version."""
    known = _known_architectures() / architecture if _ARCHITECTURE.fullmatch(architecture) else None
    if known is not None and known.is_file():
        return
    import timm  # here only: the registry stays cheap to import for other models

    if not timm.is_model(architecture):
        close = timm.list_models(f"*{architecture.split('_')[0]}*")[:5]
        hint = f"; similar names: {', '.join(close)}" if close else ""
        raise ConfigError(
            f"model.name 'timm:{architecture}': timm has no architecture '{architecture}'{hint}"
        )
    if known is not None:
        with contextlib.suppress(OSError):  # a read-only home: the check costs an import
            known.parent.mkdir(parents=True, exist_ok=True)
            known.touch()


# Names that are safe as file names (the config's string, not a path).
_ARCHITECTURE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]{0,127}")


def _known_architectures() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slidesnake" / f"timm-{metadata.version('timm')}-architectures"


def weights_source(spec: ModelSpec, weights: str, checkpoint: str | None) -> str | None:
    """Where the weights come from: an existing local file, an `hf-hub:` id, or None for
    random weights. Raises ConfigError when there is no source or the file is missing."""
    if weights == "random":
        return None
    source = checkpoint or spec.hub_id
    if source is None:
        raise ConfigError(f"model '{spec.name}' needs model.checkpoint (a local weights file)")
    if not source.startswith("hf-hub:") and not Path(source).is_file():
        raise ConfigError(f"model.checkpoint {source} does not exist; correct the path")
    return source
