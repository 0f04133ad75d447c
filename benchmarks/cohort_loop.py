"""A cohort against its own embedding loop: what the jobs around the loop cost per slide.

A cohort of four links to the 40x bench slide, run from nothing to tile embeddings with
`snakemake --cores 2`, a near-free model (an average-pooling `.pt2` program) and one
loader worker. With the model out of the way, the loop is as fast as the loader; what the
cohort adds is every job's start (Python, imports, the model), the CPU stages and
Snakemake itself. Two ways, in interleaved rounds: every job in its own process
(SLIDESNAKE_WARM=0, as before the warm interpreter) and jobs forked by the warm
interpreter (the default; a first, unreported run starts its server). Printed as medians:
the cohort's tiles/s (all tiles over the whole run's wall time) against the loop's (each
embedding job's metrics), the jobs' start-up against their loops, each rule's job time
(Snakemake's own record, start to end), and the same command again with nothing to do;
each way with every `--decode` method (exact, scaled).

    python benchmarks/cohort_loop.py [--slides 4] [--rounds 2] [--cores 2] [--decode ...]
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
from collections import defaultdict
from pathlib import Path
from statistics import median

import yaml

from slidesnake.bench import synthetic_slide
from slidesnake.slides.synthetic import BENCH_SLIDES

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from whole_job import near_free_model  # noqa: E402


def cohort(workdir: Path, slide: Path, model: Path, size: int) -> Path:
    """A working directory whose sheet lists `size` links to `slide`."""
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    (workdir / "slides").mkdir(exist_ok=True)
    rows = ["slide_id\tpath"]
    for i in range(size):
        link = workdir / "slides" / f"s{i}.svs"
        link.unlink(missing_ok=True)
        link.symlink_to(slide)
        rows.append(f"s{i}\tslides/s{i}.svs")
    (workdir / "config" / "samples.tsv").write_text("\n".join(rows) + "\n")
    return workdir


def configure(workdir: Path, model: Path, decode: str) -> None:
    """The cohort's config: the near-free model, one loader worker, `decode`."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["model"] |= {"name": "custom", "checkpoint": str(model), "precision": "fp32"}
    config["loader"] |= {"workers": 1, "decode": decode}
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))


def snakemake(workdir: Path, cores: int, targets: list[str], warm: bool) -> float:
    """Wall seconds of one Snakemake command in `workdir`, process start to exit."""
    snakefile = REPO / "workflow" / "Snakefile"
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(snakefile),
               "--cores", str(cores), *targets]  # fmt: skip
    env = os.environ | {"SLIDESNAKE_WARM": "1" if warm else "0"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"snakemake failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def job_seconds(workdir: Path) -> dict[str, list[float]]:
    """rule -> each job's seconds, from Snakemake's record of its start and end."""
    seconds = defaultdict(dict)
    for record in (workdir / ".snakemake" / "metadata").iterdir():
        meta = json.loads(record.read_text())
        seconds[meta["rule"]][meta["job_hash"]] = meta["endtime"] - meta["starttime"]
    return {rule: list(jobs.values()) for rule, jobs in seconds.items()}


def one_round(workdir: Path, slides: int, cores: int, warm: bool) -> dict:
    for earlier in ("results", "logs", ".snakemake"):
        shutil.rmtree(workdir / earlier, ignore_errors=True)
    targets = [f"results/slides/s{i}/embeddings.zarr" for i in range(slides)]
    wall = snakemake(workdir, cores, targets, warm)
    metrics = [
        json.loads((workdir / "results" / "slides" / f"s{i}" / "metrics.json").read_text())
        for i in range(slides)
    ]
    tiles = sum(m["tiles"] for m in metrics)
    return {
        "wall_s": wall,
        "tiles": tiles,
        "cohort_tiles_per_s": tiles / wall,
        "loop_tiles_per_s": median(m["tiles_per_s"] for m in metrics),
        "startup_s": sum(m["startup_s"] for m in metrics),
        "loop_s": sum(m["wall_s"] for m in metrics),
        "jobs": {rule: median(s) for rule, s in job_seconds(workdir).items()},
        "nothing_to_do_s": snakemake(workdir, cores, targets, warm),
    }


def snakemake_start_s() -> float:
    """Seconds of a Snakemake start with nothing to do (a one-rule dry run): its imports,
    its plugins' (the SLURM plugin's `scontrol show config` where SLURM's clients are
    installed) and its DAG, the floor under every run of the workflow."""
    with tempfile.TemporaryDirectory() as empty:
        Path(empty, "Snakefile").write_text("rule all:\n    shell: 'true'\n")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1"], cwd=empty,
                       capture_output=True, check=True)  # fmt: skip
        return time.perf_counter() - started


def scontrol_s() -> float | None:
    """Seconds of `scontrol show config`, which Snakemake's SLURM plugin runs at every
    start where SLURM's commands are installed: 9 s here while the test cluster is down."""
    if shutil.which("scontrol") is None:
        return None
    started = time.perf_counter()
    subprocess.run(["scontrol", "show", "config"], capture_output=True)
    return time.perf_counter() - started


def report(label: str, rounds: list[dict]) -> None:
    mid = {key: median(r[key] for r in rounds) for key in rounds[0] if key != "jobs"}
    print(f"  {label}:")
    print(f"    whole cohort, nothing to embeddings  {mid['wall_s']:5.1f} s  "
          f"{mid['cohort_tiles_per_s']:6.1f} tiles/s  "
          f"{mid['cohort_tiles_per_s'] / mid['loop_tiles_per_s']:.2f}x the loop")  # fmt: skip
    print(f"    embedding loop (each job's metrics)           "
          f"{mid['loop_tiles_per_s']:6.1f} tiles/s")  # fmt: skip
    print(f"    embedding start-up, summed over the slides  {mid['startup_s']:5.1f} s "
          f"(their loops: {mid['loop_s']:.1f} s)")  # fmt: skip
    for rule in sorted(rounds[0]["jobs"]):
        seconds = median(r["jobs"][rule] for r in rounds)
        print(f"    {rule:<22} {seconds:5.2f} s a job (Snakemake's record, start to end)")
    print(f"    the same command again, nothing to do   {mid['nothing_to_do_s']:5.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slides", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--decode", nargs="+", default=["exact", "scaled"])
    parser.add_argument(
        "--sparse", dest="dense", action="store_false",
        help="the bench slide with 8 tissue blobs (608 tiles), not tissue over 80%% (1,728)",
    )  # fmt: skip
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "slidesnake-bench"
    )
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    slide = synthetic_slide(args.cache, *BENCH_SLIDES["40x"][:2], mpp=0.25, dense=args.dense)
    model = near_free_model(args.cache)
    workdir = cohort(args.cache / "cohort-loop", slide, model, args.slides)
    configure(workdir, model, args.decode[0])
    one_round(workdir, args.slides, args.cores, warm=True)  # the page cache, and a server
    runs = [(warm, decode) for warm in (False, True) for decode in args.decode]
    rounds = {run: [] for run in runs}
    for _ in range(args.rounds):
        for warm, decode in runs:
            configure(workdir, model, decode)
            rounds[warm, decode].append(one_round(workdir, args.slides, args.cores, warm))
    tiles = rounds[runs[0]][0]["tiles"] // args.slides
    print(f"{args.slides} links to {slide.name} ({tiles} tiles each), near-free model, "
          f"1 loader worker, --cores {args.cores}, {args.rounds} rounds, medians")  # fmt: skip
    for warm, decode in runs:
        how = "jobs forked by the warm interpreter (the default)" if warm else (
            "each job in its own process (SLIDESNAKE_WARM=0)")  # fmt: skip
        report(f"{how}, loader.decode {decode}", rounds[warm, decode])
    for decode in args.decode:
        cold, warm = (median(r["wall_s"] for r in rounds[w, decode]) for w in (False, True))
        print(f"  whole cohort, loader.decode {decode}: warm {cold / warm:.2f}x faster")
    print(f"  a Snakemake start with nothing to do (one-rule dry run): {snakemake_start_s():.1f} s")
    if (seconds := scontrol_s()) is not None:
        print(f"  (every Snakemake start includes `scontrol show config`: {seconds:.1f} s now;")
        print("   `slidesnake doctor` says so where no controller answers)")


if __name__ == "__main__":
    main()
