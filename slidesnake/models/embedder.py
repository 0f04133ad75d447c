"""The model side of embedding: build the network, load weights, preprocess.

Tiles arrive as uint8 (B, H, W, 3) at the slide's read level. Everything from there is
batched: resize to the model's input size, normalisation, the cast to the model's dtype,
the forward pass and pooling to one vector per tile. On a GPU all of it runs on the
device; on a CPU the resize runs in uint8 (vectorised over channels-last pixels, ~18x
faster than in float32), so preprocessing does not hide the loader behind it.

Start-up costs only what it must: an architecture is built on the meta device (no
random initialisation of weights the checkpoint overwrites) and the checkpoint's tensors
become its parameters; the width comes from the registry or a meta-device pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from slidesnake.errors import ConfigError, ModelError
from slidesnake.models.checkpoints import (
    WeightsDigest,
    fetch_from_hub,
    is_program,
    load_program,
    load_state_dict,
)
from slidesnake.models.input_pixels import centre_box, normalisation
from slidesnake.models.pt2_archive import declared_width
from slidesnake.models.registry import ModelSpec, weights_source

log = logging.getLogger(__name__)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_INPUT_SIZE = 224  # for an architecture that takes any size, when none is given


@dataclass
class Embedder:
    """A model ready to embed uint8 tiles on its device."""

    spec: ModelSpec
    network: torch.nn.Module  # normalised (B, 3, S, S) -> (B, D)
    device: torch.device
    dtype: torch.dtype
    input_size: int
    dim: int
    weights_path: Path | None
    load_s: dict[str, float] = field(default_factory=dict)  # build, weights, device, width
    crop: float = 1.0  # the centre of each tile it takes, as a fraction of the tile's side

    @torch.inference_mode()
    def __call__(self, tiles: torch.Tensor, shaped: torch.Tensor | None = None) -> torch.Tensor:
        """(B, D) features of uint8 (B, H, W, 3) tiles; or of `shaped`, the same batch
        already cut and resized (`shape`) for another model with the same `input_key`,
        which this call leaves as it is."""
        x = self.normalise(self.shape(tiles)) if shaped is None else self.normalise(shaped, True)
        features = self.network(x)
        if self._pixels is not None and _shares_memory(features, self._pixels):
            features = features.clone()  # a program that returns a view of its input
        return features

    def preprocess(self, tiles: torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, 3) -> normalised (B, 3, S, S) in the model's dtype."""
        return self.normalise(self.shape(tiles))

    @property
    def input_key(self) -> tuple[float, int]:
        """Models with equal keys take the same pixels from a tile (`shape`)."""
        return self.crop, self.input_size

    @torch.inference_mode()
    def shape(self, tiles: torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, 3) -> this model's part of each tile at its size, (B, 3, S, S):
        on a CPU uint8, on a GPU float32."""
        x = tiles.to(self.device, non_blocking=True).permute(0, 3, 1, 2)  # channels-last
        if self.crop < 1.0:
            x = centre(x, self.crop)
        resize = x.shape[-1] != self.input_size or x.shape[-2] != self.input_size
        if self.device.type == "cpu":
            return resize_tiles(x, self.input_size) if resize else x  # uint8: rounds once
        x = x.float()
        return resize_tiles(x, self.input_size) if resize else x

    def normalise(self, x: torch.Tensor, shared: bool = False) -> torch.Tensor:
        """Shaped tiles -> normalised, in the model's dtype; in place, unless `shared`."""
        if self.device.type == "cpu":
            x = self._cpu_pixels(x)  # a copy of its own
        elif shared:
            x = x.mul(self._scale)
            return x.sub_(self._shift).to(self.dtype)
        return x.mul_(self._scale).sub_(self._shift).to(self.dtype)

    def _cpu_pixels(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as float32 in a buffer reused batch after batch: on a CPU, fresh pages for
        each batch's floats cost more than the arithmetic on them."""
        if (
            self._pixels is None
            or self._pixels.shape[1:] != x.shape[1:]
            or len(x) > len(self._pixels)
        ):
            self._pixels = torch.empty(x.shape, memory_format=torch.channels_last)
        return self._pixels[: len(x)].copy_(x)

    def __post_init__(self) -> None:
        scale, shift = normalisation(self.spec)
        self._scale, self._shift = (torch.from_numpy(a).to(self.device) for a in (scale, shift))
        self._pixels: torch.Tensor | None = None

    def weights_digest(self) -> WeightsDigest | None:
        """The weights file's sha256, computed once per file and off the critical path."""
        return WeightsDigest(self.weights_path) if self.weights_path is not None else None


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def centre(x: torch.Tensor, crop: float) -> torch.Tensor:
    """The centre `crop` of (B, 3, h, w) tiles' sides, a view (the same pixels a read of
    just that part would give, when the offset is a whole number of pixels)."""
    return x[(..., *centre_box(*x.shape[-2:], crop))]


def resize_tiles(x: torch.Tensor, size: int) -> torch.Tensor:
    """(B, 3, h, w) tiles to (B, 3, size, size); on a CPU, uint8 in and out."""
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def model_dtype(precision: str, device: torch.device) -> torch.dtype:
    """fp16 on CUDA; on a CPU, fp16 becomes fp32 (CPU fp16 kernels are slow or missing)."""
    if precision not in DTYPES:
        raise ConfigError(f"model.precision '{precision}' is not one of {sorted(DTYPES)}")
    if device.type == "cpu" and precision == "fp16":
        log.warning("model.precision fp16 is not supported on the CPU: running in fp32")
        return torch.float32
    return DTYPES[precision]


def build_embedder(
    spec: ModelSpec,
    weights: str,
    checkpoint: str | None,
    input_size: int,
    device: torch.device,
    precision: str = "fp16",
) -> Embedder:
    """Build the network of `spec` and load its weights; fails before any tile is read."""
    path = _checkpoint_path(spec, weights, checkpoint)
    # A .pt2 of a registry or timm: architecture gives its weights to the architecture:
    # torch.export.load would rebuild the program, seconds of every job's start-up.
    weights_only = path is not None and path.suffix == ".pt2" and spec.architecture is not None
    if path is not None and not weights_only and is_program(path):
        return _program_embedder(spec, path, input_size, device, precision)
    if spec.architecture is None:
        raise ConfigError(
            "model.name 'custom' needs model.checkpoint to be a .pt2 or TorchScript program"
        )
    dtype = model_dtype(precision, device)
    clock = time.perf_counter
    started = clock()
    if path is None:
        network = _random_network(spec, input_size, device)
    else:
        with torch.device("meta"):  # shapes only: the checkpoint's tensors become the weights
            network = build_network(spec, input_size)
    built = clock()
    if path is not None:
        try:
            _fill(network.network, load_state_dict(path, device), path, spec)
        except UnfitWeights as err:
            if not weights_only:
                raise
            log.info("%s; running the archive as the program it is", err)
            return _program_embedder(spec, path, input_size, device, precision)
    loaded = clock()
    network = network.to(device=device, dtype=dtype).eval()
    placed = clock()
    dim = spec.dim or _meta_width(spec, input_size)
    load_s = {
        "model_build_s": built - started,
        "weights_load_s": loaded - built,
        "to_device_s": placed - loaded,
        "width_s": clock() - placed,
    }
    return Embedder(spec, network, device, dtype, input_size, dim, path, load_s)


def _program_embedder(
    spec: ModelSpec, path: Path, input_size: int, device: torch.device, precision: str
) -> Embedder:
    """A .pt2 or TorchScript program: the width as a .pt2 declares it, else from one tile
    through the program."""
    started = time.perf_counter()
    network = load_program(path, device)  # loads onto the device: no build, no move
    dtype = next((p.dtype for p in network.parameters() if p.is_floating_point()), None)
    embedder = Embedder(
        spec, network, device, dtype or model_dtype(precision, device), input_size, 0, path
    )
    loaded = time.perf_counter()
    declared = declared_width(path, input_size) if path.suffix == ".pt2" else None
    embedder.dim = declared or _probe_dim(embedder)
    embedder.load_s = {
        "model_build_s": 0.0,
        "weights_load_s": loaded - started,
        "to_device_s": 0.0,
        "width_s": time.perf_counter() - loaded,
    }
    return embedder


def _random_network(spec: ModelSpec, input_size: int, device: torch.device) -> torch.nn.Module:
    """Seeded random weights, initialised where they will run (a ViT-g's 1.1 B on a CPU
    take half a minute, on a GPU a moment): the same in every job on one kind of device."""
    log.warning(
        "!!! model '%s' has RANDOM WEIGHTS (model.weights: random): its embeddings "
        "mean nothing; use this for demos and tests only !!!",
        spec.name,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.device(device):
            return build_network(spec, input_size)


def embedding_width(spec: ModelSpec, input_size: int) -> int | None:
    """The model's feature width before any weights load: the registry's, or a meta pass
    for a timm architecture; None for a program, known only once it runs."""
    if spec.dim is not None:
        return spec.dim
    return _meta_width(spec, input_size) if spec.architecture is not None else None


def _meta_width(spec: ModelSpec, input_size: int) -> int:
    """The width of a `timm:` architecture, from a pass over shapes only (no memory)."""
    with torch.device("meta"):
        network = build_network(spec, input_size)
        return int(network(torch.empty(1, 3, input_size, input_size)).shape[1])


def check_fit(
    spec: ModelSpec, state: dict[str, torch.Tensor], path: Path, input_size: int | None = None
) -> None:
    """UnfitWeights unless `state` fills the architecture of `spec` (sized for
    `input_size` px tiles) name for name and shape for shape; the architecture is built
    on the meta device, so this costs nothing but the state dict itself."""
    with torch.device("meta"):
        network = build_network(spec, input_size or spec.input_size or DEFAULT_INPUT_SIZE)
    _fill(network.network, state, path, spec)


def parameter_count(spec: ModelSpec) -> int:
    """How many weights the architecture of `spec` has: the size of its checkpoint."""
    with torch.device("meta"):
        network = build_network(spec, spec.input_size or DEFAULT_INPUT_SIZE)
    return sum(p.numel() for p in network.parameters())


def _checkpoint_path(spec: ModelSpec, weights: str, checkpoint: str | None) -> Path | None:
    source = weights_source(spec, weights, checkpoint)
    if source is None:
        return None
    return fetch_from_hub(source) if source.startswith("hf-hub:") else Path(source)


def build_network(spec: ModelSpec, input_size: int) -> torch.nn.Module:
    """The timm architecture of `spec` with random weights, pooled to one vector per tile.

    Built on whatever device is current: under `torch.device("meta")` it costs nothing.
    """
    return _Pooled(_timm_network(spec, input_size), spec.output)


def _timm_network(spec: ModelSpec, input_size: int) -> torch.nn.Module:
    # Imported here: timm brings torchvision, 2 s of a job's start-up that a .pt2 or
    # TorchScript program does not need.
    import timm

    kwargs = {key: _resolve_layer(value) for key, value in spec.timm_kwargs.items()}
    if spec.input_size is None:  # timm:<arch>: size the model to the tiles when it can
        try:
            return timm.create_model(spec.architecture, num_classes=0, img_size=input_size)
        except TypeError:
            pass
    try:
        return timm.create_model(spec.architecture, pretrained=False, num_classes=0, **kwargs)
    except RuntimeError as err:
        raise ConfigError(f"timm cannot build '{spec.architecture}': {err}") from None


def _resolve_layer(value: object) -> object:
    if value == "SwiGLUPacked":
        from timm.layers import SwiGLUPacked

        return SwiGLUPacked
    if value == "SiLU":
        return torch.nn.SiLU
    return value


class UnfitWeights(ModelError):
    """A checkpoint's tensors are not the architecture's: other names or shapes."""


def _fill(network: torch.nn.Module, state: dict, path: Path, spec: ModelSpec) -> None:
    try:
        result = network.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:  # shapes that differ
        raise UnfitWeights(
            f"checkpoint {path} does not fit architecture {spec.architecture} of model "
            f"'{spec.name}' ({str(err).splitlines()[1].strip()}); check model.name"
        ) from None
    if result.missing_keys or result.unexpected_keys:
        raise UnfitWeights(
            f"checkpoint {path} does not fit architecture {spec.architecture} of model "
            f"'{spec.name}': missing {result.missing_keys[:5]}, unexpected "
            f"{result.unexpected_keys[:5]}; check model.name against the checkpoint"
        )


class _Pooled(torch.nn.Module):
    """A timm network reduced to one vector per tile, as the model's card prescribes."""

    def __init__(self, network: torch.nn.Module, output: str) -> None:
        super().__init__()
        self.network = network
        self.output = output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output == "cls":
            return self.network(x)
        tokens = self.network.forward_features(x)
        patches = tokens[:, self.network.num_prefix_tokens :].mean(dim=1)
        return torch.cat([tokens[:, 0], patches], dim=-1)


def _probe_dim(embedder: Embedder) -> int:
    """Run one blank tile through the network: checks it works and gives its width."""
    blank = torch.zeros(1, embedder.input_size, embedder.input_size, 3, dtype=torch.uint8)
    try:
        out = embedder(blank)
    except Exception as err:
        hint = (
            "; export programs with a dynamic batch dimension "
            "(torch.export.export(..., dynamic_shapes=({0: torch.export.Dim('batch')},)))"
            if embedder.spec.architecture is None
            else ""
        )
        raise ModelError(
            f"model '{embedder.spec.name}' fails on a {embedder.input_size} px tile ({err}){hint}"
        ) from None
    if out.ndim != 2 or out.shape[0] != 1:
        raise ModelError(
            f"model '{embedder.spec.name}' returns shape {tuple(out.shape)} per batch; "
            "it must map (B, 3, H, W) to (B, D)"
        )
    return int(out.shape[1])
