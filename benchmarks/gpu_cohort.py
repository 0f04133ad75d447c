"""The workflow on a small cohort with one GPU slot, and how busy the GPU was per slide.

Synthetic 40x slides of growing size, then `snakemake --resources gpu=1` (one embedding
job on the GPU at a time, masking and tiling on the other cores), timed from the
command's start to its end. Per slide, from its metrics.json: tiles, the whole job's
seconds (process start to last byte), its start-up, the model's own seconds (CUDA events)
and the GPU's duty, the share of the job's wall time the GPU was busy with the model.
For the cohort: tiles ÷ the run's wall clock, the model's seconds over it, and where
nvidia-smi is at hand its mean utilization over the run. Part of benchmarks/gpu_check.sh;
with --model and a CPU it runs the same steps there (benchmarks/gpu_kit_offline.py).

    python benchmarks/gpu_cohort.py [--model h-optimus-0] [--precision fp16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

from slidesnake.slides.synthetic import random_blobs, write_slide

REPO = Path(__file__).resolve().parents[1]
# Level-0 sides at 0.25 µm/px (the large one takes 40 s to write, the others alongside).
SIDES = {"small": (12000, 9000), "medium": (24000, 18000), "large": (36000, 27000)}
ON_CPU = {"small": (4000, 3000), "medium": (6000, 4500)}


def write_cohort(workdir: Path, sides: dict[str, tuple[int, int]], model: dict) -> Path:
    """Slides, a sample sheet and a config: the default config with `model` over it."""
    (workdir / "slides").mkdir(parents=True)
    paths = {slide_id: workdir / "slides" / f"{slide_id}.svs" for slide_id in sides}
    with ProcessPoolExecutor(len(sides)) as pool:
        written = [
            pool.submit(write_slide, paths[slide_id], width, height,
                        random_blobs(width, height, 3, seed), mpp=0.25)
            for seed, (slide_id, (width, height)) in enumerate(sides.items())
        ]  # fmt: skip
    for slide in written:
        slide.result()
    rows = ["slide_id\tpath", *(f"{slide_id}\t{path}" for slide_id, path in paths.items())]
    (workdir / "samples.tsv").write_text("\n".join(rows) + "\n")
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["samples"] = str(workdir / "samples.tsv")
    config["model"] |= model
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    return workdir / "config.yaml"


class Utilization:
    """nvidia-smi's GPU utilization, sampled every 200 ms while the run lasts."""

    def __init__(self, log: Path) -> None:
        self.log, self.process = log, None
        if shutil.which("nvidia-smi"):
            command = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                       "-lms", "200"]  # fmt: skip
            self.process = subprocess.Popen(command, stdout=log.open("w"))

    def mean(self) -> float | None:
        if self.process is None:
            return None
        self.process.terminate()
        self.process.wait()
        samples = [float(v) for v in self.log.read_text().split() if v.replace(".", "").isdigit()]
        return sum(samples) / len(samples) / 100 if samples else None


def run_cohort(workdir: Path, config: Path, cores: int, out: Path) -> tuple[float, float | None]:
    """The workflow, as a user runs it on a one-GPU workstation: its wall time, and the
    GPU's mean utilization over it where nvidia-smi says."""
    command = [sys.executable, "-m", "snakemake", "--cores", str(cores), "--resources", "gpu=1",
               "--scheduler", "greedy", "--snakefile", str(REPO / "workflow" / "Snakefile"),
               "--directory", str(workdir), "--configfile", str(config)]  # fmt: skip
    utilization = Utilization(out / "nvidia-smi-utilization.txt")
    started = time.perf_counter()
    with (out / "snakemake.log").open("w") as log:
        answer = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    mean = utilization.mean()
    if answer.returncode != 0:
        raise SystemExit(f"the workflow failed: see {out / 'snakemake.log'}")
    return wall, mean


def slide_rows(workdir: Path, slide_ids: list[str], out: Path) -> list[dict]:
    rows = []
    for slide_id in slide_ids:
        folder = workdir / "results" / "slides" / slide_id
        metrics = json.loads((folder / "metrics.json").read_text())
        shutil.copy(folder / "metrics.json", out / f"metrics-{slide_id}.json")
        rows.append({"slide": slide_id, **metrics})
    return rows


def table(rows: list[dict], wall: float, utilization: float | None) -> str:
    lines = [
        "| slide | tiles | whole job s | start-up s | model s | GPU duty | tiles/s (job) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['slide']} | {r['tiles']} | {r['job_s']:.1f} | {r['startup_s']:.1f} "
            f"| {r['model_s']:.2f} | {100 * r['model_busy_fraction']:.0f}% "
            f"| {r['tiles'] / r['job_s']:.0f} |"
        )
    tiles, model_s = sum(r["tiles"] for r in rows), sum(r["model_s"] for r in rows)
    device = rows[0]["device_name"]
    seen = "" if utilization is None else f"; nvidia-smi utilization {100 * utilization:.0f}%"
    lines.append(
        f"\nCohort on {device}: {tiles} tiles in {wall:.1f} s ({tiles / wall:.0f} tiles/s, "
        f"the whole run), model {model_s:.1f} s = {100 * model_s / wall:.0f}% of it{seen}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="h-optimus-0")
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")))
    args = parser.parse_args()
    out = args.out / "cohort"
    out.mkdir(parents=True, exist_ok=True)
    import torch

    sides = SIDES if torch.cuda.is_available() else ON_CPU
    model = {"name": args.model, "weights": "random", "precision": args.precision}
    with tempfile.TemporaryDirectory(prefix="slidesnake-gpu-cohort-") as folder:
        workdir = Path(folder)
        config = write_cohort(workdir, sides, model)
        config_text = yaml.safe_load(config.read_text())
        config_text["loader"]["workers"] = args.workers
        config.write_text(yaml.safe_dump(config_text))
        wall, utilization = run_cohort(workdir, config, args.cores, out)
        rows = slide_rows(workdir, list(sides), out)
    shown = table(rows, wall, utilization)
    (out / "table.md").write_text(shown + "\n")
    print(shown)


if __name__ == "__main__":
    main()
