"""A whole cohort, slidesnake against slide2vec and TRIDENT, from nothing to tile embeddings.

Eight slides of real pixels (from ../shared/slides), the mix of a hospital's cohort: two
large and two small 40x Aperio slides and two 20x ones, made of mosaics of
CMU-1-Small-Region's H&E (the 40x ones upsampled twice), and the real JPEG 2000 TCGA scan
twice. slidesnake runs `snakemake --cores 2` (one loader worker per embedding job, the
warm interpreter on, `loader.decode` as a fresh results folder gets it: scaled), as a
user gets it; slide2vec runs the same cohort in one process (`Pipeline.run`, its
README's batch) at its best setting on 2 cores: cuCIM's reader, one thread per DataLoader
worker, 2 workers (its default of 4 cuCIM threads leaves one worker); TRIDENT runs its
three jobs in one process (`benchmarks/peer_trident.py`: Otsu segmentation, patching,
patch features with 2 DataLoader workers through OpenSlide). Same models, same
weights, on this CPU in fp32: the near-free model (channel means: the `.pt2` program
here, an nn.Module there) and a ViT-S whose random weights both read from one safetensors
file. Tiles: 224 px at 0.5 µm/px, no overlap; slidesnake keeps a tile half covered by its
tissue mask (mask_threshold 0.5, its default). Each peer runs twice: with its own tiles
(hs2p's min_coverage 0.5, which keeps about 30% more here: hs2p's HSV mask draws tissue
wider; TRIDENT's min_tissue_proportion 0, any tile touching tissue) and aligned at our
count (min_coverage 0.75; min_tissue_proportion 0.5), within a few percent. The counts are
printed, and each tool's tiles/s is its own tiles over its own wall time, process start
to exit. Rounds interleave the tools; medians. Also printed, from slidesnake's metrics
and Snakemake's record: its embedding start-up against its loops and each rule's time
per job; and, with the near-free model, the run to the default target (slide features,
maps, the cohort summary).

    make peer-env TRIDENT_SRC=... && python benchmarks/cohort_vs_peer.py [--rounds 2]
        [--models near-free vit-s] [--peers slide2vec TRIDENT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np
import openslide
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from slidesnake.slides.synthetic import PixelRenderer, write_rendered

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "slides"
PEER_PYTHON = REPO / ".venv-peer" / "bin" / "python"
# Each peer's two runs by the tissue share a tile needs: its own default, and the share
# that gives about our tile count (hs2p's min_coverage; TRIDENT's min_tissue_proportion).
PEERS = {
    "slide2vec": {"its own tiles": 0.5, "aligned": 0.75},
    "TRIDENT": {"its own tiles": 0.0, "aligned": 0.5},
}
sys.path.insert(0, str(REPO / "benchmarks"))

from cohort_loop import job_seconds  # noqa: E402
from whole_job import near_free_model  # noqa: E402


def real_pixels() -> np.ndarray:
    with openslide.OpenSlide(str(SHARED / "CMU-1-Small-Region.svs")) as slide:
        return np.asarray(slide.read_region((0, 0), 0, slide.dimensions).convert("RGB"))


def mosaic(rgb: np.ndarray, columns: int, rows: int, seed: int) -> np.ndarray:
    """`rows` x `columns` copies of `rgb`, each flipped its own way: tissue everywhere,
    no two neighbours alike."""
    flips = np.random.default_rng(seed).integers(0, 4, (rows, columns))
    pick = {0: rgb, 1: rgb[:, ::-1], 2: rgb[::-1], 3: rgb[::-1, ::-1]}
    return np.concatenate([np.concatenate([pick[f] for f in row], axis=1) for row in flips])


def make_cohort(cache: Path) -> dict[str, tuple[Path, float | None]]:
    """slide id -> (path, the sheet's mpp where the slide records none)."""
    cohort, rgb = {}, None
    for name, (columns, rows, mpp) in {
        "40x-a": (3, 2, 0.25), "40x-b": (2, 3, 0.25), "40x-small-a": (1, 1, 0.25),
        "40x-small-b": (2, 1, 0.25), "20x-a": (4, 2, 0.5), "20x-b": (3, 3, 0.5),
    }.items():  # fmt: skip
        path = cache / f"peer-{name}.svs"
        if not path.exists():
            rgb = real_pixels() if rgb is None else rgb
            pixels = mosaic(rgb, columns, rows, seed=len(cohort))
            height, width = pixels.shape[:2]
            if mpp == 0.25:  # twice the size: a 40x scan of the same tissue
                height, width = 2 * height, 2 * width
                pixels = np.asarray(Image.fromarray(pixels).resize((width, height), Image.BICUBIC))
            write_rendered(path, PixelRenderer(pixels), width, height, mpp=mpp, levels=3)
        cohort[name] = (path, None)
    for name in ("j2k-a", "j2k-b"):  # no mpp recorded: both tools are told 0.5
        cohort[name] = (SHARED / "tcga-cr-7395-01a-01-ts1.svs", 0.5)
    return cohort


def vit_small_weights(cache: Path) -> Path:
    path = cache / "vit-small-random.safetensors"
    if not path.exists():
        torch.manual_seed(0)
        model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return path


MODELS = {
    "near-free": lambda cache: {"name": "custom", "checkpoint": str(near_free_model(cache))},
    "vit-s": lambda cache: {
        "name": "timm:vit_small_patch16_224", "checkpoint": str(vit_small_weights(cache)),
    },
}  # fmt: skip


class Slidesnake:
    def __init__(self, workdir: Path, cohort: dict, model: dict) -> None:
        self.dir, self.ids = workdir, list(cohort)
        (workdir / "config").mkdir(parents=True, exist_ok=True)
        config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        config["model"] |= model | {"precision": "fp32", "weights": "checkpoint"}
        config["loader"] |= {"workers": 1}
        (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
        rows = ["slide_id\tpath\tmpp"]
        rows += [f"{i}\t{p}\t{'' if m is None else m}" for i, (p, m) in cohort.items()]
        (workdir / "config" / "samples.tsv").write_text("\n".join(rows) + "\n")

    def run(self, default_target: bool) -> dict:
        for earlier in ("results", "logs", ".snakemake"):
            shutil.rmtree(self.dir / earlier, ignore_errors=True)
        targets = (
            [] if default_target else [f"results/slides/{i}/embeddings.zarr" for i in self.ids]
        )
        command = [sys.executable, "-m", "snakemake", "--snakefile",
                   str(REPO / "workflow" / "Snakefile"), "--cores", "2", *targets]  # fmt: skip
        wall = timed(command, self.dir)
        metrics = {
            i: json.loads((self.dir / "results" / "slides" / i / "metrics.json").read_text())
            for i in self.ids
        }
        return {
            "wall_s": wall,
            "tiles": {i: m["tiles"] for i, m in metrics.items()},
            "startup_s": sum(m["startup_s"] for m in metrics.values()),
            "loop_s": sum(m["wall_s"] for m in metrics.values()),
            "jobs": {rule: median(s) for rule, s in job_seconds(self.dir).items()},
        }


def run_peer(
    peer: str, workdir: Path, cohort: dict, model: str, weights: Path, share: float
) -> dict:
    """One run of `peer` on the cohort, keeping tiles `share` covered by its tissue."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    if peer == "slide2vec":
        rows = ["sample_id,image_path,spacing_at_level_0"]
        rows += [f"{i},{p},{'' if m is None else m}" for i, (p, m) in cohort.items()]
        (workdir / "manifest.csv").write_text("\n".join(rows) + "\n")
        command = [str(PEER_PYTHON), str(REPO / "benchmarks" / "peer_slide2vec.py"),
                   "manifest.csv", "out", model, "--weights", str(weights),
                   "--min-coverage", str(share)]  # fmt: skip
    else:  # TRIDENT reads a folder of slides named by their ids
        (workdir / "slides").mkdir()
        rows = ["wsi,mpp"]
        for i, (path, mpp) in cohort.items():
            (workdir / "slides" / f"{i}{path.suffix}").symlink_to(path)
            rows.append(
                f"{i}{path.suffix},{mpp or openslide.OpenSlide(path).properties['openslide.mpp-x']}"
            )
        (workdir / "slides" / "slides.csv").write_text("\n".join(rows) + "\n")
        command = [str(PEER_PYTHON), str(REPO / "benchmarks" / "peer_trident.py"),
                   "slides/slides.csv", "job", model, "--weights", str(weights),
                   "--min-tissue", str(share)]  # fmt: skip
    wall = timed(command, workdir, keep_stdout=True)
    tiles = json.loads((workdir / "stdout.txt").read_text().strip().splitlines()[-1])
    return {"wall_s": wall, "tiles": tiles}


def timed(command: list[str], cwd: Path, keep_stdout: bool = False) -> float:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{done.stderr[-3000:]}")
    if keep_stdout:
        (cwd / "stdout.txt").write_text(done.stdout)
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS))
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    if not SHARED.is_dir() or not PEER_PYTHON.exists():
        sys.exit("needs ../shared/slides (the real pixels) and the peers' env (make peer-env)")
    if "TRIDENT" in args.peers and subprocess.run([PEER_PYTHON, "-c", "import trident"]).returncode:
        sys.exit("TRIDENT is not in the peers' env: make peer-env TRIDENT_SRC=<a checkout of "
                 "mahmoodlab/TRIDENT> (it is not on PyPI), or run --peers slide2vec")  # fmt: skip
    args.cache.mkdir(parents=True, exist_ok=True)
    cohort = make_cohort(args.cache)
    for model in args.models:
        ours = Slidesnake(args.cache / f"peer-ours-{model}", cohort, MODELS[model](args.cache))
        weights = vit_small_weights(args.cache)
        rounds = []
        theirs = args.cache / f"peer-theirs-{model}"
        for _ in range(args.rounds):
            rounds.append({
                "ours": ours.run(default_target=False),
                **{(peer, run): run_peer(peer, theirs, cohort, model, weights, share)
                   for peer in args.peers for run, share in PEERS[peer].items()},
                "default": ours.run(True)["wall_s"] if model == "near-free" else None,
            })  # fmt: skip
        report(model, rounds, args.peers)


def report(model: str, rounds: list[dict], peers: list[str]) -> None:
    ours = rounds[0]["ours"]["tiles"]
    total_ours = sum(ours.values())
    wall_ours = median(r["ours"]["wall_s"] for r in rounds)
    rate_ours = total_ours / wall_ours
    runs = [(peer, run) for peer in peers for run in PEERS[peer]]
    print(f"\n{model}: tiles per slide (slidesnake / {' / '.join(' '.join(r) for r in runs)}):")
    print("  " + ", ".join(
        f"{i} {ours[i]}/" + "/".join(str(rounds[0][run]["tiles"].get(i, 0)) for run in runs)
        for i in ours
    ))  # fmt: skip
    print(f"  {'':<36} {'tiles':>6} {'wall s':>7} {'tiles/s':>8} {'ours ÷ it':>9}")
    print(f"  {'slidesnake, --cores 2':<36} {total_ours:6d} {wall_ours:7.1f} {rate_ours:8.1f}")
    for peer, run in runs:
        total = sum(rounds[0][peer, run]["tiles"].values())
        wall = median(r[peer, run]["wall_s"] for r in rounds)
        print(f"  {peer + ', ' + run:<36} {total:6d} {wall:7.1f} {total / wall:8.1f} "
              f"{rate_ours / (total / wall):8.2f}x")  # fmt: skip
    startup = median(r["ours"]["startup_s"] for r in rounds)
    loops = median(r["ours"]["loop_s"] for r in rounds)
    print(f"  slidesnake's embedding start-up, summed: {startup:.1f} s "
          f"({100 * startup / wall_ours:.0f}% of the wall time; loops {loops:.1f} s)")  # fmt: skip
    for rule in sorted(rounds[0]["ours"]["jobs"]):
        each = median(r["ours"]["jobs"][rule] for r in rounds)
        print(f"    {rule:<22} {each:5.2f} s a job")
    if rounds[0]["default"] is not None:
        default = median(r["default"] for r in rounds)
        print(
            f"  slidesnake to its default target (slide features, maps, summary): {default:.1f} s"
        )


if __name__ == "__main__":
    main()
