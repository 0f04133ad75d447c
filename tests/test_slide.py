import numpy as np
import pytest

from slidesnake.errors import SlideOpenError
from slidesnake.slide import Slide


def test_levels_and_resolution_of_a_40x_pyramid(rect_slide):
    with Slide(rect_slide) as slide:
        assert slide.vendor == "aperio"
        assert [lv.downsample for lv in slide.levels] == pytest.approx([1, 4, 16])
        assert slide.level_mpp(2) == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("target", "level"), [(0.25, 0), (0.5, 0), (0.9, 0), (1.0, 1), (2.0, 1), (8.0, 2), (0.1, 0)]
)
def test_read_level_is_the_coarsest_not_coarser_than_the_target(rect_slide, target, level):
    with Slide(rect_slide) as slide:
        assert slide.level_for_mpp(target) == level


def test_read_gives_rgb_with_the_requested_size(rect_slide):
    with Slide(rect_slide) as slide:
        pixels = slide.read(1, 448 * 5, 448 * 4, 50, 30)
    assert pixels.shape == (30, 50, 3) and pixels.dtype == np.uint8
    assert pixels[..., 1].mean() < 200  # inside the pink tissue rectangle, not white


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(SlideOpenError, match="does not exist"):
        Slide(tmp_path / "nope.svs", "nope")


def test_a_text_file_is_not_a_slide(tmp_path):
    fake = tmp_path / "fake.svs"
    fake.write_text("not a slide at all\n" * 50)
    with pytest.raises(SlideOpenError, match="does not recognise") as err:
        Slide(fake, "fake")
    assert "slide 'fake'" in str(err.value) and "Fix:" in str(err.value)
