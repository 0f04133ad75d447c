"""Masking and tiling cost against slide size: both read only low-resolution levels.

Writes a small and a large synthetic 40x pyramidal slide (same tissue layout, scaled),
then times tissue masking and tile placement on each in this process and prints a table
with the ratio large / small. Slides are cached in benchmarks/out/ between runs.

    .venv/bin/python benchmarks/mask_tiles_scaling.py [--large-width 80000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from slidesnake.stages import make_tile_coords, make_tissue_mask
from slidesnake.synthetic import random_blobs, write_slide
from slidesnake.tiling import TileParams
from slidesnake.tissue import TissueParams

OUT = Path(__file__).parent / "out"


def slide(width: int, height: int) -> Path:
    path = OUT / f"synthetic-{width}x{height}.svs"
    if not path.exists():
        started = time.perf_counter()
        shapes = random_blobs(width, height, count=3, seed=11)
        write_slide(path, width, height, shapes, mpp=0.25, levels=4, seed=11)
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
    return {**best, "tiles": tiles, "gigapixels": _gigapixels(path)}


def _gigapixels(path: Path) -> float:
    width, height = (int(v) for v in path.stem.split("-")[1].split("x"))
    return width * height / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small-width", type=int, default=8000)
    parser.add_argument("--large-width", type=int, default=80000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for name, width in (("small", args.small_width), ("large", args.large_width)):
        rows[name] = measure(slide(width, width * 3 // 4), args.repeats)
    print(f"{'slide':<7}{'Gpx':>8}{'tiles':>9}{'mask s':>9}{'tiles s':>9}")
    for name, row in rows.items():
        print(
            f"{name:<7}{row['gigapixels']:>8.2f}{row['tiles']:>9}"
            f"{row['mask_s']:>9.3f}{row['tiles_s']:>9.3f}"
        )
    ratio = {k: rows["large"][k] / rows["small"][k] for k in ("gigapixels", "mask_s", "tiles_s")}
    print(
        f"large/small: {ratio['gigapixels']:.0f}x the pixels, "
        f"{ratio['mask_s']:.2f}x the masking time, {ratio['tiles_s']:.2f}x the tiling time"
    )
    print(json.dumps({"rows": rows, "ratio": ratio}))


if __name__ == "__main__":
    main()
