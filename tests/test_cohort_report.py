"""The cohort's table and gallery: bounded whatever the cohort's size, failed slides first."""

from __future__ import annotations

from itertools import pairwise

import pandas as pd
from PIL import Image

from slidesnake.cohort.gallery import CELL_PX, GALLERY_SLIDES, gallery_rows, write_gallery
from slidesnake.cohort.summary import cohort_html


def table(statuses: list[str]) -> pd.DataFrame:
    ids = [f"s{i:05d}" for i in range(len(statuses))]
    return pd.DataFrame({"slide_id": ids, "status": statuses, "tiles": 1, "wall_s": 1.0})


def test_gallery_shows_failed_slides_first_then_an_even_spread_of_the_rest():
    statuses = ["done"] * 10_000
    for index in (17, 5_000, 9_999):
        statuses[index] = "failed"
    rows = gallery_rows(table(statuses))
    assert len(rows) == GALLERY_SLIDES
    assert list(rows["slide_id"][:3]) == ["s00017", "s05000", "s09999"]
    rest = rows["slide_id"][3:].str[1:].astype(int).tolist()
    assert rest[0] == 0 and rest[-1] == 9_998 and rest == sorted(set(rest))
    gaps = [b - a for a, b in pairwise(rest)]
    assert max(gaps) - min(gaps) <= 2  # evenly spread over the sheet


def test_gallery_of_a_small_cohort_shows_every_slide():
    assert len(gallery_rows(table(["done", "failed", "pending"]))) == 3
    assert len(gallery_rows(table(["failed"] * 100))) == GALLERY_SLIDES


def test_gallery_draws_pictures_on_disk_and_marks_slides_without_one(tmp_path):
    results = tmp_path / "slides"
    (results / "s00000").mkdir(parents=True)
    Image.new("RGB", (800, 600), (200, 0, 200)).save(results / "s00000" / "qc_tiles.png")
    path = tmp_path / "gallery.jpg"
    write_gallery(table(["done", "failed"]), results, path)
    with Image.open(path) as sheet:
        assert sheet.width == 2 * CELL_PX
        pixels = sheet.convert("RGB").load()
        assert pixels[CELL_PX // 2, CELL_PX // 2] == (255, 255, 255)  # failed, first: none
        assert pixels[CELL_PX + CELL_PX // 2, CELL_PX // 2][1] < 60  # the magenta picture


def test_cohort_page_links_only_pictures_on_disk_and_escapes_ids(tmp_path):
    (tmp_path / "slides" / "a&b").mkdir(parents=True)
    (tmp_path / "slides" / "a&b" / "qc_mask.png").write_bytes(b"")
    page = cohort_html(table(["done", "failed"]).assign(slide_id=["a&b", "c"]), tmp_path)
    assert '<a href="slides/a%26b/qc_mask.png">mask</a>' in page
    assert "<td>a&amp;b</td>" in page and "qc_tiles" not in page
    assert "1 of 2 slides done" in page
