"""Masking and tiling cost against slide size: both read only low-resolution levels.

Three synthetic pyramidal slides: a 40x biopsy, a 40x resection 14 times its area, and the
same resection scanned at 10x (16 times fewer pixels, same tissue). Times tissue masking
and tile placement on each in this process (best of N), next to what decoding level 0
would cost, and prints the ratios. Then what each option of the two stages costs on the
40x resection: regions, imported coordinates, and the pen and focus filters, against the
plain grid. Slides are cached in benchmarks/out/ between runs.

    .venv/bin/python benchmarks/mask_tiles_scaling.py
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import random_blobs, write_slide
from slidesnake.tiling.artefacts import ArtefactParams
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.regions import read_regions
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tile_table import read_tiles
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


def measure(path: Path, repeats: int, **option) -> dict[str, float]:
    """Best-of-`repeats` seconds of the mask stage and of the tile stage (reading the
    regions' file included) with one `option` of `OPTIONS`."""
    out = OUT / path.stem
    pen, roi = option.pop("pen", False), option.pop("roi", None)
    best = {"mask_s": float("inf"), "tiles_s": float("inf")}
    for _ in range(repeats):
        started = time.perf_counter()
        make_tissue_mask(path, path.stem, out / "m.png", out / "qc.png", TissueParams(), pen=pen)
        masked = time.perf_counter()
        regions = read_regions(roi, path.stem) if roi else None
        tiles = make_tile_coords(
            path,
            path.stem,
            out / "m.png",
            out / "qc.png",
            out / "t.parquet",
            out / "qct.png",
            TileParams(),
            regions=regions,
            regions_path=roi,
            **option,
        )
        done = time.perf_counter()
        best = {
            "mask_s": min(best["mask_s"], masked - started),
            "tiles_s": min(best["tiles_s"], done - masked),
        }
    return {**best, "tiles": tiles}


def options(path: Path) -> dict[str, dict]:
    """The options of the two stages, each as `measure` takes it: a region over the left
    half of the slide, the plain grid's coordinates as a CSV, and the artefact filters."""
    out = OUT / path.stem
    measure(path, 1)
    tiles, _ = read_tiles(out / "t.parquet")
    tiles[["x", "y"]].to_csv(out / "coords.csv", index=False)
    width, height = (int(v) for v in path.stem.split("-")[1].split("x"))
    half = [[0, 0], [width // 2, 0], [width // 2, height], [0, height], [0, 0]]
    geometry = {"type": "Polygon", "coordinates": [half]}
    (out / "roi.geojson").write_text(json.dumps({"type": "Feature", "geometry": geometry}))
    pen, focus = ArtefactParams(max_pen_fraction=0.1), ArtefactParams(min_focus=300)
    return {
        "grid (no option)": {},
        "regions: left half": {"roi": out / "roi.geojson"},
        "imported coordinates": {"coords_path": out / "coords.csv"},
        "pen filter": {"pen": True, "artefacts": pen},
        "focus filter": {"artefacts": focus},
        "pen and focus filters": {"pen": True, "artefacts": ArtefactParams(0.1, 300)},
    }


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
        path = slide(width, width * 3 // 4, mpp)
        rows[name] = measure(path, args.repeats)
        rows[name] |= {"gigapixels": _gigapixels(path), "level0_s": _level0_s(path)}
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
    costs = option_costs(slide(60000, 45000, 0.25), args.repeats)
    print(json.dumps({"rows": rows, "ratios": ratios, "options": costs}))


def option_costs(path: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Each option's seconds on `path`, and its extra seconds per 1,000 grid tiles."""
    costs = {name: measure(path, repeats, **option) for name, option in options(path).items()}
    base = costs["grid (no option)"]
    print(f"\noptions on {path.name} ({base['tiles']} grid tiles)")
    print(
        f"{'option':<24}{'tiles':>7}{'mask s':>9}{'tiles s':>9}{'x grid':>8}{'+ s/1000 tiles':>16}"
    )
    for name, row in costs.items():
        total, base_total = row["mask_s"] + row["tiles_s"], base["mask_s"] + base["tiles_s"]
        row["extra_s_per_1000"] = 1000 * (total - base_total) / base["tiles"]
        print(
            f"{name:<24}{row['tiles']:>7}{row['mask_s']:>9.3f}{row['tiles_s']:>9.3f}"
            f"{total / base_total:>8.2f}{row['extra_s_per_1000']:>16.3f}"
        )
    return costs


def ratio(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] / b[k] for k in ("gigapixels", "mask_s", "tiles_s")}


if __name__ == "__main__":
    main()
