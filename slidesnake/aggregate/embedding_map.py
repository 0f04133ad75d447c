"""embedding_map.png: the first three principal components of a slide's tile embeddings
as the red, green and blue of each tile, over the slide's thumbnail, at the scale of
qc_tiles.png. Tissue of one kind comes out in one colour; a wrong mpp, swapped colour
channels or a broken model show at a glance.

The principal components come from the features' covariance, accumulated over row chunks
(D x D in float64), so memory does not grow with the number of tiles.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr
from PIL import Image, ImageDraw

from slidesnake.embed.store import open_embeddings
from slidesnake.tiling.mask_file import load_mask
from slidesnake.tiling.qc import load_picture, save_picture
from slidesnake.tiling.tile_table import read_tiles

RANDOM_WEIGHTS_NOTE = "RANDOM MODEL WEIGHTS: these colours mean nothing"


def principal_colours(features: zarr.Array) -> np.ndarray:
    """(N, 3) uint8: each tile's first three principal components around mid-grey, all
    three scaled alike, so that the 99th percentile of their magnitudes spans half the
    range: colours differ as much as the embeddings do along each component."""
    rows, dim = features.shape
    if rows == 0:
        return np.zeros((0, 3), np.uint8)
    step = features.chunks[0]
    total, outer = np.zeros(dim), np.zeros((dim, dim))
    for start in range(0, rows, step):
        chunk = features[start : start + step].astype(np.float64)
        total += chunk.sum(axis=0)
        outer += chunk.T @ chunk
    mean = total / rows
    covariance = outer / rows - np.outer(mean, mean)
    _, vectors = np.linalg.eigh(covariance)  # ascending eigenvalues
    axes = vectors[:, ::-1][:, :3]
    axes *= np.sign(axes[np.abs(axes).argmax(axis=0), range(axes.shape[1])])  # fixed signs
    projected = np.concatenate([
        (features[start : start + step].astype(np.float64) - mean) @ axes
        for start in range(0, rows, step)
    ])  # fmt: skip
    # One scale for the three: a component that is only noise stays near mid-grey instead
    # of being stretched to the full range like the component that carries the tissue.
    scale = max(float(np.percentile(np.abs(projected), 99)), 1e-12)
    colours = np.full((rows, 3), 0.5)
    colours[:, : projected.shape[1]] = np.clip(0.5 + projected / (2 * scale), 0, 1)
    return (255 * colours).round().astype(np.uint8)


def draw_embedding_map(
    zarr_path: str | Path,
    tiles_path: str | Path,
    mask_path: str | Path,
    thumbnail_path: str | Path,
    out_path: str | Path,
) -> None:
    """Paint each tile in its colour over the faded thumbnail (qc_mask.png)."""
    group = open_embeddings(zarr_path)
    _, geometry = read_tiles(tiles_path)
    mask = load_mask(mask_path)
    picture = (0.4 * load_picture(thumbnail_path) + 0.6 * 255).astype(np.uint8)
    colours = principal_colours(group["features"])
    coords = group["coords"][:]
    left = (coords[:, 0] / mask.scale_x).astype(int)
    top = (coords[:, 1] / mask.scale_y).astype(int)
    width = max(round(geometry.size_level0 / mask.scale_x), 1)
    height = max(round(geometry.size_level0 / mask.scale_y), 1)
    for x, y, colour in zip(left, top, colours, strict=True):
        picture[y : y + height, x : x + width] = colour
    if group.attrs.get("weights") == "random":
        picture = _with_note(picture, RANDOM_WEIGHTS_NOTE)
    save_picture(picture, out_path)


def _with_note(picture: np.ndarray, note: str) -> np.ndarray:
    image = Image.fromarray(picture)
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, image.width, 14), fill=(190, 30, 30))
    draw.text((4, 2), note, fill=(255, 255, 255))
    return np.asarray(image)
