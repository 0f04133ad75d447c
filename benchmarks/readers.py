"""Slide readers side by side: the same tiles, one process on one core, uint8 224 x 224 x 3.

For each slide, each reader turns the same tiles (up to 2,000, in the tile table's
order) into uint8 224 x 224 x 3 arrays at 0.5 µm/px, alone in this process, pinned to one
core, every library on one thread; rounds interleave the readers, and the table gives
medians. Readers:

- slidesnake exact and scaled: our loader read in this process (`stream(0, ...)`), the
  exact path's larger reads resized as the CPU path does (torch, uint8, antialiased),
  and once unresized, as a GPU job's loader hands them over;
- OpenSlide `read_region` + PIL resize (TRIDENT's and STAMP's way);
- tiffslide `read_region` + PIL resize (LazySlide's default);
- cuCIM's CPU `read_region` + PIL resize (hs2p's default backend), per tile and batched;
- pyvips crop + resize (hs2p's other backend);
- and each codec's decode-only limit: every compressed tile the tiles need decoded once
  into a reused buffer (full size, and at the scaled path's size), in model tiles/s.

The peers come from `make readers-env` (installed with --no-deps into
benchmarks/out/readers-site, beside .venv's packages); a reader that is missing or fails
says so in its row.

    make readers-env && .venv/bin/python benchmarks/readers.py [--tiles 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from statistics import median

import numpy as np
import tifffile
import torch
from PIL import Image

from slidesnake.bench import synthetic_slide, tile_slide
from slidesnake.loader.batches import ReadPlan, TileBatches, planned_reader
from slidesnake.models.embedder import resize_tiles
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import BENCH_SLIDES, PixelRenderer, write_rendered
from slidesnake.slides.tiff_tiles import decode_buffer

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"
SHARED = REPO.parent / "shared" / "slides"
sys.path.insert(0, str(OUT / "readers-site"))
SIZE = 224

Reader = Callable[[Path, np.ndarray, int, int], Iterator[np.ndarray]]


def slides() -> dict[str, tuple[Path, float | None]]:
    """name -> (slide, the mpp to tell the readers where the slide records none)."""
    bench = synthetic_slide(OUT, *BENCH_SLIDES["40x"], dense=True)
    found: dict[str, tuple[Path, float | None]] = {"40x bench (synthetic JPEG)": (bench, None)}
    if SHARED.is_dir():
        found["20x CMU mosaic (real JPEG)"] = (cmu_mosaic(OUT / "readers-cmu-20x.svs"), None)
        tcga = SHARED / "tcga-cr-7395-01a-01-ts1.svs"
        found["TCGA JPEG 2000, told 0.5 µm/px"] = (tcga, 0.5)
        found["TCGA JPEG 2000, told 0.25 µm/px"] = (tcga, 0.25)
    return found


def cmu_mosaic(path: Path) -> Path:
    """CMU-1-Small-Region's real H&E, 5 x 2 copies each flipped its own way: 20x, 2,000
    tiles of tissue and more."""
    if not path.exists():
        with Slide(SHARED / "CMU-1-Small-Region.svs") as slide:
            rgb = slide.read(0, 0, 0, *slide.dimensions)
        flips = [rgb, rgb[:, ::-1], rgb[::-1], rgb[::-1, ::-1], rgb]
        pixels = np.concatenate([np.concatenate(flips, 1), np.concatenate(flips[::-1], 1)])
        write_rendered(path, PixelRenderer(pixels), pixels.shape[1], pixels.shape[0], mpp=0.499)
    return path


def slidesnake_reader(decode: str, resize: bool = True) -> Reader:
    """Our loader; without `resize`, its tiles as a GPU job gets them (the device resizes)."""

    def read(path: Path, coords: np.ndarray, level: int, px: int) -> Iterator[np.ndarray]:
        dataset = TileBatches(path, "bench", coords, GEOMETRY[path], 64, decode=decode)
        for _, pixels in dataset.stream(0, 2):
            if resize and pixels.shape[1] != SIZE:
                x = torch.from_numpy(pixels).permute(0, 3, 1, 2)
                pixels = resize_tiles(x, SIZE).permute(0, 2, 3, 1).numpy()
            yield pixels

    return read


def resized(rgb: np.ndarray | Image.Image) -> np.ndarray:
    picture = rgb if isinstance(rgb, Image.Image) else Image.fromarray(np.asarray(rgb))
    if picture.size != (SIZE, SIZE):
        picture = picture.resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(picture.convert("RGB"))


def openslide_reader(path, coords, level, px):
    import openslide

    with openslide.OpenSlide(str(path)) as slide:
        for x, y in coords.tolist():
            yield resized(slide.read_region((x, y), level, (px, px)))


def tiffslide_reader(path, coords, level, px):
    import tiffslide

    with tiffslide.TiffSlide(str(path)) as slide:
        for x, y in coords.tolist():
            yield resized(slide.read_region((x, y), level, (px, px), as_array=True)[..., :3])


def cucim_reader(path, coords, level, px):
    from cucim.clara import CuImage

    slide = CuImage(str(path))
    for x, y in coords.tolist():
        yield resized(np.asarray(slide.read_region((x, y), (px, px), level))[..., :3])


def cucim_batched_reader(path, coords, level, px):
    from cucim.clara import CuImage

    slide = CuImage(str(path))
    locations = [tuple(xy) for xy in coords.tolist()]
    for region in slide.read_region(locations, (px, px), level, num_workers=1, batch_size=64):
        for tile in np.asarray(region):
            yield resized(tile[..., :3])


def pyvips_reader(path, coords, level, px):
    import pyvips

    image = pyvips.Image.new_from_file(str(path), page=PAGES[path][level], access="random")
    scale = SIZE / px
    for x, y in coords.tolist():
        d = DOWNSAMPLES[path][level]
        tile = image.crop(round(x / d), round(y / d), px, px)
        tile = tile.resize(scale, kernel="linear") if scale != 1 else tile
        yield tile.extract_band(0, n=3).numpy()


READERS: dict[str, Reader] = {
    "slidesnake exact": slidesnake_reader("exact"),
    "slidesnake exact, unresized (a GPU resizes)": slidesnake_reader("exact", resize=False),
    "slidesnake scaled": slidesnake_reader("scaled"),
    "OpenSlide + PIL resize": openslide_reader,
    "tiffslide + PIL resize": tiffslide_reader,
    "cuCIM per tile + PIL resize": cucim_reader,
    "cuCIM batched + PIL resize": cucim_batched_reader,
    "pyvips crop + resize": pyvips_reader,
}
GEOMETRY: dict[Path, object] = {}
PAGES: dict[Path, dict[int, int]] = {}
DOWNSAMPLES: dict[Path, dict[int, float]] = {}


def decode_limits(path: Path, coords: np.ndarray) -> dict[str, float]:
    """Model tiles/s if decoding the compressed tiles they need were all a reader did:
    full size (imagecodecs) and at the scaled path's size (simplejpeg, Pillow)."""
    limits = {}
    geometry = GEOMETRY[path]
    with Slide(path, "bench", geometry.slide_mpp) as slide:
        for decode in ("exact", "scaled"):
            plan = ReadPlan.from_geometry(geometry, decode)
            plan, reader, at = planned_reader(slide, plan, coords)
            if not hasattr(reader, "needed"):
                continue
            needed = sorted(reader.needed(at))
            tiled = reader.tiled
            tiled.prefetch(needed)
            out = decode_buffer(tiled.tile_height, tiled.tile_width)
            started = time.perf_counter()
            for row, col in needed:
                tiled.decode(row, col, out)
            seconds = time.perf_counter() - started
            name = f"decode only, {tiled.codec} at 1/{plan.shrink}"
            limits[name] = len(coords) / seconds
    return limits


def prepare(path: Path, mpp: float | None, count: int) -> tuple[np.ndarray, int, int]:
    tiled = tile_slide(path, OUT / "readers", mpp)
    coords, geometry = tiled.coords()
    coords = coords[:count]
    GEOMETRY[path] = geometry
    with tifffile.TiffFile(path) as tiff:
        sizes = {(p.imagewidth, p.imagelength): i for i, p in enumerate(tiff.pages)}
    with Slide(path, "bench", mpp) as slide:
        DOWNSAMPLES[path] = {lv.index: lv.downsample for lv in slide.levels}
        PAGES[path] = {lv.index: sizes.get((lv.width, lv.height), 0) for lv in slide.levels}
    level = geometry.read_level
    px = round(geometry.size_level0 / DOWNSAMPLES[path][level])
    return coords, level, px


def timed(reader: Reader, path: Path, coords: np.ndarray, level: int, px: int) -> float:
    started, count = time.perf_counter(), 0
    for pixels in reader(path, coords, level, px):
        assert pixels.shape[-1] == 3 and pixels.dtype == np.uint8
        count += len(pixels) if pixels.ndim == 4 else 1
    seconds = time.perf_counter() - started
    assert count == len(coords), f"{count} tiles of {len(coords)}"
    return count / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    for name, (path, mpp) in slides().items():
        coords, level, px = prepare(path, mpp, options.tiles)
        rates: dict[str, list[float]] = {}
        failed: dict[str, str] = {}
        for _ in range(options.rounds):
            for reader_name, reader in READERS.items():
                if reader_name in failed:
                    continue
                try:
                    rate = timed(reader, path, coords, level, px)
                except Exception as err:  # a peer missing or failing: said in its row
                    why = " ".join(str(err).split())[:100]  # one table cell
                    failed[reader_name] = f"{type(err).__name__}: {why}"
                    rates.pop(reader_name, None)
                else:
                    rates.setdefault(reader_name, []).append(rate)
            for limit, rate in decode_limits(path, coords).items():
                rates.setdefault(limit, []).append(rate)
        report(name, len(coords), px, rates, failed)


def report(name: str, tiles: int, px: int, rates: dict, failed: dict) -> None:
    print(f"\n{name}: {tiles} tiles read at {px} px, out 224 px, one core")
    print("| reader | tiles/s (median) | x OpenSlide | x slidesnake exact |")
    print("|---|---|---|---|")
    base = median(rates.get("OpenSlide + PIL resize", [float("nan")]))
    ours = median(rates.get("slidesnake exact", [float("nan")]))
    for reader, values in rates.items():
        rate = median(values)
        print(f"| {reader} | {rate:,.0f} | {rate / base:.2f}x | {rate / ours:.2f}x |")
    for reader, why in failed.items():
        print(f"| {reader} | did not run: {why} | | |")


if __name__ == "__main__":
    main()
