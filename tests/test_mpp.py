import math

import pytest

from slidesnake.errors import MppError
from slidesnake.slides.mpp import resolve_mpp
from slidesnake.slides.slide import Slide
from slidesnake.slides.synthetic import Rect, write_slide


def resolve(props, sheet=None):
    return resolve_mpp(props, sheet, "s1", "/data/s1.svs")


def test_sample_sheet_wins_over_the_slide():
    mpp = resolve({"openslide.mpp-x": "0.25", "openslide.mpp-y": "0.25"}, sheet=0.5)
    assert (mpp.value, mpp.source) == (0.5, "sample sheet")


def test_openslide_mpp_is_used_when_the_sheet_has_none():
    for empty in (None, math.nan):
        mpp = resolve({"openslide.mpp-x": "0.2527", "openslide.mpp-y": "0.2527"}, sheet=empty)
        assert mpp.value == pytest.approx(0.2527)
        assert mpp.source == "openslide.mpp-x/y"


def test_tiff_resolution_tags_are_the_last_resort():
    props = {"tiff.ResolutionUnit": "centimeter", "tiff.XResolution": "40000"}
    assert resolve(props).value == pytest.approx(0.25)
    props = {"tiff.ResolutionUnit": "inch", "tiff.XResolution": "101600"}
    assert resolve(props).value == pytest.approx(0.25)


def test_resolution_tags_without_a_unit_mean_nothing():
    with pytest.raises(MppError, match="does not record"):
        resolve({"tiff.ResolutionUnit": "none", "tiff.XResolution": "1"})


@pytest.mark.parametrize("bad", ["352.78", "inf", "nan", "0", "-0.5"])
def test_implausible_slide_mpp_is_refused(bad):
    with pytest.raises(MppError, match="plausible") as err:
        resolve({"openslide.mpp-x": bad, "openslide.mpp-y": bad})
    assert "'mpp' column" in str(err.value)


def test_implausible_sheet_mpp_is_refused():
    with pytest.raises(MppError, match="correct the 'mpp' column"):
        resolve({}, sheet=1000.0)


def test_missing_mpp_names_the_slide_and_the_fix():
    with pytest.raises(MppError) as err:
        resolve({"openslide.vendor": "generic-tiff"})
    message = str(err.value)
    assert "slide 's1'" in message and "/data/s1.svs" in message
    assert "sample sheet's 'mpp' column" in message


def test_slide_without_mpp_opens_only_with_a_sheet_value(tmp_path):
    path = write_slide(
        tmp_path / "nompp.tif", 1024, 768, [Rect(0, 0, 512, 512)], mpp=None, vendor="generic"
    )
    with pytest.raises(MppError, match="nompp"):
        Slide(path, "nompp")
    with Slide(path, "nompp", mpp=0.5) as slide:
        assert slide.mpp == 0.5


def test_generic_tiff_mpp_comes_from_its_resolution_tags(tmp_path):
    path = write_slide(
        tmp_path / "g.tif", 1024, 768, [Rect(0, 0, 512, 512)], mpp=0.5, vendor="generic"
    )
    with Slide(path) as slide:
        assert slide.mpp == pytest.approx(0.5, rel=1e-4)


def test_boxes_tiff_72_dpi_is_refused(shared_slides):
    with pytest.raises(MppError, match="352"):
        Slide(shared_slides / "openslide-boxes.tiff", "boxes")
