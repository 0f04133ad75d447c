"""Masking and tiling cost against slide size: both read only low-resolution levels.

Three synthetic pyramidal slides: a 40x biopsy, a 40x resection 14 times its area, and the
same resection scanned at 10x (16 times fewer pixels, same tissue). Times tissue masking
and tile placement on each in this process (best of N), next to what decoding level 0
would cost, and prints the ratios. Slides are cached in benchmarks/out/ between runs.

    .venv/bin/python benchmarks/mask_tiles_scaling.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import random_blobs, write_slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tissue import TissueParams

OUT = Path(__file__).parent / "out"


def slide(width: int, height: int, mpp: float) -> Path:
    path = OUT / f"synthetic-{width}x{height}-{mpp:g}.svs"
    if not path.exists():
        started = time.perf_counter()
        shapes = random_blobs(width, height, count=3, seed=11)
        write_slide(path, width, height, shapes, mpp=mpp, levels=4, seed=11)
        print(f"wrote {path.name} in {time.perf_counter() - started:.0f} s")
    return path


def measure(path: Path, repeats: int) -> dict[str, float]:
    out = OUT / path.stem
    best = {"mask_s": float("inf"), "tiles_s": float("inf")}
    for _ in range(repeats):
        started = time.perf_counter()
        make_tissue_mask(path, path.stem, out / "m.png", out / "qc.png", TissueParams())
        masked = time.perf_counter()
        tiles = make_tile_coords(
            path,
            path.stem,
            out / "m.png",
            out / "qc.png",
            out / "t.parquet",
            out / "qct.png",
            TileParams(),
        )
        done = time.perf_counter()
        best = {
            "mask_s": min(best["mask_s"], masked - started),
            "tiles_s": min(best["tiles_s"], done - masked),
        }
    return {**best, "tiles": tiles, "gigapixels": _gigapixels(path), "level0_s": _level0_s(path)}


def _level0_s(path: Path, reads: int = 16, side: int = 1024) -> float:
    """What decoding all of level 0 would cost, extrapolated from `reads` regions."""
    with Slide(path) as slide:
        width, height = slide.dimensions
        started = time.perf_counter()
        for i in range(reads):
            slide.read(0, (i * 4099) % (width - side), (i * 2053) % (height - side), side, side)
        per_pixel = (time.perf_counter() - started) / (reads * side * side)
    return per_pixel * width * height


def _gigapixels(path: Path) -> float:
    width, height = (int(v) for v in path.stem.split("-")[1].split("x"))
    return width * height / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    slides = {
        "biopsy 40x": (16000, 0.25),
        "resection 40x": (60000, 0.25),
        "resection 10x": (15000, 1.0),
    }
    rows = {}
    for name, (width, mpp) in slides.items():
        rows[name] = measure(slide(width, width * 3 // 4, mpp), args.repeats)
    print(f"{'slide':<15}{'Gpx':>8}{'tiles':>9}{'mask s':>9}{'tiles s':>9}{'level-0 decode s':>18}")
    for name, row in rows.items():
        print(
            f"{name:<15}{row['gigapixels']:>8.2f}{row['tiles']:>9}"
            f"{row['mask_s']:>9.3f}{row['tiles_s']:>9.3f}{row['level0_s']:>18.1f}"
        )
    ratios = {
        "resection/biopsy, both 40x": ratio(rows["resection 40x"], rows["biopsy 40x"]),
        "resection 40x/10x, same tissue": ratio(rows["resection 40x"], rows["resection 10x"]),
    }
    for name, r in ratios.items():
        print(
            f"{name}: {r['gigapixels']:.0f}x the pixels, {r['mask_s']:.2f}x the masking "
            f"time, {r['tiles_s']:.2f}x the tiling time"
        )
    print(json.dumps({"rows": rows, "ratios": ratios}))


def ratio(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] / b[k] for k in ("gigapixels", "mask_s", "tiles_s")}


if __name__ == "__main__":
    main()
