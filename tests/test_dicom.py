"""DICOM whole-slide series through wsidicom: a folder on disk, and the same series on a
DICOMweb server (Orthanc, started by the tests on loopback). The series is made from the
real pixels of the CMU slide: it reads as OpenSlide reads its files, its masks, tiles and
embeddings over DICOMweb equal those from disk, and its failures fail its own slide."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pydicom
import pytest
from conftest import jobs_run
from dicom_files import write_dicom_pyramid
from store_servers import DripProxy, OrthancServer, orthanc_binary

from slidesnake import load_embeddings
from slidesnake.errors import SlideOpenError, SlideSizeError, StoreTimeoutError
from slidesnake.slides import locator, stores
from slidesnake.slides.slide import Slide
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.stages import make_tile_coords, make_tissue_mask
from slidesnake.tiling.tissue import TissueParams

pytestmark = [pytest.mark.store, pytest.mark.real_slides]


@pytest.fixture(scope="module")
def series(tmp_path_factory, shared_slides):
    """The CMU slide's pixels as a three-level DICOM series, in a folder of its own."""
    with Slide(shared_slides / "CMU-1-Small-Region.svs", "cmu") as slide:
        rgb = slide.read(0, 0, 0, *slide.dimensions)
    folder = tmp_path_factory.mktemp("dicom") / "cmu"
    template = shared_slides / "dicom-openslide-boxes" / "boxes_0.dcm"
    write_dicom_pyramid(rgb, 0.499, folder, template)
    return folder


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    if orthanc_binary() is None:
        if os.environ.get("SLIDESNAKE_REQUIRE_ORTHANC"):
            pytest.fail(
                "Orthanc and its DICOMweb plugin are required: apt install orthanc orthanc-dicomweb"
            )
        pytest.skip("Orthanc with its DICOMweb plugin is not installed")
    server = OrthancServer(tmp_path_factory.mktemp("orthanc"))
    yield server
    server.stop()


def _same_slide(expected: Slide, got: Slide) -> None:
    """Same levels and mpp, same pixels at each level (from an offset where the level's
    downsample is whole: elsewhere OpenSlide resamples and a level read does not)."""
    sizes = [(lv.width, lv.height) for lv in expected.levels]
    assert [(lv.width, lv.height) for lv in got.levels] == sizes
    assert got.mpp == pytest.approx(expected.mpp)
    for level in expected.levels:
        d = int(level.downsample) if level.downsample.is_integer() else 0
        w, h = min(level.width, 700), min(level.height, 600)
        a = expected.read(level.index, 5 * d, 7 * d, w, h)
        assert np.array_equal(got.read(level.index, 5 * d, 7 * d, w, h), a), level


def test_a_series_folder_reads_as_openslide_reads_its_files(series):
    with Slide(series / "level-0.dcm", "s") as by_openslide, Slide(series, "s") as by_folder:
        assert by_folder.vendor == "dicom" and by_openslide.vendor == "dicom"
        _same_slide(by_openslide, by_folder)


def test_a_dicomweb_series_gives_the_folders_pixels_masks_and_tiles(series, orthanc, tmp_path):
    url = orthanc.add(sorted(series.glob("*.dcm")))
    assert stores.is_dicomweb(url)
    with Slide(series, "s") as local, Slide(url, "s") as web:
        _same_slide(local, web)
    for name, path in (("folder", series), ("web", url)):
        out = tmp_path / name
        make_tissue_mask(path, "s", out / "mask.png", out / "qc.png", TissueParams(), None)
        make_tile_coords(path, "s", out / "mask.png", out / "qc.png", out / "tiles.parquet",
                         out / "qc_tiles.png", TileParams())  # fmt: skip
    for name in ("mask.png", "tiles.parquet"):
        assert (tmp_path / "folder" / name).read_bytes() == (tmp_path / "web" / name).read_bytes()
    first = locator.stat_slide(url, "s")
    assert first.size == 3 and first.version.startswith("DICOM instances sha256")
    assert locator.stat_slides([url])[url] == first.describe()


def test_a_series_under_a_bucket_prefix_reads_as_its_folder(series, s3):
    for path in sorted(series.glob("*.dcm")):
        s3.put("archive", f"cmu-series/{path.name}", path)
    stores.configure(s3.storage)
    try:
        prefix = "s3://archive/cmu-series/"
        with Slide(series, "s") as local, Slide(prefix, "s") as remote:
            _same_slide(local, remote)
        first = locator.stat_slide(prefix, "s")
        assert first.version.startswith("3 objects") and first.size > 0
        s3.put("archive", "cmu-series/level-2.dcm", b"replaced")
        assert locator.stat_slide(prefix, "s") != first
    finally:
        stores.configure(None)


def test_dicom_failures_fail_their_slide_in_one_line(series, orthanc, shared_slides, tmp_path):
    missing = f"{orthanc.url}/dicom-web/studies/1.2.3/series/4.5.6"
    with pytest.raises(SlideOpenError, match=r"slide 's' \(http://127\.0\.0\.1:\d+/dicom-web/"):
        Slide(missing, "s")
    assert locator.stat_slides([missing])[missing].startswith("unreadable (")
    with pytest.raises(SlideOpenError, match="one instance of a series"):
        Slide(f"{orthanc.url}/wado/level-0.dcm", "s")
    with Slide(series, "s") as slide:
        rgb = slide.read(0, 0, 0, *slide.dimensions)
    template = shared_slides / "dicom-openslide-boxes" / "boxes_0.dcm"
    flat = write_dicom_pyramid(rgb, 0.499, tmp_path / "flat", template, levels=1)
    url = orthanc.add(flat)  # a series without a pyramid
    bounded = TissueParams(max_decode_mpx=1.0)
    with pytest.raises(SlideSizeError, match=r"tissue\.max_decode_mpx"):
        make_tissue_mask(url, "s", tmp_path / "m.png", tmp_path / "q.png", bounded, None)


def test_a_transfer_syntax_openslide_refuses_reads_through_wsidicom(shared_slides, tmp_path):
    folder = tmp_path / "jpegls"
    folder.mkdir()
    shutil.copy(shared_slides / "unsupported" / "highdicom-sm_image_jpegls.dcm", folder)
    with pytest.raises(SlideOpenError, match="OpenSlide cannot open it"):
        Slide(folder / "highdicom-sm_image_jpegls.dcm", "s")
    with Slide(folder, "s") as slide:
        assert slide.dimensions == (50, 50)
        pixels = slide.read(0, 0, 0, 50, 50)
    assert pixels.shape == (50, 50, 3) and pixels.std() > 0


def test_a_folder_or_prefix_holding_two_series_is_refused_naming_them(
    series, s3, shared_slides, tmp_path
):
    """wsidicom would read one of the two, whichever it met first, without a word."""
    with Slide(series, "s") as slide:
        rgb = slide.read(0, 0, 0, 512, 512)
    template = shared_slides / "dicom-openslide-boxes" / "boxes_0.dcm"
    other = write_dicom_pyramid(rgb, 0.499, tmp_path / "other", template, levels=1)
    mixed = tmp_path / "mixed"
    shutil.copytree(series, mixed)
    shutil.copy(other[0], mixed / "other-level-0.dcm")
    uids = sorted(str(pydicom.dcmread(p, stop_before_pixels=True).SeriesInstanceUID)
                  for p in (series / "level-0.dcm", other[0]))  # fmt: skip
    for path in sorted(mixed.glob("*.dcm")):
        s3.put("archive", f"mixed/{path.name}", path)
    stores.configure(s3.storage)
    try:
        for where in (mixed, "s3://archive/mixed/"):
            with pytest.raises(SlideOpenError) as caught:
                Slide(where, "mixed")
            message = str(caught.value)
            assert "the levels of 2 DICOM series" in message and "slide 'mixed'" in message
            assert all(uid in message for uid in uids) and "a folder (or bucket prefix)" in message
    finally:
        stores.configure(None)


def test_dicomweb_frames_at_a_byte_a_second_fail_their_slide_within_the_deadline(series, orthanc):
    url = orthanc.add(sorted(series.glob("*.dcm")))
    proxy = DripProxy(orthanc.url)
    stores.configure(
        {"connect_timeout_s": 1, "read_timeout_s": 2, "request_timeout_s": 3, "retries": 1}
    )
    started = time.monotonic()
    try:
        with (
            pytest.raises(StoreTimeoutError, match="did not answer within its deadlines"),
            Slide(url.replace(orthanc.url, proxy.url), "dripping") as slide,
        ):
            slide.read(0, 0, 0, 512, 512)
        assert time.monotonic() - started < 10
    finally:
        stores.configure(None)
        proxy.stop()


@pytest.mark.workflow
def test_a_cohort_of_dicom_series_runs_on_disk_and_over_dicomweb_alike(series, orthanc, workflow):
    url = orthanc.add(sorted(series.glob("*.dcm")))
    workflow.sheet([("folder", series), ("web", url)])
    first = workflow.run()
    assert jobs_run(first, "embed_tiles") == ["folder", "web"]
    local, _, _ = load_embeddings(workflow.result("folder", "embeddings.zarr"))
    served, _, attrs = load_embeddings(workflow.result("web", "embeddings.zarr"))
    np.testing.assert_array_equal(served, local)
    assert attrs["slide_version"].startswith("DICOM instances") and len(local) > 0
    metrics = json.loads(workflow.result("web", "metrics.json").read_text())
    assert metrics["tiles"] == len(served)
    assert "Nothing to be done" in workflow.run().stderr
