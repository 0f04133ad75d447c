"""TRIDENT on a cohort, in one process, as its batch script runs one: the peer side of
benchmarks/cohort_vs_peer.py. Runs in the peers' environment (`make peer-env`, TRIDENT
from a snapshot of its repository), so it imports nothing of slidesnake.

Its three jobs in turn: tissue segmentation with its Otsu segmenter (its deep ones need
weights from Hugging Face, out of reach here) at 10x, patching at 20x (0.5 µm/px) in
224 px patches without overlap, kept when tissue covers `--min-tissue` of them, and
patch features with slidesnake's benchmark models wrapped as custom encoders (the
near-free channel means, or a ViT-S with the given safetensors weights), on the CPU in
fp32, with `--workers` DataLoader workers. Prints one JSON line: the tile count of each
slide.

    python benchmarks/peer_trident.py SLIDES.csv JOB {near-free,vit-s} [--weights F]
        [--min-tissue 0.5] [--workers 2]

SLIDES.csv: columns wsi (a path relative to the csv's folder) and mpp.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import h5py
import timm
import torch
from safetensors.torch import load_file
from torchvision import transforms
from trident import Processor
from trident.patch_encoder_models.load import CustomInferenceEncoder
from trident.segmentation_models.load import segmentation_model_factory

IMAGENET = {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}


class ChannelMeans(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def encoder(model: str, weights: Path | None) -> CustomInferenceEncoder:
    if model == "near-free":
        network = ChannelMeans()
    else:
        network = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0)
        network.load_state_dict(load_file(str(weights)))
    preprocess = transforms.Compose([transforms.ToTensor(), transforms.Normalize(**IMAGENET)])
    return CustomInferenceEncoder(f"bench-{model}", network.eval(), preprocess, torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("slides", type=Path)
    parser.add_argument("job", type=Path)
    parser.add_argument("model", choices=["near-free", "vit-s"])
    parser.add_argument("--weights", type=Path)
    parser.add_argument("--min-tissue", type=float, default=0.5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    processor = Processor(
        job_dir=str(args.job),
        wsi_source=str(args.slides.parent),
        custom_list_of_wsis=str(args.slides),
        max_workers=args.workers,
    )
    processor.run_segmentation_job(segmentation_model_factory("otsu"), seg_mag=10, device="cpu")
    coords = "patches-20x-224px"  # under the job folder
    processor.run_patching_job(
        target_magnification=20,
        patch_size=224,
        saveto=coords,
        visualize=False,
        min_tissue_proportion=args.min_tissue,
    )
    processor.run_patch_feature_extraction_job(
        coords_dir=coords, patch_encoder=encoder(args.model, args.weights), device="cpu"
    )
    counts = {}
    for path in sorted((args.job / coords / "patches").glob("*.h5")):
        with h5py.File(path) as file:
            counts[path.name.removesuffix("_patches.h5")] = len(file["coords"])
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
