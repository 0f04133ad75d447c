"""Synthetic H&E-looking whole-slide images, for the demo, the tests and the benchmarks.

A fresh clone has no real slides, and tests need slides whose tissue is known exactly. We
write tiled, pyramidal JPEG TIFFs that OpenSlide reads as Aperio (`.svs`) or as generic
TIFF. Every pixel of every level is rendered from the same analytic description of the
tissue at that pixel's level-0 position, so levels agree with each other, and tiles are
rendered and encoded one at a time, so slides far larger than memory can be written.
The benchmarks also write pyramids of real pixels held in memory (PixelRenderer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image
from scipy import ndimage as ndi

BACKGROUND = np.array([243.0, 242.0, 240.0], np.float32)
STROMA = np.array([232.0, 160.0, 196.0], np.float32)
STROMA_DARK = np.array([200.0, 112.0, 165.0], np.float32)
NUCLEUS = np.array([95.0, 62.0, 140.0], np.float32)


@dataclass(frozen=True)
class Rect:
    """Tissue covering level-0 pixels [x0, x1) x [y0, y1)."""

    x0: float
    y0: float
    x1: float
    y1: float

    def inside(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return ((x >= self.x0) & (x < self.x1))[None, :] & ((y >= self.y0) & (y < self.y1))[:, None]

    def bounds(self) -> tuple[float, float, float, float]:
        return self.x0, self.y0, self.x1, self.y1


@dataclass(frozen=True)
class Ellipse:
    """Tissue inside an ellipse (level-0 px), with a ragged edge of `rough` relative depth."""

    cx: float
    cy: float
    rx: float
    ry: float
    angle: float = 0.0
    rough: float = 0.15
    seed: int = 0

    def inside(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        dx, dy = x[None, :] - self.cx, y[:, None] - self.cy
        c, s = np.cos(self.angle), np.sin(self.angle)
        u, v = (dx * c + dy * s) / self.rx, (-dx * s + dy * c) / self.ry
        edge = 1 + self.rough * (value_noise(x, y, min(self.rx, self.ry) / 4, self.seed) - 0.5)
        return u * u + v * v < edge * edge

    def bounds(self) -> tuple[float, float, float, float]:
        r = max(self.rx, self.ry) * (1 + self.rough)
        return self.cx - r, self.cy - r, self.cx + r, self.cy + r


Shape = Rect | Ellipse


@dataclass(frozen=True)
class PenStroke:
    """A marker line from (x0, y0) to (x1, y1), `width` level-0 px wide, on tissue and glass."""

    x0: float
    y0: float
    x1: float
    y1: float
    width: float
    colour: tuple[float, float, float] = (20.0, 140.0, 90.0)  # a green marker

    def inside(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        dx, dy = self.x1 - self.x0, self.y1 - self.y0
        px, py = x[None, :] - self.x0, y[:, None] - self.y0
        t = np.clip((px * dx + py * dy) / max(dx * dx + dy * dy, 1e-9), 0, 1)
        return np.hypot(px - t * dx, py - t * dy) < self.width / 2

    def bounds(self) -> tuple[float, float, float, float]:
        r = self.width / 2
        return (min(self.x0, self.x1) - r, min(self.y0, self.y1) - r,
                max(self.x0, self.x1) + r, max(self.y0, self.y1) + r)  # fmt: skip


@dataclass(frozen=True)
class Blur:
    """A part of the slide scanned out of focus: a Gaussian blur of `sigma` level-0 px."""

    area: Rect
    sigma: float


def random_blobs(width: int, height: int, count: int, seed: int) -> list[Ellipse]:
    """A few tissue fragments of plausible shape, kept inside the slide."""
    rng = np.random.default_rng(seed)
    blobs = []
    for i in range(count):
        rx, ry = rng.uniform(0.07, 0.16) * width, rng.uniform(0.08, 0.2) * height
        blobs.append(
            Ellipse(
                cx=rng.uniform(0.25, 0.75) * width,
                cy=rng.uniform(0.25, 0.75) * height,
                rx=rx,
                ry=ry,
                angle=rng.uniform(0, np.pi),
                seed=seed * 1000 + i,
            )
        )
    return blobs


def value_noise(x: np.ndarray, y: np.ndarray, cell: float, seed: int) -> np.ndarray:
    """Smooth noise in [0, 1) on the grid x (columns) by y (rows), a pure function of position."""
    gx, gy = (x / cell).astype(np.float32), (y / cell).astype(np.float32)
    ix, iy = np.floor(gx).astype(np.int64), np.floor(gy).astype(np.int64)
    fx, fy = _smoothstep(gx - ix)[None, :], _smoothstep(gy - iy)[:, None]
    # hash only the lattice corners this grid touches, then gather
    lattice = _hash(
        np.arange(ix[0], ix[-1] + 2)[None, :], np.arange(iy[0], iy[-1] + 2)[:, None], seed
    )
    cx, cy = ix - ix[0], iy - iy[0]
    rows = lattice[:, cx] * (1 - fx) + lattice[:, cx + 1] * fx  # few rows, full width
    return rows[cy] * (1 - fy) + rows[cy + 1] * fy


def _smoothstep(t: np.ndarray) -> np.ndarray:
    return t * t * (3 - 2 * t)


def _hash(ix: np.ndarray, iy: np.ndarray, seed: int) -> np.ndarray:
    h = (ix * 374761393 + iy * 668265263 + seed * 2246822519) & 0xFFFFFFFF
    h = ((h ^ (h >> 13)) * 1274126177) & 0xFFFFFFFF
    return ((h ^ (h >> 16)) & 0xFFFFFF).astype(np.float32) / 2**24


class Renderer:
    """Renders any rectangle of any level from a list of tissue shapes."""

    def __init__(
        self,
        shapes: Sequence[Shape],
        seed: int = 0,
        marks: Sequence[PenStroke] = (),
        blurs: Sequence[Blur] = (),
    ) -> None:
        self.shapes = list(shapes)
        self.seed = seed
        self.marks = list(marks)
        self.blurs = list(blurs)
        self._glass_cache: dict[tuple[int, int, int], np.ndarray] = {}

    def render(self, x0: int, y0: int, width: int, height: int, downsample: float) -> np.ndarray:
        """RGB uint8 of a level with `downsample`; (x0, y0) in that level's pixels."""
        x, y = _centres(x0, width, downsample), _centres(y0, height, downsample)
        if not self._touches(x, y, [*self.shapes, *self.marks]):
            return self._glass(height, width, x0 * 7 + y0 * 13)
        rng = np.random.default_rng([self.seed, x0, y0, round(downsample * 1000)])
        img = self._paint(x0, y0, width, height, downsample)
        for blur in self.blurs:
            if self._touches(x, y, [blur.area]):
                sigma = blur.sigma / downsample
                m = int(np.ceil(3 * sigma))
                padded = self._paint(x0 - m, y0 - m, width + 2 * m, height + 2 * m, downsample)
                smooth = ndi.gaussian_filter(padded, (sigma, sigma, 0))[
                    m : -m or None, m : -m or None
                ]
                inside = blur.area.inside(x, y)
                img[inside] = smooth[inside]
        return _with_noise(img, rng)

    def _paint(self, x0: int, y0: int, width: int, height: int, downsample: float) -> np.ndarray:
        """Tissue and marks as float32 RGB, before blur and sensor noise."""
        x, y = _centres(x0, width, downsample), _centres(y0, height, downsample)
        img = np.broadcast_to(BACKGROUND, (height, width, 3)).copy()
        tissue = np.zeros((height, width), bool)
        for shape in self.shapes:
            tissue |= shape.inside(x, y)
        shade = value_noise(x, y, 60.0, self.seed)[..., None]
        stroma = STROMA * (1 - shade) + STROMA_DARK * shade
        nuclei = value_noise(x, y, 7.0, self.seed + 1) > 0.78
        colour = np.where(nuclei[..., None], NUCLEUS, stroma)
        img[tissue] = colour[tissue]
        for mark in self.marks:
            img[mark.inside(x, y)] = mark.colour
        return img

    def _glass(self, height: int, width: int, key: int) -> np.ndarray:
        """Empty glass; a few noisy variants are cached, as most tiles of a slide are glass."""
        variant = (height, width, key % 4)
        if variant not in self._glass_cache:
            rng = np.random.default_rng([self.seed, *variant])
            self._glass_cache[variant] = _with_noise(
                np.broadcast_to(BACKGROUND, (height, width, 3)).copy(), rng
            )
        return self._glass_cache[variant]

    @staticmethod
    def _touches(x: np.ndarray, y: np.ndarray, shapes) -> bool:
        for shape in shapes:
            bx0, by0, bx1, by1 = shape.bounds()
            if bx0 <= x[-1] and bx1 >= x[0] and by0 <= y[-1] and by1 >= y[0]:
                return True
        return False


def _centres(start: int, count: int, downsample: float) -> np.ndarray:
    """Level-0 positions of the centres of `count` pixels of a level, from `start`."""
    return (start + np.arange(count, dtype=np.float64) + 0.5) * downsample


def _with_noise(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    img += 2.5 * rng.standard_normal(img.shape, dtype=np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


# `slidesnake bench`'s slides (width, height, mpp): 0.5 µm/px tiles need a 2x downsample
# from the 40x one and none from the 20x one.
BENCH_SLIDES = {"40x": (24000, 18000, 0.25), "20x": (24000, 18000, 0.5)}


def write_slide(
    path: str | Path,
    width: int,
    height: int,
    shapes: Sequence[Shape],
    mpp: float | None = 0.25,
    levels: int = 3,
    level_factor: int = 4,
    tile: int = 256,
    vendor: str = "aperio",
    quality: int = 85,
    seed: int = 0,
    marks: Sequence[PenStroke] = (),
    blurs: Sequence[Blur] = (),
    codec: str = "JPEG",
) -> Path:
    """Write a pyramidal JPEG TIFF; `vendor` is 'aperio' (.svs) or 'generic' (.tif).

    With `mpp=None` the slide records no resolution at all, as some real scans do. `marks`
    and `blurs` add pen ink and out-of-focus areas, for the artefact filters. `codec`
    "JPEG 2000": Aperio's RGB JPEG 2000 tiles (TIFF compression 33005) instead.
    """
    renderer = Renderer(shapes, seed, marks, blurs)
    return write_rendered(
        path, renderer, width, height, mpp, levels, level_factor, tile, vendor, quality, codec
    )


class PixelRenderer:
    """Renders any rectangle of any level from a picture in memory (real pixels, for the
    benchmarks); past its edges, glass."""

    def __init__(self, rgb: np.ndarray) -> None:
        self.levels = {1.0: rgb}

    def render(self, x0: int, y0: int, width: int, height: int, downsample: float) -> np.ndarray:
        level = self._level(downsample)
        out = np.broadcast_to(BACKGROUND.astype(np.uint8), (height, width, 3)).copy()
        part = level[y0 : y0 + height, x0 : x0 + width]
        out[: part.shape[0], : part.shape[1]] = part
        return out

    def _level(self, downsample: float) -> np.ndarray:
        if downsample not in self.levels:
            full = self.levels[1.0]
            size = (
                max(1, round(full.shape[1] / downsample)),
                max(1, round(full.shape[0] / downsample)),
            )
            resized = Image.fromarray(full).resize(size, Image.Resampling.BOX)
            self.levels[downsample] = np.asarray(resized)
        return self.levels[downsample]


# tifffile's arguments for each codec, by JPEG quality. JPEG 2000 is lossy at a fixed
# 40 dB PSNR (imagecodecs' level), whatever the quality, as Aperio's are lossy.
COMPRESSIONS = {
    "JPEG": lambda quality: {"compression": "jpeg", "compressionargs": {"level": quality}},
    "JPEG 2000": lambda quality: {"compression": 33005, "compressionargs": {"level": 40}},
}
DESCRIBED = {"JPEG": "JPEG/RGB", "JPEG 2000": "J2K/KDU"}


def write_rendered(
    path: str | Path,
    renderer: Renderer | PixelRenderer,
    width: int,
    height: int,
    mpp: float | None = 0.25,
    levels: int = 3,
    level_factor: int = 4,
    tile: int = 256,
    vendor: str = "aperio",
    quality: int = 85,
    codec: str = "JPEG",
) -> Path:
    """Write what `renderer` renders as a pyramidal JPEG TIFF (see write_slide)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sizes = [
        (max(width // level_factor**i, 1), max(height // level_factor**i, 1)) for i in range(levels)
    ]
    with tifffile.TiffWriter(path, bigtiff=width * height * 3 > 2**31) as tw:
        for i, (w, h) in enumerate(sizes):
            downsample = width / w
            tw.write(
                _tiles(renderer, w, h, tile, downsample),
                shape=(h, w, 3),
                dtype=np.uint8,
                tile=(tile, tile),
                photometric="rgb",
                **COMPRESSIONS[codec](quality),
                metadata=None,
                description=_description(vendor, width, height, w, h, tile, quality, mpp, codec),
                # OpenSlide's generic TIFF wants reduced levels flagged; Aperio's do not.
                subfiletype=1 if (i and vendor == "generic") else 0,
                **_resolution(mpp, downsample, vendor),
            )
            if i == 0 and vendor == "aperio":
                _write_thumbnail(tw, renderer, width, height, mpp)
    return path


def _tiles(
    renderer: Renderer | PixelRenderer, w: int, h: int, tile: int, downsample: float
) -> Iterator[np.ndarray]:
    for ty in range(0, h, tile):
        for tx in range(0, w, tile):
            yield renderer.render(tx, ty, tile, tile, downsample)


def _description(vendor, width, height, w, h, tile, quality, mpp, codec) -> str | None:
    if vendor == "generic":
        return None
    head = "Aperio Image Library v12.0.15 \r\n"
    mpp_field = f"|MPP = {mpp:g}" if mpp else ""
    if (w, h) == (width, height):
        return (
            f"{head}{width}x{height} [0,0 {width}x{height}] ({tile}x{tile}) "
            f"{DESCRIBED[codec]} Q={quality}|AppMag = 40{mpp_field}"
        )
    return f"{head}{width}x{height} -> {w}x{h} - |AppMag = 40{mpp_field}"


def _resolution(mpp: float | None, downsample: float, vendor: str) -> dict:
    if mpp is None or vendor == "aperio":
        return {}
    px_per_cm = 1e4 / (mpp * downsample)
    return {"resolution": (px_per_cm, px_per_cm), "resolutionunit": "CENTIMETER"}


def _write_thumbnail(
    tw: tifffile.TiffWriter, renderer: Renderer | PixelRenderer, width: int, height: int, mpp
) -> None:
    """Aperio files carry a stripped thumbnail as their second image."""
    scale = max(width, height) / 512
    w, h = max(1, round(width / scale)), max(1, round(height / scale))
    tw.write(
        renderer.render(0, 0, w, h, width / w),
        photometric="rgb",
        compression="jpeg",
        metadata=None,
        rowsperstrip=16,
        description=_description("aperio", width, height, w, h, 0, 85, mpp, "JPEG"),
    )
