"""results/cohort_gallery.jpg: one contact sheet of QC pictures, whatever the cohort's size.

The Snakemake report embeds every picture it carries into one HTML file, so per-slide
pictures of a 10,000-slide cohort would make a report no browser opens. The report carries
this sheet instead: the failed slides first (their pictures are usually absent, which is
the point of listing them), then slides spread evenly over the sample sheet. Every slide's
own pictures stay on disk, linked from results/cohort.html.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw

from slidesnake.atomic import atomic_output

GALLERY_SLIDES = 48
CELL_PX = 256
LABEL_PX = 18
COLUMNS = 8
QC_PICTURES = ("qc_mask.png", "qc_tiles.png")  # a slide's QC pictures, in stage order
EMBEDDING_MAP = "embedding_map.png"
STATUS_COLOUR = {"done": (40, 120, 40), "failed": (190, 30, 30), "pending": (110, 110, 110)}


def gallery_rows(table: pd.DataFrame, limit: int = GALLERY_SLIDES) -> pd.DataFrame:
    """The slides the sheet shows: failed ones first, then an even spread of the rest."""
    failed = table[table["status"] == "failed"].head(limit)
    rest = table[table["status"] != "failed"]
    room = min(limit - len(failed), len(rest))
    spread = np.linspace(0, len(rest) - 1, room).round().astype(int) if room > 0 else []
    return pd.concat([failed, rest.iloc[spread]])


def qc_picture(
    results: Path, slide_id: str, pictures: tuple[str, ...] = QC_PICTURES
) -> Path | None:
    """The slide's most finished picture of `pictures` (in stage order): for the QC ones,
    the kept tiles, else the tissue outline."""
    for name in reversed(pictures):
        if (results / slide_id / name).is_file():
            return results / slide_id / name
    return None


def write_gallery(
    table: pd.DataFrame,
    results: str | Path,
    path: str | Path,
    pictures: tuple[str, ...] = QC_PICTURES,
) -> None:
    """Write the contact sheet of `table`'s slides (a cohort table) as a JPEG."""
    rows = gallery_rows(table)
    columns = min(COLUMNS, max(len(rows), 1))
    lines = max(-(-len(rows) // columns), 1)
    sheet = Image.new("RGB", (columns * CELL_PX, lines * (CELL_PX + LABEL_PX)), "white")
    draw = ImageDraw.Draw(sheet)
    for index, row in enumerate(rows.itertuples()):
        left, top = (index % columns) * CELL_PX, (index // columns) * (CELL_PX + LABEL_PX)
        picture = qc_picture(Path(results), row.slide_id, pictures)
        if picture is not None:
            with Image.open(picture) as image:
                image.thumbnail((CELL_PX - 4, CELL_PX - 4))
                sheet.paste(image.convert("RGB"), (left + 2, top + LABEL_PX))
        else:
            draw.text((left + 8, top + LABEL_PX + 8), "no picture", fill=(110, 110, 110))
        label = f"{row.slide_id[:32]}  {row.status}"
        draw.text((left + 4, top + 3), label, fill=STATUS_COLOUR[row.status])
    with atomic_output(path) as tmp:
        sheet.save(tmp, format="JPEG", quality=85)
