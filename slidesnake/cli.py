"""The `slidesnake` command: the stages without Snakemake, and slide generators."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from slidesnake.demo import write_demo_slides
from slidesnake.jobs import run_job
from slidesnake.stages import make_tile_coords, make_tissue_mask
from slidesnake.synthetic import random_blobs, write_slide
from slidesnake.tiling import TileParams
from slidesnake.tissue import TissueParams


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="slidesnake", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

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

    tiles = commands.add_parser("tiles", help="tile coordinates of one masked slide")
    tiles.add_argument("slide")
    tiles.add_argument("outdir", help="the directory `slidesnake mask` wrote to")
    tiles.add_argument("--tile-mpp", type=float, default=TileParams.mpp)
    tiles.add_argument("--size", type=int, default=TileParams.size)
    tiles.add_argument("--stride", type=int, default=None)
    tiles.add_argument("--mask-threshold", type=float, default=TileParams.mask_threshold)

    args = parser.parse_args(argv)
    run_job(lambda: _COMMANDS[args.command](args))


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
    )


def _tiles(args: argparse.Namespace) -> None:
    out = Path(args.outdir)
    params = TileParams(args.tile_mpp, args.size, args.stride, args.mask_threshold)
    make_tile_coords(
        args.slide,
        Path(args.slide).stem,
        out / "tissue_mask.png",
        out / "qc_mask.png",
        out / "tiles.parquet",
        out / "qc_tiles.png",
        params,
    )


_COMMANDS = {
    "demo-slides": _demo_slides,
    "synthetic-slide": _synthetic_slide,
    "mask": _mask,
    "tiles": _tiles,
}
