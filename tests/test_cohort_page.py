"""results/cohort.html as a browser shows it (headless Chromium): the demo cohort and a
broken slide, through the real workflow."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pandas as pd
import pytest
from browser import rendered, require_chromium, screenshot
from conftest import Workflow

from slidesnake.cohort.demo import write_demo_slides
from slidesnake.cohort.page import cohort_page

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    require_chromium()
    root = tmp_path_factory.mktemp("page")
    forty, twenty, no_mpp = write_demo_slides(root / "slides")
    broken = root / "slides" / "broken.svs"
    broken.write_bytes(b"II*\x00" + bytes(100))  # a TIFF header and nothing behind it
    workflow = Workflow(root / "run")
    workflow.sheet(
        [
            ("demo-40x", forty),
            ("demo-20x", twenty),
            ("demo-no-mpp", no_mpp, 0.5),
            ("broken", broken),
        ]
    )
    assert workflow.run(check=False).returncode != 0
    return workflow.dir / "results"


def rows(dom: str) -> list[tuple[str, str]]:
    """(status, slide) of each table row the script drew, in order."""
    return re.findall(r'<tr class="(\w+)"><td class="text">([^<]*)</td>', dom)


def test_the_page_shows_the_failure_first_its_reason_and_the_pictures_inline(results, tmp_path):
    dom, console = rendered((results / "cohort.html").as_uri())
    assert console == [] and 'data-ready="yes"' in dom and "data-errors" not in dom
    failures = dom[dom.index('class="failures"') :]
    failures = failures[: failures.index("</ul>")]
    assert dom.index('class="failures"') < dom.index('id="slides"')
    assert "broken" in failures and "does not recognise this file" in failures
    assert "Fix:" in failures
    assert dom.count('src="data:image/') == 3  # contact sheet, embedding maps, projection
    assert sorted(rows(dom)) == [
        ("done", "demo-20x"), ("done", "demo-40x"), ("done", "demo-no-mpp"), ("failed", "broken")
    ]  # fmt: skip
    thumbnails = re.findall(r'<img loading="lazy"[^>]* src="(slides/[^"]+)"', dom)
    assert len(thumbnails) == 9  # mask, tiles and embedding map of each done slide
    assert all((results / unquote(name)).is_file() for name in thumbnails)
    assert "3</b> of 4 slides done" in dom and "the run had finished" in dom
    shot = screenshot((results / "cohort.html").as_uri(), tmp_path / "cohort.png")
    assert shot.stat().st_size > 20_000


def test_the_address_filters_and_sorts_the_table(results):
    page = (results / "cohort.html").as_uri()
    dom, console = rendered(page + "#status=failed")
    assert rows(dom) == [("failed", "broken")] and "1 of 4 rows" in dom and not console
    dom, _ = rendered(page + "#text=20X")
    assert rows(dom) == [("done", "demo-20x")]
    dom, _ = rendered(page + "#sort=tiles&status=done")  # the sheet's order reversed
    assert [slide for _, slide in rows(dom)] == ["demo-no-mpp", "demo-20x", "demo-40x"]
    dom, _ = rendered(page + "#sort=-tiles&status=done")
    assert [slide for _, slide in rows(dom)] == ["demo-40x", "demo-20x", "demo-no-mpp"]


def test_a_large_cohort_is_drawn_500_rows_at_a_time(tmp_path):
    require_chromium()
    ids = [f"s{i:04d}" for i in range(1200)]
    table = pd.DataFrame({"slide_id": ids, "status": "done", "tiles": range(1200),
                          "wall_s": 1.0, "loader_wait_fraction": 0.0})  # fmt: skip
    (tmp_path / "cohort.html").write_text(cohort_page(table, tmp_path, {}))
    dom, console = rendered((tmp_path / "cohort.html").as_uri() + "#sort=-tiles")
    assert len(rows(dom)) == 500 and rows(dom)[0] == ("done", "s1199") and not console
    assert "1200 of 1200 rows, the first 500 shown" in dom
    assert '<button id="more">' in dom  # not hidden
    dom, _ = rendered((tmp_path / "cohort.html").as_uri() + "#text=s11")
    assert len(rows(dom)) == 100 and '<button id="more" hidden="">' in dom


def test_an_error_in_a_page_is_seen(tmp_path):
    """The harness itself: a page whose script fails is caught."""
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>console.log('said'); notDefined();</script></body></html>")
    _, console = rendered(page.as_uri())
    assert any("said" in line for line in console)
    assert any("notDefined is not defined" in line for line in console)
