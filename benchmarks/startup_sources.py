"""An embedding job's start-up for every model source, against the floor, in one run.

The floor is what no job in its own process avoids: start Python and import torch
(`python -c "import torch"`), and read the weights file once. Each source runs
`slidesnake embed` on one tile in a fresh process and reads `startup_s` (process start
to the first batch in the model) from its metrics.json; the target is floor + 1 s.
Sources: a registry model (h0-mini, ViT-B/14, fp32 random weights) from safetensors, from
a PyTorch state dict (.bin) and from a `.pt2` export; `timm:vit_small_patch16_224` from
safetensors; and `custom` `.pt2` programs (the ViT-S, and the near-free channel means).
Rounds alternate floor and jobs, so all see the same page cache. Each source also runs as
the rule's job through the warm interpreter (`own` and `warm` columns): its start-up then
counts from the client's process start, as Snakemake starts it.

    python benchmarks/startup_sources.py [--rounds 3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from types import SimpleNamespace

import torch
import yaml
from safetensors.torch import save_file

from slidesnake.bench import embed_job, limit_tiles, synthetic_slide, tile_slide
from slidesnake.cohort.warm import socket_path
from slidesnake.models.embedder import build_network
from slidesnake.models.registry import REGISTRY, model_spec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from whole_job import near_free_model  # noqa: E402

PARTS = ("imports_s", "model_build_s", "weights_load_s", "width_s")
CLIENT = (
    "import pickle, sys; from slidesnake.cohort.warm import run_rule; "
    "run_rule(pickle.load(open(sys.argv[1], 'rb')), 'embed_tiles')"
)
FLOOR = """
import sys, torch
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 24):
        pass
"""


def random_network(name: str) -> torch.nn.Module:
    """The timm network of `name` (its class token is its output), random weights."""
    torch.manual_seed(0)
    spec = REGISTRY[name] if name in REGISTRY else model_spec(name)
    return build_network(spec, 224).network.eval()


def save_weights(network: torch.nn.Module, path: Path) -> None:
    save_file({k: v.contiguous() for k, v in network.state_dict().items()}, str(path))


def exported(network: torch.nn.Module, path: Path) -> Path:
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(
        network, (torch.zeros(2, 3, 224, 224),), dynamic_shapes=({0: batch},)
    )
    torch.export.save(program, str(path))
    return path


def checkpoints(cache: Path) -> dict[str, tuple[str, Path]]:
    """source -> (model.name, checkpoint), made once and kept in `cache`."""
    made = {
        "registry, safetensors": ("h0-mini", cache / "h0-mini.safetensors"),
        "registry, state dict (.bin)": ("h0-mini", cache / "h0-mini.bin"),
        "registry, .pt2 export": ("h0-mini", cache / "h0-mini.pt2"),
        "timm:, safetensors": ("timm:vit_small_patch16_224", cache / "vit-s.safetensors"),
        "custom .pt2 program (ViT-S)": ("custom", cache / "vit-s-program.pt2"),
    }
    if not all(path.exists() for _, path in made.values()):
        h0 = random_network("h0-mini")
        save_file(
            {k: v.contiguous() for k, v in h0.state_dict().items()},
            made["registry, safetensors"][1],
        )
        torch.save(h0.state_dict(), made["registry, state dict (.bin)"][1])
        exported(h0, made["registry, .pt2 export"][1])
        vit_s = random_network("timm:vit_small_patch16_224")
        save_file(
            {k: v.contiguous() for k, v in vit_s.state_dict().items()},
            made["timm:, safetensors"][1],
        )
        exported(vit_s, made["custom .pt2 program (ViT-S)"][1])
    made["custom .pt2 program (near-free)"] = ("custom", near_free_model(cache))
    return made


def warm_job(slide, name: str, checkpoint: Path, out: Path) -> dict:
    """The rule's job with the `snakemake` object it reads, through the warm interpreter's
    client in a fresh process, as a rule's script runs it: its metrics.json."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["model"] |= {"name": name, "checkpoint": str(checkpoint), "precision": "fp32"}
    config["model"]["weights"] = "checkpoint"
    config["loader"] |= {"workers": 1}
    job = SimpleNamespace(
        params=SimpleNamespace(slide=str(slide.path)),
        wildcards=SimpleNamespace(slide_id=slide.path.stem),
        input=SimpleNamespace(tiles=str(slide.tiles)),
        output=SimpleNamespace(zarr=str(out / "embeddings.zarr"), metrics=str(out / "m.json")),
        log=[str(out / "job.log")],
        config=config,
    )
    (out / "job.pickle").write_bytes(pickle.dumps(job))
    env = os.environ | {"OMP_NUM_THREADS": "2"}  # as Snakemake sets it for this job
    subprocess.run([sys.executable, "-c", CLIENT, str(out / "job.pickle")], check=True, env=env)
    return json.loads((out / "m.json").read_text())


def start_server(directory: Path) -> subprocess.Popen:
    directory.mkdir(mode=0o700, exist_ok=True)
    os.environ["SLIDESNAKE_WARM_DIR"] = str(directory)
    path = socket_path()
    server = subprocess.Popen([sys.executable, "-m", "slidesnake.cohort.warm", str(path)])
    while not path.exists():
        time.sleep(0.1)
    return server


def seconds(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    sources = checkpoints(args.cache)
    slide = synthetic_slide(args.cache, 8000, 6000, mpp=0.5)
    slide = limit_tiles(tile_slide(slide, args.cache), 1)
    rows = {source: {"floor": [], "read": [], "job": [], "warm": []} for source in sources}
    server = start_server(args.cache / "warm")
    for name, path in sources.values():  # the server imports each kind of job's modules
        warm_job(slide, name, path, args.cache / "startup-warm")
    for round_ in range(args.rounds):
        for source, (name, path) in sources.items():
            row = rows[source]
            row["floor"].append(seconds([sys.executable, "-c", "import torch"]))
            with_read = seconds([sys.executable, "-c", FLOOR, str(path)])
            row["read"].append(with_read - row["floor"][-1])
            metrics = embed_job(
                slide, args.cache / f"startup-{round_}", "--model", name, "--checkpoint", str(path),
                "--weights", "checkpoint", "--precision", "fp32", "--workers", "1",
            )  # fmt: skip
            row["job"].append(metrics)
            row["warm"].append(warm_job(slide, name, path, args.cache / "startup-warm"))
    server.terminate()
    print(f"one tile, CPU, fp32, {args.rounds} rounds, medians (s)")
    print(f"  {'source':<34} {'MB':>6} {'floor':>6} {'+read':>6} {'target':>7} {'own':>6} "
          f"{'warm':>6}  own process: imports / build / weights / width")  # fmt: skip
    for source, (_, path) in sources.items():
        row = rows[source]
        floor, read = median(row["floor"]), max(median(row["read"]), 0.0)
        startup = median(m["startup_s"] for m in row["job"])
        warm = median(m["startup_s"] for m in row["warm"])
        parts = " / ".join(f"{median(m[k] for m in row['job']):.2f}" for k in PARTS)
        target = floor + 1 + read
        verdict = "/".join("meets" if s <= target else "misses" for s in (startup, warm))
        print(f"  {source:<34} {path.stat().st_size / 1e6:6.0f} {floor:6.2f} {read:6.2f} "
              f"{target:7.2f} {startup:6.2f} {warm:6.2f}  {parts}  {verdict}")  # fmt: skip


if __name__ == "__main__":
    main()
