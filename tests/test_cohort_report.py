"""The cohort's table and gallery: bounded whatever the cohort's size, failed slides first."""

from __future__ import annotations

import json
from itertools import pairwise

import pandas as pd
from PIL import Image

from slidesnake.cohort.gallery import CELL_PX, GALLERY_SLIDES, gallery_rows, write_gallery
from slidesnake.cohort.page import cohort_page, headline


def table(statuses: list[str]) -> pd.DataFrame:
    ids = [f"s{i:05d}" for i in range(len(statuses))]
    columns = {"tiles": 1, "wall_s": 1.0, "loader_wait_fraction": 0.1}
    return pd.DataFrame({"slide_id": ids, "status": statuses, **columns})


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


def test_cohort_page_lists_only_pictures_on_disk_and_escapes_ids(tmp_path):
    (tmp_path / "slides" / "a&b").mkdir(parents=True)
    (tmp_path / "slides" / "a&b" / "qc_mask.png").write_bytes(b"")
    failed = table(["failed", "done"]).assign(slide_id=["a&b", "</script>"], reason=["bad", ""])
    page = cohort_page(failed, tmp_path, {})
    data = page[page.index('id="rows">') + 10 : page.index("</script>", page.index('id="rows">'))]
    rows = json.loads(data)
    assert rows[0]["pictures"] == ["qc_mask.png"] and rows[1]["pictures"] == []
    assert rows[1]["slide_id"] == "</script>"  # kept whole, and not ending the script
    assert "<b>a&amp;b</b>: bad" in page
    assert "<b>1</b> of 2 slides done" in page and "<b>1</b> failed" in page


def test_the_headline_says_what_held_the_run_up():
    slow_reader = table(["done"] * 3).assign(loader_wait_fraction=[0.5, 0.4, 0.1])
    assert "loader wait <b>40%</b> of a job: the reader was the bottleneck" in headline(slow_reader)
    busy_gpu = slow_reader.assign(loader_wait_fraction=0.01)
    assert "the GPU (the model) was the bottleneck" in headline(busy_gpu)
    assert "<b>1</b> tiles/s" in headline(busy_gpu)
