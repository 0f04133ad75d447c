"""The fixed cost of an embedding job with H-optimus-0, beside the floor, in one run.

A cohort pays this per slide; with a GPU that embeds a slide's tiles in seconds, it
decides how busy the GPU is. The floor is what no job can avoid: start Python, import
torch, timm and slidesnake, and read the weights file once. The job is `slidesnake embed`
on a one-tile slide from an fp16 safetensors checkpoint of H-optimus-0's architecture
(random values, 2.27 GB; made once and kept), in a fresh process, as Snakemake runs it.
Its `startup_s` (process start to the first batch handed to the model) and parts come
from its metrics.json. Rounds alternate floor and job so both see the same page cache.

    python benchmarks/startup.py [--rounds 3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from slidesnake.bench import embed_job, limit_tiles, synthetic_slide, tile_slide

PARTS = (
    "imports_s",
    "model_build_s",
    "weights_load_s",
    "to_device_s",
    "width_s",
    "first_batch_after_model_s",
)
FLOOR = """
import sys, torch, timm, slidesnake
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 24):
        pass
"""


def h_optimus_checkpoint(cache: Path) -> Path:
    """An fp16 safetensors file of H-optimus-0's shapes, with random values."""
    path = cache / "h-optimus-0-random-fp16.safetensors"
    if path.exists():
        return path
    import torch
    from safetensors.torch import save_file

    from slidesnake.models.embedder import build_network
    from slidesnake.models.registry import REGISTRY

    with torch.device("meta"):
        shapes = build_network(REGISTRY["h-optimus-0"], 224).network.state_dict()
    generator = torch.Generator().manual_seed(0)
    state = {
        name: (torch.rand(t.shape, generator=generator) * 0.02 - 0.01).half()
        for name, t in shapes.items()
    }
    save_file(state, str(path))
    return path


def floor_s(weights: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", FLOOR, str(weights)], check=True)
    return time.perf_counter() - started


def job(slide, weights: Path, out: Path) -> dict:
    return embed_job(
        slide, out, "--model", "h-optimus-0", "--checkpoint", str(weights),
        "--precision", "fp16", "--workers", "1", "--batch-size", "1",
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    weights = h_optimus_checkpoint(args.cache)
    slide = limit_tiles(tile_slide(synthetic_slide(args.cache, 8000, 6000, mpp=0.5), args.cache), 1)
    floors, jobs = [], []
    for round_ in range(args.rounds):
        floors.append(floor_s(weights))
        jobs.append(job(slide, weights, args.cache / f"startup-{round_}"))
    floor = median(floors)
    startup = median(m["startup_s"] for m in jobs)
    print(f"H-optimus-0, fp16 safetensors {weights.stat().st_size / 1e9:.2f} GB, "
          f"{jobs[0]['device']}, {args.rounds} rounds, medians")  # fmt: skip
    print(f"  floor (python + import torch, timm, slidesnake + read weights once): {floor:6.1f} s")
    print(
        f"  job fixed cost (process start -> first batch in the model):          {startup:6.1f} s"
    )
    for part in PARTS:
        print(f"    {part:<28} {median(m[part] for m in jobs):6.1f} s")
    print(f"  whole job, one tile (process start -> last byte written):            "
          f"{median(m['job_s'] for m in jobs):6.1f} s")  # fmt: skip
    target = 1.5 * floor + 2
    verdict = "meets" if startup <= target else "misses"
    print(f"  fixed cost / floor: {startup / floor:.2f}; target 1.5 x floor + 2 s = "
          f"{target:.1f} s: {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
