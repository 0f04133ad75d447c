"""The model registry, config checks and weights in every format a user may have."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch

from slidesnake.errors import ConfigError, ModelError
from slidesnake.models.checkpoints import WeightsDigest
from slidesnake.models.embedder import build_embedder, build_network
from slidesnake.models.pt2_archive import ARCHIVE_TORCH
from slidesnake.models.registry import (
    BIOPTIMUS_MEAN,
    BIOPTIMUS_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    REGISTRY,
    check_model_config,
    model_spec,
)
from slidesnake.side_files import sha256

CPU = torch.device("cpu")
TILES = {"size": 224, "mpp": 0.5}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_registry_architectures_give_the_declared_width(name):
    spec = REGISTRY[name]
    with torch.device("meta"):  # shapes only: a ViT-g costs nothing here
        network = build_network(spec, spec.input_size)
        out = network(torch.empty(2, 3, spec.input_size, spec.input_size))
    assert tuple(out.shape) == (2, spec.dim)


def test_h_optimus_matches_its_model_card():
    spec = REGISTRY["h-optimus-0"]
    assert (spec.mean, spec.std) == (BIOPTIMUS_MEAN, BIOPTIMUS_STD)
    assert (spec.input_size, spec.mpp, spec.output, spec.dim) == (224, 0.5, "cls", 1536)
    with torch.device("meta"):
        vit = build_network(spec, 224).network
    assert vit.patch_embed.patch_size == (14, 14)
    assert vit.num_reg_tokens == 4
    assert not vit.patch_embed.dynamic_img_pad and not vit.dynamic_img_size
    assert sum(p.numel() for p in vit.parameters()) > 1.1e9


def test_user_normalisation_overrides_the_models():
    spec = model_spec("uni", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert (spec.mean, spec.std) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert model_spec("timm:resnet18").mean == IMAGENET_MEAN


@pytest.mark.parametrize(
    ("model", "tiles", "message"),
    [
        ({"name": "h-optimus-0"}, {"size": 256, "mpp": 0.5}, "set tiles.size: 224"),
        ({"name": "uni"}, {"size": 224, "mpp": 1.0}, "set tiles.mpp: 0.5"),
        ({"name": "dino-9000"}, TILES, "model.name 'dino-9000' is unknown"),
        ({"name": "h-optimus-1", "checkpoint": "nowhere.safetensors"}, TILES, "does not exist"),
        ({"name": "timm:resnet18"}, TILES, "needs model.checkpoint"),
    ],
)
def test_config_mistakes_are_found_before_any_job(model, tiles, message):
    with pytest.raises(ConfigError, match=message):
        check_model_config({"weights": "checkpoint", **model}, tiles)


def test_timm_models_take_any_tile_size():
    check_model_config({"name": "timm:resnet18", "weights": "random"}, {"size": 256, "mpp": 1})


def tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("test_vit", num_classes=0, img_size=224).eval()


def tiles_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (3, 224, 224, 3), dtype=torch.uint8, generator=generator)


def reference(network: torch.nn.Module, tiles: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    with torch.inference_mode():
        return network((tiles.permute(0, 3, 1, 2) / 255.0 - mean) / std)


def save_safetensors(network, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in network.state_dict().items()}, str(path))
    return path


def save_state_dict(network, path: Path) -> Path:
    torch.save(network.state_dict(), path)
    return path


def save_wrapped_state_dict(network, path: Path) -> Path:
    torch.save({"epoch": 3, "state_dict": network.state_dict()}, path)
    return path


# torch.export archives of the layout checked here are written and read from torch 2.8 on.
PT2 = pytest.mark.skipif(
    torch.__version__ < ARCHIVE_TORCH, reason=f"a .pt2 archive needs torch {ARCHIVE_TORCH}"
)


def export(network, dtype=torch.float32) -> torch.export.ExportedProgram:
    """Export with a dynamic batch, as a user must: the last batch of a slide is short."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    example = (torch.zeros(2, 3, 224, 224, dtype=dtype),)
    return torch.export.export(network, example, dynamic_shapes=({0: batch},))


def save_export(network, path: Path) -> Path:
    torch.export.save(export(network), str(path))
    return path


def save_torchscript(network, path: Path) -> Path:
    torch.jit.save(torch.jit.trace(network, torch.zeros(2, 3, 224, 224)), str(path))
    return path


FORMATS = {
    "model.safetensors": ("timm:test_vit", save_safetensors),
    "weights.pt": ("timm:test_vit", save_state_dict),
    "checkpoint.pth": ("timm:test_vit", save_wrapped_state_dict),
    "pytorch_model.bin": ("timm:test_vit", save_state_dict),
    "program.pt2": ("custom", save_export),
    "architecture.pt2": ("timm:test_vit", save_export),  # the weights, into the architecture
    "scripted.pt": ("custom", save_torchscript),
}


@pytest.mark.parametrize(
    "filename", [pytest.param(f, marks=PT2 if f.endswith(".pt2") else ()) for f in sorted(FORMATS)]
)
def test_every_weight_format_gives_the_models_own_output(tmp_path, filename):
    name, save = FORMATS[filename]
    network = tiny_vit()
    path = save(network, tmp_path / filename)
    embedder = build_embedder(model_spec(name), "checkpoint", str(path), 224, CPU, "fp32")
    tiles = tiles_batch()
    torch.testing.assert_close(embedder(tiles), reference(network, tiles), atol=1e-5, rtol=1e-5)
    assert embedder.dim == 64
    assert embedder.weights_digest().value() == sha256(path)
    assert not any(t.is_meta for t in embedder.network.state_dict().values())


class Wrapped(torch.nn.Module):
    """A model exported inside a wrapper of the user's: other parameter names."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_vit()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@PT2
def test_an_architectures_pt2_gives_its_weights_without_loading_the_program(tmp_path, monkeypatch):
    path = save_export(tiny_vit(), tmp_path / "model.pt2")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.export.load was called")

    with monkeypatch.context() as patched:
        patched.setattr(torch.export, "load", refuse)
        embedder = build_embedder(model_spec("timm:test_vit"), "checkpoint", str(path), 224,
                                  CPU, "fp32")  # fmt: skip
    tiles = tiles_batch()
    torch.testing.assert_close(embedder(tiles), reference(tiny_vit(), tiles), atol=1e-5, rtol=1e-5)
    # Weights the architecture does not name: the archive runs as the program it is.
    wrapped = save_export(Wrapped().eval(), tmp_path / "wrapped.pt2")
    embedder = build_embedder(model_spec("timm:test_vit"), "checkpoint", str(wrapped), 224, CPU,
                              "fp32")  # fmt: skip
    torch.testing.assert_close(embedder(tiles), reference(tiny_vit(), tiles), atol=1e-5, rtol=1e-5)


@PT2
def test_a_program_runs_in_the_dtype_it_was_exported_in(tmp_path):
    torch.export.save(export(tiny_vit().to(torch.bfloat16), torch.bfloat16), tmp_path / "bf16.pt2")
    embedder = build_embedder(
        model_spec("custom"), "checkpoint", str(tmp_path / "bf16.pt2"), 224, CPU, "fp32"
    )
    assert embedder.dtype == torch.bfloat16
    assert embedder(tiles_batch()).dtype == torch.bfloat16


def truncated(tmp_path: Path) -> Path:
    path = save_safetensors(tiny_vit(), tmp_path / "model.safetensors")
    path.write_bytes(path.read_bytes()[:5000])
    return path


def other_architecture(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    resnet = timm.create_model("test_resnet", num_classes=0)
    return save_safetensors(resnet, tmp_path / "resnet.safetensors")


def garbage_program(tmp_path: Path) -> Path:
    path = tmp_path / "model.pt2"
    path.write_bytes(b"PK\x03\x04 not really a program")
    return path


def static_batch_program(tmp_path: Path) -> Path:
    program = torch.export.export(tiny_vit(), (torch.zeros(8, 3, 224, 224),))
    torch.export.save(program, str(tmp_path / "static.pt2"))
    return tmp_path / "static.pt2"


def not_a_program(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x08\x07")
    return path


@pytest.mark.parametrize(
    ("make", "name", "message"),
    [
        (truncated, "timm:test_vit", "corrupt or truncated"),
        (other_architecture, "timm:test_vit", "does not fit architecture test_vit"),
        pytest.param(garbage_program, "custom", "not a readable .pt2 program", marks=PT2),
        pytest.param(static_batch_program, "custom", "a dynamic batch dimension", marks=PT2),
        (not_a_program, "timm:test_vit", "unknown format '.onnx'"),
    ],
)
def test_bad_checkpoints_fail_with_a_clear_message(tmp_path, make, name, message):
    path = make(tmp_path)
    with pytest.raises(ModelError, match=message):
        build_embedder(model_spec(name), "checkpoint", str(path), 224, CPU, "fp32")


def test_a_pt2_under_an_older_torch_says_which_torch_it_needs(tmp_path, monkeypatch):
    """Below torch 2.8 a .pt2 fails before it is opened, with a line that names the torch
    it needs, the torch there is and what to give instead."""
    path = tmp_path / "model.pt2"
    path.write_bytes(b"PK\x03\x04 any archive")
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion("2.4.1"))
    for name in ("custom", "timm:test_vit"):
        with pytest.raises(ModelError) as refused:
            build_embedder(model_spec(name), "checkpoint", str(path), 224, CPU, "fp32")
        assert str(refused.value) == (
            f"checkpoint {path}: a torch.export archive (.pt2) needs torch 2.8 or newer, and "
            "this environment has torch 2.4.1; upgrade torch, or give the weights as "
            "safetensors with the model's architecture"
        )


def test_a_hub_id_fails_at_once_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ModelError, match=r"set model\.checkpoint to the local file"):
        build_embedder(model_spec("h-optimus-0"), "checkpoint", None, 224, CPU, "fp16")
    assert time.monotonic() - started < 10


def test_fp16_on_a_cpu_runs_in_fp32_and_says_so(caplog):
    embedder = build_embedder(model_spec("timm:test_vit"), "random", None, 224, CPU, "fp16")
    assert embedder.dtype == torch.float32
    assert "fp16 is not supported on the CPU" in caplog.text
    assert "RANDOM WEIGHTS" in caplog.text


def test_the_weights_digest_is_computed_once_per_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "weights.safetensors"
    path.write_bytes(b"w" * 5000)
    assert WeightsDigest(path).value() == sha256(path)
    (cached,) = (tmp_path / "cache" / "slidesnake" / "sha256").iterdir()
    cached.write_text("from the cache\n")
    assert WeightsDigest(path).value() == "from the cache"  # no second read of the file
    path.write_bytes(b"v" * 5000)  # the same size, a new modification time
    assert WeightsDigest(path).value() == sha256(path)


def test_cpu_resize_in_uint8_gives_the_float_paths_pixels_within_rounding():
    """The CPU resizes in uint8 before normalising; a GPU resizes in float. Both see the
    same tiles to within one grey level."""
    embedder = build_embedder(model_spec("timm:test_vit"), "random", None, 224, CPU, "fp32")
    tiles = torch.randint(0, 256, (4, 448, 448, 3), dtype=torch.uint8)
    uint8_path = embedder.preprocess(tiles)
    floats = tiles.permute(0, 3, 1, 2).float()
    resized = torch.nn.functional.interpolate(
        floats, size=(224, 224), mode="bilinear", antialias=True, align_corners=False
    )
    mean = torch.tensor(embedder.spec.mean).view(1, 3, 1, 1)
    std = torch.tensor(embedder.spec.std).view(1, 3, 1, 1)
    float_path = (resized / 255.0 - mean) / std
    grey_levels = ((uint8_path - float_path) * std * 255).abs()
    assert grey_levels.max() <= 1.0 + 1e-3
    assert grey_levels.mean() < 0.5  # rounding, not a shifted or flipped image


class TopLeftPixel(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, 0, 0]  # a view of the input


def test_features_survive_the_next_batch_when_a_program_returns_a_view(tmp_path):
    torch.jit.save(torch.jit.script(TopLeftPixel()), str(tmp_path / "view.pt"))
    embedder = build_embedder(
        model_spec("custom"), "checkpoint", str(tmp_path / "view.pt"), 224, CPU, "fp32"
    )
    first = embedder(torch.zeros(2, 448, 448, 3, dtype=torch.uint8))
    expected = first.clone()
    embedder(torch.full((2, 448, 448, 3), 255, dtype=torch.uint8))
    torch.testing.assert_close(first, expected)


CHECK_TIMM_NAME = """
import sys
from slidesnake.models.registry import check_model_config
check_model_config({"name": "timm:test_vit", "weights": "random"}, {"size": 224, "mpp": 0.5})
print("timm" in sys.modules)
"""


def test_a_timm_architecture_found_once_is_checked_without_importing_timm(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    runs = [
        subprocess.run([sys.executable, "-c", CHECK_TIMM_NAME], capture_output=True, text=True,
                       env=env, check=True).stdout.strip()
        for _ in range(2)
    ]  # fmt: skip
    assert runs == ["True", "False"]
    with pytest.raises(ConfigError, match="timm has no architecture"):  # never remembered
        check_model_config({"name": "timm:not_a_model", "weights": "random"},
                           {"size": 224, "mpp": 0.5})  # fmt: skip


@PT2
def test_a_programs_declared_width_spares_the_probe_tile(tmp_path, monkeypatch):
    from slidesnake.models import embedder as embedder_module
    from slidesnake.models.pt2_archive import declared_width

    path = save_export(tiny_vit(), tmp_path / "model.pt2")

    def refuse(embedder):
        raise AssertionError("a tile ran through the program to learn its width")

    with monkeypatch.context() as patched:
        patched.setattr(embedder_module, "_probe_dim", refuse)
        embedder = build_embedder(model_spec("custom"), "checkpoint", str(path), 224, CPU, "fp32")
    assert embedder.dim == 64 and embedder(tiles_batch()).shape == (3, 64)
    # What the archive does not declare plainly, one tile tells (and checks): a static
    # batch, another input size.
    assert declared_width(static_batch_program(tmp_path), 224) is None
    assert declared_width(path, 256) is None
