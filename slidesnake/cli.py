"""The `slidesnake` command: the stages without Snakemake, a benchmark, slide generators."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from slidesnake.cohort.demo import write_demo_slides
from slidesnake.cohort.jobs import run_job
from slidesnake.embed.settings import DEMO, EmbedSettings, RemoteSettings
from slidesnake.errors import WeightsError
from slidesnake.slides.synthetic import BENCH_SLIDES, random_blobs, write_slide
from slidesnake.tiling.artefacts import ArtefactParams
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tissue import TissueParams


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        _exec_server(argv[1:])
    parser = argparse.ArgumentParser(prog="slidesnake", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("serve", help="serve a model on Triton (see slidesnake serve --help)")

    demo = commands.add_parser("demo-slides", help="write the demo cohort's synthetic slides")
    demo.add_argument("directory", nargs="?", default="demo/slides")

    synth = commands.add_parser("synthetic-slide", help="write one synthetic H&E-like slide")
    synth.add_argument("path", help="output file: .svs for Aperio, .tif for generic TIFF")
    synth.add_argument("--width", type=int, default=20000)
    synth.add_argument("--height", type=int, default=15000)
    synth.add_argument("--mpp", type=float, default=0.25)
    synth.add_argument("--levels", type=int, default=3)
    synth.add_argument("--blobs", type=int, default=3)
    synth.add_argument("--seed", type=int, default=0)

    mask = commands.add_parser("mask", help="tissue mask and QC picture of one slide")
    mask.add_argument("slide")
    mask.add_argument("outdir")
    mask.add_argument("--mpp", type=float, help="level-0 µm/px, if the slide lacks it")
    mask.add_argument("--pen", action="store_true", help="also find pen ink (for tiles' filter)")

    tiles = commands.add_parser("tiles", help="tile coordinates of one masked slide")
    tiles.add_argument("slide")
    tiles.add_argument("outdir", help="the directory `slidesnake mask` wrote to")
    tiles.add_argument("--tile-mpp", type=float, default=TileParams.mpp)
    tiles.add_argument("--size", type=int, default=TileParams.size)
    tiles.add_argument("--stride", type=int, default=None)
    tiles.add_argument("--mask-threshold", type=float, default=TileParams.mask_threshold)
    tiles.add_argument("--max-pen-fraction", type=float, help="drop tiles under ink (mask --pen)")
    tiles.add_argument("--min-focus", type=float, help="drop tiles with a lower focus score")
    tiles.add_argument("--focus-mpp", type=float, default=ArtefactParams.focus_mpp)

    embed = commands.add_parser("embed", help="embed the tiles of one slide")
    embed.add_argument("slide")
    embed.add_argument("tiles", help="the slide's tiles.parquet")
    embed.add_argument("outdir", help="where embeddings.zarr and metrics.json go")
    _add_model_arguments(embed)
    embed.add_argument(
        "--models", type=Path, help="a YAML mapping of model keys to model sections (config "
        "key models:): one read for all of them, outputs in OUTDIR/<key>/",
    )  # fmt: skip
    remote = embed.add_argument_group("remote backend (config keys remote.*)")
    remote.add_argument("--url", help="an inference server: embed there, not here")
    remote.add_argument("--server-model", help="the model's name on the server")
    remote.add_argument("--max-concurrency", type=int, default=RemoteSettings.max_concurrency)
    remote.add_argument("--token-env", help="environment variable holding a bearer token")

    export = commands.add_parser("export-h5", help="embeddings.zarr as TRIDENT/CLAM's .h5")
    export.add_argument("zarr", help="an embeddings.zarr, or a slide's results folder with --model")
    export.add_argument("h5")
    export.add_argument("--model", help="with several models: the key whose embeddings to export")

    bench = commands.add_parser("bench", help="decode limit, loader, model, end-to-end tiles/s")
    bench.add_argument("--slide", type=Path, help="default: a generated slide, see --synthetic")
    bench.add_argument("--synthetic", choices=sorted(BENCH_SLIDES), default="40x")
    bench.add_argument("--mpp", type=float, help="level-0 µm/px, if the slide lacks it")
    bench.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="e.g. 1 2 4 8 16")
    bench.add_argument("--repeats", type=int, default=3, help="rounds of each measurement")
    bench.add_argument("--max-tiles", type=int, help="only the first N tiles of the slide")
    bench.add_argument("--end-to-end-s", type=float, default=20.0, help="model-seconds of tiles")
    bench.add_argument("--workdir", type=Path, help="slides and outputs (kept between runs)")
    bench.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    bench.add_argument("--json", type=Path, help="also write the results here")
    _add_model_arguments(bench, bench=True)

    status = commands.add_parser("status", help="a cohort's state while it runs; its page")
    status.add_argument("results", nargs="?", default="results", type=Path)
    status.add_argument("--watch", type=float, nargs="?", const=30.0, metavar="SECONDS",
                        help="again every SECONDS (30) until the run ends")  # fmt: skip
    status.add_argument("--configfile", type=Path, nargs="+", help="over config/config.yaml")

    _add_weights_commands(commands)
    doctor = commands.add_parser("doctor", help="check what a run needs, one line each")
    doctor.add_argument("--configfile", type=Path, nargs="+", help="over config/config.yaml")
    doctor.add_argument("--profile", help="the run's Snakemake profile (profiles/slurm: SLURM)")

    args = parser.parse_args(argv)
    # The stages of one slide name it in their errors, as the workflow's jobs do.
    slide_id = Path(args.slide).stem if args.command in ("mask", "tiles", "embed") else None
    run_job(lambda: _COMMANDS[args.command](args), slide_id=slide_id)


def _exec_server(argv: list[str]) -> None:
    """Become the server, in its own environment (make serve-env): PyTriton needs numpy<2."""
    python = os.environ.get("SLIDESNAKE_SERVE_PYTHON") or str(SERVE_PYTHON)
    if not Path(python).is_file():
        sys.exit(
            f"slidesnake serve: no server environment at {python}; run `make serve-env` in "
            "the slidesnake checkout, or set SLIDESNAKE_SERVE_PYTHON to its python"
        )
    os.execv(python, [python, "-m", "slidesnake.serve", *argv])


# Where `make serve-env` puts the server's environment: beside the checkout's .venv.
SERVE_PYTHON = Path(__file__).resolve().parents[1] / ".venv-serve" / "bin" / "python"


def _add_model_arguments(parser: argparse.ArgumentParser, bench: bool = False) -> None:
    defaults = DEMO if bench else EmbedSettings()
    model = parser.add_argument_group("model and loader (config keys model.*, loader.*)")
    model.add_argument("--model", default=defaults.model)
    model.add_argument("--checkpoint")
    model.add_argument("--weights", choices=["checkpoint", "random"], default=defaults.weights)
    model.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default=defaults.precision)
    model.add_argument("--batch-size", type=int, default=defaults.batch_size)
    if not bench:
        model.add_argument("--workers", type=int, default=defaults.workers)
    model.add_argument("--output-dtype", choices=["float16", "float32"], default="float16")
    model.add_argument("--decode", choices=["exact", "scaled", "gpu"], default=defaults.decode)


def _settings(args: argparse.Namespace) -> EmbedSettings:
    return EmbedSettings(
        model=args.model,
        checkpoint=args.checkpoint,
        weights=args.weights,
        precision=args.precision,
        batch_size=args.batch_size,
        workers=max(args.workers) if isinstance(args.workers, list) else args.workers,
        output_dtype=args.output_dtype,
        decode=args.decode,
    )


def _embed(args: argparse.Namespace) -> None:
    """One slide's embeddings, as the workflow's job makes them: the command line's model
    (on its server with --url), or every model of --models from one read of the slide,
    each checked against the tiles; the command line's model options are each entry's
    defaults, a served entry's `remote:` its server."""
    from slidesnake.cohort.job_models import job_models
    from slidesnake.embed.job import embed_slide
    from slidesnake.embed.settings import model_configs
    from slidesnake.models.registry import check_model_config
    from slidesnake.remote.served_run import ServedRun
    from slidesnake.tiling.tile_table import read_tiles

    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    config = _embed_config(args)
    geometry = read_tiles(args.tiles)[1]
    for key, listed in model_configs(config).items():
        tiles = {"size": geometry.size, "mpp": geometry.target_mpp}
        check_model_config(listed["model"], tiles, listed["remote"], key)
    zarr, metrics = out / "embeddings.zarr", out / "metrics.json"
    if "models" in config:  # each model's outputs in a folder of its key
        zarr = [out / key / zarr.name for key in config["models"]]
        metrics = [store.with_name(metrics.name) for store in zarr]
    models = job_models(config, zarr, metrics)
    embed_slide(
        args.slide,
        Path(args.slide).stem,
        args.tiles,
        models.outputs,
        models.settings,
        models.params,
        open_served=ServedRun,
    )


def _embed_config(args: argparse.Namespace) -> dict:
    """The config sections the command line says, with --models's entries as `models:`."""
    import yaml

    from slidesnake.errors import ConfigError

    model = {"name": args.model, "checkpoint": args.checkpoint, "weights": args.weights,
             "precision": args.precision, "batch_size": args.batch_size,
             "backend": "remote" if args.url else "local"}  # fmt: skip
    remote = {f.name: f.default for f in fields(RemoteSettings) if f.name not in ("url", "model")}
    remote |= {"url": args.url, "model": args.server_model or "slidesnake",
               "max_concurrency": args.max_concurrency, "batch_size": args.batch_size,
               "token_env": args.token_env}  # fmt: skip
    config = {
        "model": model, "remote": remote,
        "loader": {"workers": args.workers, "decode": args.decode},
        "output": {"dtype": args.output_dtype},
    }  # fmt: skip
    if args.models is None:
        return config
    entries = yaml.safe_load(args.models.read_text())
    entries = entries.get("models", entries) if isinstance(entries, dict) else None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise ConfigError(f"{args.models} is not a mapping of model keys to model sections")
    for entry in entries.values():
        entry |= {"remote": remote | entry["remote"]} if "remote" in entry else {}
    return config | {"models": {key: model | entry for key, entry in entries.items()}}


def _add_weights_commands(commands: argparse._SubParsersAction) -> None:
    weights = commands.add_parser(
        "weights", help="registry weights for a cluster without internet: list, fetch, verify"
    )
    steps = weights.add_subparsers(dest="step", required=True)
    steps.add_parser("list", help="each registry model's hub repository, files, size, gating")
    fetch = steps.add_parser("fetch", help="download weights and a manifest (needs the hub)")
    fetch.add_argument("models", nargs="+", help="registry names, e.g. h-optimus-0 uni2-h")
    fetch.add_argument("--to", type=Path, required=True, help="directory to carry over")
    verify = steps.add_parser("verify", help="check a fetched directory offline")
    verify.add_argument("directory", type=Path)


def _weights(args: argparse.Namespace) -> None:
    from slidesnake.models import weight_files

    if args.step == "list":
        for line in _weights_table(
            [weight_files.hub_weights(n) for n in weight_files.hub_models()]
        ):
            print(line)
    elif args.step == "fetch":
        manifest = weight_files.fetch(args.models, args.to)
        for name in args.models:
            for record in manifest["models"][name]["files"]:
                print(f"{name}: model.checkpoint: {args.to / name / record['name']}")
                print(f"  {record['size']} bytes, sha256 {record['sha256']}")
    else:
        results = weight_files.verify(args.directory)
        for path, problem in results:
            print(f"OK    {path}" if problem is None else f"FAIL  {path}: {problem}")
        failed = sum(problem is not None for _, problem in results)
        if failed:
            raise WeightsError(f"{failed} of {len(results)} weight files failed verification")


def _doctor(args: argparse.Namespace) -> None:
    from slidesnake.doctor import run_doctor

    # As the workflow reads them: its config/config.yaml, then each --configfile over it.
    base = Path("config/config.yaml")
    configfiles = [base] if base.is_file() else []
    configfiles += [p for p in args.configfile or [] if p.resolve() != base.resolve()]
    findings = run_doctor(configfiles, slurm="slurm" in (args.profile or ""))
    for finding in findings:
        print(finding.line())
    failed = sum(finding.status == "FAIL" for finding in findings)
    if failed:
        sys.exit(f"doctor: {failed} problem(s); each FAIL line above says what to do")


def _weights_table(entries: list) -> list[str]:
    rows = [("model", "hub repository", "file (the first it has)", "fp32 size", "gated")]
    for e in entries:
        gated = {True: "yes: accept the licence", False: "no", None: "unknown"}[e.gated]
        rows.append((e.model, e.repo, " or ".join(e.files), f"{e.parameters * 4 / 1e9:.1f} GB",
                     gated))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    lines.append("sha256: none shipped; `fetch` records each file's in the manifest")
    return lines


def _status(args: argparse.Namespace) -> None:
    """Print the cohort's state and rewrite its page, once or until the run ends."""
    from slidesnake.cohort.config import load_config
    from slidesnake.cohort.run_state import run_state, write_live_page
    from slidesnake.cohort.samples import read_sample_sheet

    workdir = args.results.resolve().parent
    own = workdir / "config" / "config.yaml"
    config = load_config([*([own] if own.is_file() else []), *(args.configfile or [])])
    sheet = read_sample_sheet(workdir / config["samples"], workdir)
    while True:
        state = run_state(workdir, list(sheet.index), list(config.get("models") or {}))
        print("\n".join(state.lines()), flush=True)
        print(f"page: {write_live_page(state, workdir / 'results')}", flush=True)
        if args.watch is None or not state.live:
            return
        time.sleep(args.watch)
        print(flush=True)


def _export_h5(args: argparse.Namespace) -> None:
    from slidesnake.embed.store import export_h5

    zarr = Path(args.zarr) / args.model / "embeddings.zarr" if args.model else args.zarr
    export_h5(zarr, args.h5)


def _bench(args: argparse.Namespace) -> None:
    from slidesnake import bench

    workdir = args.workdir or bench.default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    options = bench.BenchOptions(
        workers=tuple(args.workers),
        repeats=args.repeats,
        max_tiles=args.max_tiles,
        end_to_end_s=args.end_to_end_s,
        memory=not args.no_memory,
    )
    results = bench.run(args.slide, args.mpp, args.synthetic, options, _settings(args), workdir)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def _demo_slides(args: argparse.Namespace) -> None:
    for path in write_demo_slides(args.directory):
        print(path)


def _synthetic_slide(args: argparse.Namespace) -> None:
    vendor = "aperio" if args.path.endswith(".svs") else "generic"
    shapes = random_blobs(args.width, args.height, args.blobs, args.seed)
    write_slide(
        args.path,
        args.width,
        args.height,
        shapes,
        mpp=args.mpp,
        levels=args.levels,
        vendor=vendor,
        seed=args.seed,
    )


def _mask(args: argparse.Namespace) -> None:
    out = Path(args.outdir)
    make_tissue_mask(
        args.slide,
        Path(args.slide).stem,
        out / "tissue_mask.png",
        out / "qc_mask.png",
        TissueParams(),
        sheet_mpp=args.mpp,
        pen=args.pen,
    )


def _tiles(args: argparse.Namespace) -> None:
    out = Path(args.outdir)
    params = TileParams(args.tile_mpp, args.size, args.stride, args.mask_threshold)
    artefacts = ArtefactParams(args.max_pen_fraction, args.min_focus, args.focus_mpp)
    make_tile_coords(
        args.slide,
        Path(args.slide).stem,
        out / "tissue_mask.png",
        out / "qc_mask.png",
        out / "tiles.parquet",
        out / "qc_tiles.png",
        params,
        artefacts=artefacts,
    )


_COMMANDS = {
    "demo-slides": _demo_slides,
    "synthetic-slide": _synthetic_slide,
    "mask": _mask,
    "tiles": _tiles,
    "embed": _embed,
    "export-h5": _export_h5,
    "bench": _bench,
    "weights": _weights,
    "doctor": _doctor,
    "status": _status,
}
