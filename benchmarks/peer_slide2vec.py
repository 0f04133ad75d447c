"""slide2vec on a cohort, in one process, as its README runs a batch: the peer side of
benchmarks/cohort_vs_peer.py. Runs in slide2vec's own environment (`make peer-env`), so it
imports nothing of slidesnake.

The models are slidesnake's benchmark models, registered as slide2vec tile encoders: the
near-free one (the mean of each channel, what the `.pt2` program computes) and a ViT-S
with the weights of the given safetensors file, on the CPU in fp32. Tiles: 224 px at
0.5 µm/px, no overlap, kept when tissue covers `--min-coverage` of them. Read at its best
setting on 2 cores: cuCIM's reader with one thread per DataLoader worker and 2 workers
(its default gives 4 cuCIM threads, hence one worker). Prints one JSON line: the tile
count of each slide.

    python benchmarks/peer_slide2vec.py MANIFEST OUT {near-free,vit-s} [--weights F]
        [--min-coverage 0.5] [--backend cucim] [--cucim-threads 1] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import timm
import torch
from hs2p import DEFAULT_MASK_SAMPLING, TilingConfig
from safetensors.torch import load_file
from slide2vec import (
    ExecutionOptions,
    Model,
    Pipeline,
    PreprocessingConfig,
    TorchTileEncoder,
    register_encoder,
)

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
WEIGHTS = {"path": None}


class ChannelMeans(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


@register_encoder(
    "bench-near-free", encode_dim=3, input_size=224, supports_variable_input_size=False,
    supported_spacing_um=0.5, precision="fp32",
)  # fmt: skip
class NearFree(TorchTileEncoder):
    def __init__(self, *, output_variant: str | None = None):
        super().__init__(
            ChannelMeans(), encode_dim=3, input_size=224, output_variant=output_variant, **IMAGENET
        )


@register_encoder(
    "bench-vit-s", encode_dim=384, input_size=224, supports_variable_input_size=False,
    supported_spacing_um=0.5, precision="fp32",
)  # fmt: skip
class ViTSmall(TorchTileEncoder):
    def __init__(self, *, output_variant: str | None = None):
        model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0)
        model.load_state_dict(load_file(WEIGHTS["path"]))
        super().__init__(
            model, encode_dim=384, input_size=224, output_variant=output_variant, **IMAGENET
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("model", choices=["near-free", "vit-s"])
    parser.add_argument("--weights", type=Path)
    parser.add_argument("--min-coverage", type=float, default=0.5, help="hs2p's, of tissue")
    parser.add_argument("--backend", default="cucim", choices=["cucim", "openslide"])
    parser.add_argument("--cucim-threads", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    args = parser.parse_args()
    WEIGHTS["path"] = str(args.weights) if args.weights else None
    preprocessing = PreprocessingConfig(
        tiling=TilingConfig(
            requested_spacing_um=0.5, requested_tile_size_px=224, tolerance=0.05, overlap=0.0,
            backend=args.backend,
        ),
        masks=replace(DEFAULT_MASK_SAMPLING, min_coverage={"tissue": args.min_coverage}),
        num_cucim_workers=args.cucim_threads,
    )  # fmt: skip
    pipeline = Pipeline(
        model=Model.from_preset(f"bench-{args.model}", device="cpu"),
        preprocessing=preprocessing,
        execution=ExecutionOptions(
            output_dir=args.out,
            output_format="npz",
            precision="fp32",
            num_workers_per_gpu=args.workers,
        ),
    )
    result = pipeline.run(manifest_path=args.manifest)
    print(json.dumps({a.sample_id: a.num_tiles for a in result.tile_artifacts}))


if __name__ == "__main__":
    main()
