"""The whole embedding job with a model that costs nothing, against the per-tile baseline.

With the model out of the way, what is left is what a job adds around it: start-up, the
loader, preprocessing in the main process and writing. `slidesnake embed` runs in a fresh
process, as Snakemake runs it, with an average-pooling `.pt2` program (3 numbers per
tile) on the 40x bench slide, with 1 and 2 loader workers, on the CPU. The baseline is
one `read_region` + PIL resize per tile (CLAM's and TRIDENT's pattern), measured in this
process in the same run. Rounds alternate baseline and jobs, and each job runs with
every `--decode` method (exact: every 40x pixel decoded and resized; scaled: the JPEG
tiles decoded at half size), with the ratio of the two.

    python benchmarks/whole_job.py [--slide-px 60000 40000] [--rounds 2] [--decode exact]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import median

import torch

from slidesnake.bench import (
    embed_job,
    limit_tiles,
    per_tile_baseline,
    synthetic_slide,
    tile_slide,
)
from slidesnake.slides.synthetic import BENCH_SLIDES


class AveragePool(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3))


def near_free_model(directory: Path) -> Path:
    path = directory / "average-pool.pt2"
    batch = torch.export.Dim("batch", min=1, max=4096)
    example = (torch.zeros(2, 3, 224, 224),)
    program = torch.export.export(AveragePool(), example, dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def job(slide, model: Path, workers: int, decode: str, out: Path) -> dict:
    return embed_job(
        slide, out, "--model", "custom", "--checkpoint", str(model), "--precision", "fp32",
        "--workers", str(workers), "--decode", decode,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=None, help="only the first N tiles")
    parser.add_argument(
        "--slide-px", type=int, nargs=2, default=BENCH_SLIDES["40x"][:2], metavar=("W", "H"),
        help="the synthetic 40x slide's size (default: the bench slide, 1,728 tiles)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--decode", nargs="+", default=["exact", "scaled"])
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    model = near_free_model(args.cache)
    slide = synthetic_slide(args.cache, *args.slide_px, mpp=0.25, dense=True)
    tiled = limit_tiles(tile_slide(slide, args.cache), args.tiles)
    runs = [(workers, decode) for workers in args.workers for decode in args.decode]
    rounds = []
    for _ in range(args.rounds):
        row = {"baseline": per_tile_baseline(limit_tiles(tiled, 400))}
        for workers, decode in runs:
            out = args.cache / f"whole-job-{workers}-{decode}"
            row[workers, decode] = job(tiled, model, workers, decode, out)
        rounds.append(row)
    tiles = rounds[0][runs[0]]["tiles"]
    baseline = median(r["baseline"] for r in rounds)
    print(f"{slide.name}, {tiles} tiles, near-free model (average pooling .pt2), CPU, "
          f"{args.rounds} rounds, medians")  # fmt: skip
    print(f"  {'':<60} {'tiles/s':>8} {'x baseline':>11}")
    print(f"  {'per-tile read_region + PIL resize (baseline)':<60} {baseline:8.1f} {1:10.2f}x")
    for workers, decode in runs:
        show(rounds, workers, decode, baseline)
    if {"exact", "scaled"} <= set(args.decode):
        for workers in args.workers:
            for what, rate in (("loop", loop_rate), ("whole job", job_rate)):
                gain = median(rate(r[workers, "scaled"]) / rate(r[workers, "exact"])
                              for r in rounds)  # fmt: skip
                print(f"  {f'scaled over exact, {what}, {workers} worker(s)':<60} {gain:7.2f}x")


def loop_rate(metrics: dict) -> float:
    return metrics["tiles_per_s"]


def job_rate(metrics: dict) -> float:
    return metrics["tiles"] / metrics["job_s"]


def show(rounds: list[dict], workers: int, decode: str, baseline: float) -> None:
    runs = [r[workers, decode] for r in rounds]
    loop, whole = median(map(loop_rate, runs)), median(map(job_rate, runs))
    wait = median(m["loader_wait_fraction"] for m in runs)
    startup = median(m["startup_s"] for m in runs)
    label = f"{workers} worker{'s' * (workers > 1)}, {decode}"
    print(f"  {f'embedding loop, {label} (loader wait {100 * wait:.0f}%)':<60} "
          f"{loop:8.1f} {loop / baseline:10.2f}x")  # fmt: skip
    print(f"  {f'whole job, {label} (start-up {startup:.1f} s)':<60} "
          f"{whole:8.1f} {whole / baseline:10.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
