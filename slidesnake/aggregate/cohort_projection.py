"""results/slide_features_pca.png: the cohort's slide features (mean pooling) projected on
their first two principal components, one dot per slide. Slides that sit apart from the
rest (another stain, another scanner, a broken slide) stand out; labels go to at most
LABELS slides, spread over the cohort, so the picture stays readable at 10,000 slides."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw

from slidesnake.atomic import atomic_output

SIZE_PX, MARGIN_PX, LABELS = 720, 60, 60


def draw_cohort_projection(table: pd.DataFrame, path: str | Path, pooling: str = "mean") -> bool:
    """Draw the projection of `table`'s rows of `pooling` (slide_features.parquet); False,
    and no picture, when fewer than 3 slides have features."""
    rows = table[table["pooling"] == pooling]
    features = rows.filter(regex=r"^f\d+$").dropna(axis=1, how="all")
    keep = features.notna().all(axis=1).to_numpy()
    if keep.sum() < 3 or features.shape[1] < 2:  # (no slide with a tile has no columns)
        return False
    matrix = features.to_numpy(np.float64)[keep]
    centred = matrix - matrix.mean(axis=0)
    _, singular, axes = np.linalg.svd(centred, full_matrices=False)
    points = centred @ axes[:2].T
    explained = singular[:2] ** 2 / max(float((singular**2).sum()), 1e-12)
    _save(_picture(points, rows["slide_id"].to_numpy()[keep], explained, pooling), path)
    return True


def _picture(points: np.ndarray, names: np.ndarray, explained: np.ndarray, pooling: str):
    image = Image.new("RGB", (SIZE_PX, SIZE_PX), "white")
    draw = ImageDraw.Draw(image)
    low, high = points.min(axis=0), points.max(axis=0)
    span = np.where(high > low, high - low, 1.0)
    inner = SIZE_PX - 2 * MARGIN_PX
    xy = MARGIN_PX + (points - low) / span * inner
    xy[:, 1] = SIZE_PX - xy[:, 1]  # the second component grows upwards
    draw.rectangle((MARGIN_PX, MARGIN_PX, SIZE_PX - MARGIN_PX, SIZE_PX - MARGIN_PX),
                   outline=(180, 180, 180))  # fmt: skip
    labelled = set(np.linspace(0, len(names) - 1, min(LABELS, len(names))).round().astype(int))
    for index, (x, y) in enumerate(xy):
        draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=(40, 90, 200))
        if index in labelled:
            draw.text((x + 6, y - 6), str(names[index])[:24], fill=(30, 30, 30))
    title = f"{len(names)} slides: slide features ({pooling} pooling), principal components"
    draw.text((MARGIN_PX, 20), title, fill=(0, 0, 0))
    draw.text((MARGIN_PX, SIZE_PX - 40), f"PC1: {100 * explained[0]:.0f}% of the variance",
              fill=(0, 0, 0))  # fmt: skip
    draw.text((8, MARGIN_PX - 16), f"PC2: {100 * explained[1]:.0f}%", fill=(0, 0, 0))
    return image


def _save(image: Image.Image, path: str | Path) -> None:
    with atomic_output(path) as tmp:
        image.save(tmp, format="PNG")
