"""How far the scaled decode is from the exact path: pixels and embeddings, per slide.

For each slide, the same tiles (up to 256) are read both ways by our loader; the exact
path's larger reads are resized as the model's input always was (antialiased bilinear).
Printed: the grey-level difference of the model's inputs (mean, 99th percentile and
maximum, per channel) and, per tile, the cosine between the two inputs' embeddings from
the near-free pooling model (each normalised channel's mean) and a ViT-S (timm
`vit_small_patch16_224`, random weights, seed 0: no pretrained weights here), as median
and 1st percentile. Slides: the synthetic 40x slide as JPEG and as JPEG 2000, and from
../shared/slides a 40x mosaic of CMU-1-Small-Region's real H&E (upsampled twice), the
real JPEG 2000 TCGA scan told 0.25 µm/px (so that 0.5 needs half its pixels), and
CMU-1-Small-Region at its own 20x (nothing to scale: both paths agree exactly).

    .venv/bin/python benchmarks/decode_fidelity.py [--tiles 256]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import timm
import torch
from PIL import Image

from slidesnake.bench import tile_slide
from slidesnake.loader.batches import TileBatches
from slidesnake.models.embedder import resize_tiles
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import PixelRenderer, random_blobs, write_rendered, write_slide

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out" / "fidelity"
SHARED = REPO.parent / "shared" / "slides"
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


def slides() -> dict[str, tuple[Path, float | None]]:
    OUT.mkdir(parents=True, exist_ok=True)
    found = {}
    for codec in ("JPEG", "JPEG 2000"):
        path = OUT / f"synthetic-40x-{codec.replace(' ', '')}.svs"
        if not path.exists():
            shapes = random_blobs(8000, 6000, count=12, seed=3)
            write_slide(path, 8000, 6000, shapes, mpp=0.25, levels=3, seed=3, codec=codec)
        found[f"synthetic 40x, {codec}"] = (path, None)
    if SHARED.is_dir():
        found["CMU H&E upsampled to 40x, JPEG"] = (cmu_40x(OUT / "cmu-40x.svs"), None)
        found["TCGA JPEG 2000 told 0.25 µm/px"] = (SHARED / "tcga-cr-7395-01a-01-ts1.svs", 0.25)
        found["CMU-1-Small-Region at 20x"] = (SHARED / "CMU-1-Small-Region.svs", None)
    return found


def cmu_40x(path: Path) -> Path:
    if not path.exists():
        with Slide(SHARED / "CMU-1-Small-Region.svs") as slide:
            rgb = slide.read(0, 0, 0, *slide.dimensions)
        height, width = 2 * rgb.shape[0], 2 * rgb.shape[1]
        pixels = np.asarray(Image.fromarray(rgb).resize((width, height), Image.BICUBIC))
        write_rendered(path, PixelRenderer(pixels), width, height, mpp=0.25)
    return path


def model_inputs(path: Path, mpp: float | None, decode: str, count: int) -> np.ndarray:
    tiled = tile_slide(path, OUT, mpp)
    coords, geometry = tiled.coords()
    dataset = TileBatches(path, "fidelity", coords[:count], geometry, 32, decode=decode)
    got = {}
    for rows, pixels in dataset.stream(0, 2):
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2)
        if x.shape[-1] != geometry.size:
            x = resize_tiles(x, geometry.size)
        got |= dict(zip(rows.tolist(), x.float(), strict=True))
    return torch.stack([got[row] for row in range(len(got))]), dataset.plan.shrink


def embeddings(x: torch.Tensor, vit: torch.nn.Module) -> dict[str, torch.Tensor]:
    normalised = (x / 255 - MEAN[:, None, None]) / STD[:, None, None]
    with torch.inference_mode():
        return {"pooling": normalised.mean(dim=(2, 3)), "ViT-S": vit(normalised)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=256)
    options = parser.parse_args()
    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0).eval()
    print("| slide | scale | tiles | grey levels: mean / p99 / max | mean per channel (R, G, B) "
          "| cosine, pooling: median / 1st pct | cosine, ViT-S: median / 1st pct |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, (path, mpp) in slides().items():
        exact, _ = model_inputs(path, mpp, "exact", options.tiles)
        scaled, shrink = model_inputs(path, mpp, "scaled", options.tiles)
        difference = (exact - scaled).abs()
        per_channel = ", ".join(f"{v:.2f}" for v in difference.mean(dim=(0, 2, 3)).tolist())
        cosines = []
        pairs = zip(embeddings(exact, vit).values(), embeddings(scaled, vit).values(), strict=True)
        for a, b in pairs:
            cosine = torch.nn.functional.cosine_similarity(a, b, dim=1).numpy()
            cosines.append(f"{np.median(cosine):.4f} / {np.percentile(cosine, 1):.4f}")
        print(f"| {name} | 1/{shrink} | {len(exact)} | {difference.mean():.2f} / "
              f"{np.percentile(difference.numpy(), 99):.0f} / {difference.max():.0f} | "
              f"{per_channel} | {cosines[0]} | {cosines[1]} |")  # fmt: skip


if __name__ == "__main__":
    main()
