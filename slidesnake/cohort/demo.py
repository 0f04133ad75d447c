"""The demo cohort: a few synthetic slides covering the cases users meet first."""

from __future__ import annotations

from pathlib import Path

from slidesnake.slides.synthetic import random_blobs, write_slide


def write_demo_slides(directory: str | Path) -> list[Path]:
    """A 40x Aperio slide, a 20x generic TIFF, and a slide that records no mpp.

    The slide without mpp is listed with an `mpp` column in config/samples.tsv, which is
    how users rescue such scans.
    """
    directory = Path(directory)
    specs = [
        ("demo-40x.svs", 16000, 12000, 0.25, "aperio", 3),
        ("demo-20x.tif", 8000, 6000, 0.5, "generic", 2),
        ("demo-no-mpp.tif", 6000, 5000, None, "generic", 2),
    ]
    written = []
    for seed, (name, width, height, mpp, vendor, levels) in enumerate(specs, start=1):
        path = directory / name
        if not path.exists():
            shapes = random_blobs(width, height, count=3, seed=seed)
            write_slide(
                path, width, height, shapes, mpp=mpp, vendor=vendor, levels=levels, seed=seed
            )
        written.append(path)
    return written
