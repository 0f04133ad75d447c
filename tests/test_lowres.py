import logging

import numpy as np
import pytest

from slidesnake.slides import lowres
from slidesnake.slides.lowres import read_lowres
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import Rect, write_slide


@pytest.fixture(scope="module")
def flat_slide(tmp_path_factory):
    """A slide with level 0 only, as some exports are."""
    path = tmp_path_factory.mktemp("flat") / "flat.svs"
    return write_slide(path, 2048, 1536, [Rect(512, 256, 1536, 1280)], mpp=0.5, levels=1)


def test_pyramid_is_read_from_a_reduced_level(rect_slide):
    with Slide(rect_slide) as slide:
        picture = read_lowres(slide, 8.0)
    assert picture.level == 2
    assert picture.mpp == pytest.approx(8.0)
    assert picture.rgb.shape == (slide.dimensions[1] // 32, slide.dimensions[0] // 32, 3)


def test_pyramid_whose_levels_are_all_finer_still_skips_level_0(rect_slide):
    with Slide(rect_slide) as slide:
        assert read_lowres(slide, 0.3).level == 1


def test_flat_slide_is_read_in_strips_with_a_warning(flat_slide, monkeypatch, caplog):
    with Slide(flat_slide) as slide, caplog.at_level(logging.WARNING):
        whole = read_lowres(slide, 8.0)
        monkeypatch.setattr(lowres, "STRIP_BYTES", 4 * 2048 * 16 * 3)  # 3 blocks of 16 rows
        strips = read_lowres(slide, 8.0)
    assert "no reduced-resolution level" in caplog.text and "3 Mpx" in caplog.text
    assert whole.level == strips.level == 0
    assert strips.rgb.shape == (1536 // 16, 2048 // 16, 3)
    np.testing.assert_array_equal(whole.rgb, strips.rgb)
    tissue = strips.rgb[256 // 16 + 1 : 1280 // 16 - 1, 512 // 16 + 1 : 1536 // 16 - 1]
    assert tissue[..., 1].mean() < 200 and strips.rgb[:10, :10, 1].mean() > 230
