"""Three models from one read against three single-model jobs, whole jobs timed.

What a user runs to compare encoders: the same 40x slide embedded by three models. Each
job is `slidesnake embed` in a fresh process, as Snakemake runs it, timed from outside
(process start to the last byte written). The one job takes the three models with
`--models`; the baseline is three jobs of one model each, run in the same rounds.
Models have random weights. `--set small` (the default): the near-free average-pooling
`.pt2` program, a ViT-Tiny and a ViT-S at 224 px, on the CPU; a ViT-S is ~12 tiles/s
here, so the models' own time bounds what one read can save, and `--tiles` keeps the run
to minutes. `--set cheap`: models that cost little next to the read, as on a GPU (where
an H200 runs a ViT-S at thousands of tiles/s): the pooling program on the whole tile and
on its centre, and a ViT-Tiny at 112 px.

    python benchmarks/model_list.py [--set small|cheap] [--tiles 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch
import yaml
from whole_job import AveragePool

from slidesnake.bench import limit_tiles, synthetic_slide, tile_slide
from slidesnake.slides.synthetic import BENCH_SLIDES

TINY = {"name": "timm:vit_tiny_patch16_224", "weights": "random"}
SETS = {
    "small": {
        "pool": {},
        "vit_tiny": TINY,
        "vit_small": {"name": "timm:vit_small_patch16_224", "weights": "random"},
    },
    "cheap": {
        "pool": {},
        "pool_centre": {"input_size": 112, "input_mpp": 0.5},
        "vit_tiny_112": TINY | {"input_size": 112},
    },
}


def near_free_model(directory: Path) -> Path:
    """The average-pooling program, for tiles of any size (3 numbers per tile)."""
    path = directory / "average-pool-any-size.pt2"
    batch = torch.export.Dim("batch", min=1, max=4096)
    side = torch.export.Dim("side", min=16, max=1024)
    example = (torch.zeros(2, 3, 224, 224),)
    shapes = ({0: batch, 2: side, 3: side},)
    torch.export.save(torch.export.export(AveragePool(), example, dynamic_shapes=shapes), path)
    return path


def model_sections(name: str, program: Path) -> dict[str, dict]:
    """The set's model sections; the pooling ones run the near-free program."""
    pool = {"name": "custom", "checkpoint": str(program)}
    sections = {key: section if "name" in section else pool | section
                for key, section in SETS[name].items()}  # fmt: skip
    return {key: section | {"precision": "fp32"} for key, section in sections.items()}


def embed(slide, out: Path, models: dict[str, dict], workers: int) -> dict:
    """One `slidesnake embed --models` job in a fresh process: each model's metrics, and
    the process's own seconds."""
    listing = out / "models.yaml"
    out.mkdir(parents=True, exist_ok=True)
    listing.write_text(yaml.safe_dump(models, sort_keys=False))
    for key in models:  # a fresh job: nothing current
        (out / key / "metrics.json").unlink(missing_ok=True)
    command = [sys.executable, "-m", "slidesnake", "embed", str(slide.path), str(slide.tiles),
               str(out), "--models", str(listing), "--workers", str(workers)]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    seconds = time.perf_counter() - started
    metrics = {key: json.loads((out / key / "metrics.json").read_text()) for key in models}
    return {"process_s": seconds, "models": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), default="small", help="the three models")
    parser.add_argument("--tiles", type=int, default=300, help="the first N tiles of the slide")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    models = model_sections(args.set, near_free_model(args.cache))
    slide = synthetic_slide(args.cache, *BENCH_SLIDES["40x"][:2], mpp=0.25, dense=True)
    tiled = limit_tiles(tile_slide(slide, args.cache), args.tiles)
    rounds = []
    for _ in range(args.rounds):
        row = {"one": embed(tiled, args.cache / "models-one", models, args.workers)}
        for key, section in models.items():
            row[key] = embed(tiled, args.cache / f"models-{key}", {key: section}, args.workers)
        rounds.append(row)
    report(rounds, list(models), slide.name, args)


def report(rounds: list[dict], keys: list[str], slide: str, args) -> None:
    first = rounds[0]["one"]["models"][keys[0]]
    tiles = first["tiles"]
    one = median(r["one"]["process_s"] for r in rounds)
    alone = {key: median(r[key]["process_s"] for r in rounds) for key in keys}
    print(f"models {', '.join(keys)}; {slide}, {tiles} tiles (224 px at 0.5 µm/px from "
          f"40x), CPU, {args.workers} loader worker(s), {args.rounds} rounds, medians; "
          "whole jobs, process start to last byte")  # fmt: skip
    print(f"  {'':<44} {'job s':>7} {'tiles/s':>8} {'decoded':>8}")
    for key in keys:
        decoded = rounds[0][key]["models"][key]["compressed_tiles_decoded"]
        print(f"  {f'{key} alone':<44} {alone[key]:7.1f} {tiles / alone[key]:8.1f} {decoded:8d}")
    total = sum(alone.values())
    decoded = first["compressed_tiles_decoded"]
    print(f"  {'three single-model jobs, total':<44} {total:7.1f} {tiles / total:8.1f} "
          f"{decoded * len(keys):8d}")  # fmt: skip
    print(f"  {'one job, three models (--models)':<44} {one:7.1f} {tiles / one:8.1f} {decoded:8d}")
    models_s = {key: median(r["one"]["models"][key]["model_s"] for r in rounds) for key in keys}
    print(f"  one job / three jobs: {one / total:.2f}x; the models' own time alone would "
          f"give {sum(models_s.values()) / total:.2f}x at best")  # fmt: skip
    for key, seconds in models_s.items():
        print(f"    {key}: model time in the one job {seconds:.1f} s")


if __name__ == "__main__":
    main()
