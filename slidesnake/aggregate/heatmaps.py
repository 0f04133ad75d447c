"""heatmaps.png: a head's tile probabilities over the slide's thumbnail, one panel per
class, each with a colour bar from 0 to 1, at the scale of qc_tiles.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw

from slidesnake.tiling.mask_file import load_mask
from slidesnake.tiling.qc import load_picture, save_picture

# A perceptually ordered ramp (dark blue -> teal -> yellow), as viridis runs.
RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]])
BAR_PX, LABEL_PX, GAP_PX = 12, 16, 8


def ramp(values: np.ndarray) -> np.ndarray:
    """(N,) values in [0, 1] -> (N, 3) uint8 colours."""
    position = np.clip(values, 0, 1) * (len(RAMP) - 1)
    low = np.floor(position).astype(int).clip(0, len(RAMP) - 2)
    fraction = (position - low)[:, None]
    return ((1 - fraction) * RAMP[low] + fraction * RAMP[low + 1]).round().astype(np.uint8)


def draw_heatmaps(
    predictions: pd.DataFrame,
    classes: list[str],
    size_level0: int,
    mask_path: str | Path,
    thumbnail_path: str | Path,
    out_path: str | Path,
) -> None:
    """One panel per class of `predictions` (x, y and a column per class), side by side."""
    mask = load_mask(mask_path)
    faded = (0.4 * load_picture(thumbnail_path) + 0.6 * 255).astype(np.uint8)
    if not classes:  # a slide of 0 tiles: nothing to colour
        save_picture(faded, out_path)
        return
    height, width = faded.shape[:2]
    left = (predictions["x"].to_numpy() / mask.scale_x).astype(int)
    top = (predictions["y"].to_numpy() / mask.scale_y).astype(int)
    w, h = max(round(size_level0 / mask.scale_x), 1), max(round(size_level0 / mask.scale_y), 1)
    panel_h = LABEL_PX + height + GAP_PX + BAR_PX + LABEL_PX
    sheet = Image.new("RGB", (len(classes) * (width + GAP_PX), panel_h), "white")
    draw = ImageDraw.Draw(sheet)
    bar = ramp(np.linspace(0, 1, width))[None, :, :].repeat(BAR_PX, axis=0)
    for index, name in enumerate(classes):
        panel = faded.copy()
        colours = ramp(predictions[name].to_numpy(np.float64))
        for x, y, colour in zip(left, top, colours, strict=True):
            panel[y : y + h, x : x + w] = colour
        x0 = index * (width + GAP_PX)
        draw.text((x0 + 2, 2), str(name)[:40], fill=(0, 0, 0))
        sheet.paste(Image.fromarray(panel), (x0, LABEL_PX))
        sheet.paste(Image.fromarray(bar), (x0, LABEL_PX + height + GAP_PX))
        draw.text((x0, LABEL_PX + height + GAP_PX + BAR_PX + 2), "0", fill=(0, 0, 0))
        draw.text((x0 + width - 8, LABEL_PX + height + GAP_PX + BAR_PX + 2), "1", fill=(0, 0, 0))
    save_picture(np.asarray(sheet), out_path)
