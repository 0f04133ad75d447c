"""On a CUDA GPU: the device path gives the CPU path's features, in every precision.

Skipped without CUDA; `benchmarks/gpu_check.sh` runs them wherever a GPU is at hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import embed_one
from test_embedding import blob_tiles, grid_model, settings, tile_slide  # noqa: F401

from slidesnake import load_embeddings
from slidesnake.models.embedder import build_embedder
from slidesnake.models.registry import model_spec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def embed_on(device: str, slide, tiles, out, embed_settings) -> np.ndarray:
    out.mkdir(parents=True, exist_ok=True)
    on = torch.device(device)
    embed_one(slide, "s", tiles, out / "e.zarr", out / "m.json", embed_settings, device=on)
    return load_embeddings(out / "e.zarr")[0]


def test_gpu_and_cpu_paths_give_the_same_features(tmp_path, blob_slide, blob_tiles, grid_model):  # noqa: F811
    """The GPU resizes floats, the CPU uint8: the same tiles to within rounding."""
    on_cpu = embed_on("cpu", blob_slide, blob_tiles, tmp_path / "cpu", settings(grid_model))
    on_gpu = embed_on("cuda", blob_slide, blob_tiles, tmp_path / "gpu", settings(grid_model))
    assert on_gpu.shape == on_cpu.shape
    np.testing.assert_allclose(on_gpu, on_cpu, atol=0.02)  # 1 grey level / std 0.15 / 255
    assert np.abs(on_gpu - on_cpu).mean() < 0.003


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_on_the_gpu_follows_fp32(precision):
    spec = model_spec("timm:vit_small_patch14_reg4_dinov2")
    tiles = torch.randint(0, 256, (8, 224, 224, 3), dtype=torch.uint8)
    cuda = torch.device("cuda")
    full = build_embedder(spec, "random", None, 224, cuda, "fp32")
    half = build_embedder(spec, "random", None, 224, cuda, precision)
    expected, got = full(tiles).float(), half(tiles).float()
    cosine = torch.nn.functional.cosine_similarity(expected, got, dim=1)
    assert half.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    assert cosine.min() > 0.99


def test_a_checkpoint_loads_straight_onto_the_gpu(tmp_path):
    from safetensors.torch import save_file

    spec = model_spec("timm:test_vit")
    reference = build_embedder(spec, "random", None, 224, torch.device("cpu"), "fp32")
    weights = {k: v.half() for k, v in reference.network.network.state_dict().items()}
    save_file(weights, str(tmp_path / "w.safetensors"))
    embedder = build_embedder(spec, "checkpoint", str(tmp_path / "w.safetensors"), 224,
                              torch.device("cuda"), "fp16")  # fmt: skip
    assert all(t.device.type == "cuda" for t in embedder.network.state_dict().values())
    assert embedder.dtype == torch.float16
    tiles = torch.randint(0, 256, (4, 224, 224, 3), dtype=torch.uint8)
    cosine = torch.nn.functional.cosine_similarity(
        embedder(tiles).float().cpu(), reference(tiles), dim=1
    )
    assert cosine.min() > 0.99


def test_models_of_one_job_on_the_gpu(tmp_path, blob_slide, blob_tiles, grid_model):  # noqa: F811
    """Several models on the GPU: each model's features follow its CPU run (the GPU
    resizes floats, the CPU uint8), their times come from CUDA events, and a share of
    the GPU too small for them fails the slide before any model loads."""
    from slidesnake.embed.job import embed_slide
    from slidesnake.embed.model_outputs import ModelOutputs
    from slidesnake.errors import ModelError

    models = {"grid": settings(grid_model), "small": settings(grid_model, input_size=112)}
    params = {key: {"model": key} for key in models}
    outputs = {}
    for device in ("cpu", "cuda"):
        out = {k: ModelOutputs(tmp_path / device / k / "e.zarr", tmp_path / device / k / "m.json")
               for k in models}  # fmt: skip
        metrics = embed_slide(
            blob_slide, "s", blob_tiles, out, models, params, torch.device(device)
        )
        assert all(m["device"] == device and m["model_s"] > 0 for m in metrics.values())
        outputs[device] = {k: load_embeddings(o.zarr)[0] for k, o in out.items()}
    for key in models:
        np.testing.assert_allclose(outputs["cuda"][key], outputs["cpu"][key], atol=0.02)
    out = {k: ModelOutputs(tmp_path / "none" / k / "e.zarr", tmp_path / "none" / k / "m.json")
           for k in models}  # fmt: skip
    with pytest.raises(ModelError, match="split models: into runs of"):
        embed_slide(blob_slide, "s", blob_tiles, out, models, params,
                           torch.device("cuda"), jobs_on_gpu=10**6)  # fmt: skip
