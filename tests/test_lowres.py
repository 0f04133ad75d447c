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


@pytest.mark.parametrize("codec", ["JPEG", "JPEG 2000"])
def test_a_scaled_mask_read_decodes_at_the_masks_scale_in_strips(flat_slide, codec, tmp_path):
    """A level 16 times finer than the mask decodes at 1/8 and bins the rest by 2, in
    strips as the exact read does, to nearly the same picture."""
    path = flat_slide
    if codec != "JPEG":
        shapes = [Rect(512, 256, 1536, 1280)]
        path = write_slide(tmp_path / "j2k.svs", 2048, 1536, shapes, mpp=0.5, levels=1,
                           codec=codec)  # fmt: skip
    with Slide(path) as slide:
        assert lowres.scaled_shrink(slide, 0, 16) == 8
        exact = read_lowres(slide, 8.0)
        scaled = read_lowres(slide, 8.0, decode="scaled")
        lowres.STRIP_BYTES, whole = 4 * 2048 * 16 * 3, lowres.STRIP_BYTES
        try:
            strips = read_lowres(slide, 8.0, decode="scaled")
        finally:
            lowres.STRIP_BYTES = whole
    assert scaled.rgb.shape == exact.rgb.shape == (1536 // 16, 2048 // 16, 3)
    assert (scaled.level, scaled.mpp, scaled.scale_x) == (exact.level, exact.mpp, exact.scale_x)
    np.testing.assert_array_equal(scaled.rgb, strips.rgb)
    difference = np.abs(scaled.rgb.astype(float) - exact.rgb)
    assert difference.mean() < 2.0 and difference.max() <= 40  # JPEG 1.0, JPEG 2000 1.5
    with Slide(path) as slide:
        assert read_lowres(slide, 4.0, decode="scaled").rgb.shape == (1536 // 8, 2048 // 8, 3)


def test_a_level_with_no_scaled_decode_is_read_exactly(tmp_path):
    boxes = write_slide(tmp_path / "g.tif", 1024, 768, [Rect(0, 0, 512, 512)], mpp=0.5,
                        levels=1, vendor="generic")  # fmt: skip
    with Slide(boxes) as slide:
        assert lowres.scaled_shrink(slide, 0, 3) == 1  # no scale divides a factor of 3
        np.testing.assert_array_equal(
            read_lowres(slide, 1.5, decode="scaled").rgb, read_lowres(slide, 1.5).rgb
        )
