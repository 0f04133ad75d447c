import numpy as np
import openslide
import pytest

from slidesnake.errors import SlideOpenError
from slidesnake.slides.slide import Slide


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


def openslide_rgb(path, level, x, y, width, height) -> np.ndarray:
    with openslide.OpenSlide(str(path)) as osr:
        rgba = np.asarray(osr.read_region((x, y), level, (width, height)))
    rgb = rgba[..., :3].copy()
    rgb[rgba[..., 3] == 0] = 255
    return rgb


# Reads inside, across tile borders, past the right and bottom edges, before the top left
# corner, wholly outside, and at level 1.
READS = [(0, 0, 0, 300, 200), (0, 1000, 700, 900, 600), (0, 8700, 6900, 600, 500)]
READS += [(0, -300, -100, 500, 400), (0, 20000, 0, 64, 64), (1, 2000, 1600, 300, 250)]


@pytest.mark.parametrize("slide", ["rect_slide", "blob_slide"])
@pytest.mark.parametrize("read", READS)
def test_tiff_reads_give_openslides_pixels(request, slide, read):
    path = request.getfixturevalue(slide)
    with Slide(path) as s:
        assert s.tiled_level(read[0]) is not None, "tiled JPEG TIFF: the fast path is taken"
        np.testing.assert_array_equal(s.read(*read), openslide_rgb(path, *read))


def test_reads_between_two_pixels_of_a_level_go_through_openslide(rect_slide):
    with Slide(rect_slide) as s:
        assert 1001 % s.levels[1].downsample  # level 1 is 4x: 1001 is not on a pixel
        np.testing.assert_array_equal(
            s.read(1, 1001, 700, 64, 64), openslide_rgb(rect_slide, 1, 1001, 700, 64, 64)
        )


@pytest.mark.real_slides
def test_tiff_reads_of_a_real_scan_give_openslides_pixels(shared_slides):
    path = shared_slides / "CMU-1-Small-Region.svs"  # JPEG stored as RGB, not YCbCr
    with Slide(path) as s:
        assert s.tiled_level(0) is not None
        for read in [(0, 0, 0, 500, 500), (0, 1000, 1500, 1300, 1600)]:
            np.testing.assert_array_equal(s.read(*read), openslide_rgb(path, *read))


@pytest.mark.real_slides
def test_aperio_jpeg_2000_tiles_are_decoded_to_openslides_pixels(shared_slides):
    path = shared_slides / "tcga-cr-7395-01a-01-ts1.svs"  # RGB JPEG 2000 (33005)
    with Slide(path, mpp=0.25) as s:
        assert s.tiled_level(0) is not None
        for read in [(0, 0, 0, 300, 300), (0, 1900, 1500, 700, 600), (0, 4200, 3400, 400, 300)]:
            np.testing.assert_array_equal(s.read(*read), openslide_rgb(path, *read))
        assert s.tiled_level(1) is None, "downsample 2.001: OpenSlide resamples, so it reads"
        np.testing.assert_array_equal(
            s.read(1, 2002, 1600, 200, 200), openslide_rgb(path, 1, 2002, 1600, 200, 200)
        )
