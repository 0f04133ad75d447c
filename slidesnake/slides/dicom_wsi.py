"""DICOM whole-slide images through wsidicom: a series in a local folder, or a series
on a DICOMweb server (a hospital archive, Orthanc, Google's Healthcare API) by its URL.

OpenSlide reads a local DICOM file (and finds the rest of its series beside it); this path
is for what it cannot: a series served over DICOMweb, read frame by frame in place, and
transfer syntaxes it refuses (JPEG-LS, HTJ2K where imagecodecs decodes them). The sheet
names a series by its folder, by a bucket prefix ending in '/' (`s3://bucket/series/`),
or by its DICOMweb URL:
`https://host/dicom-web/studies/<StudyInstanceUID>/series/<SeriesInstanceUID>`.

A series' identity, for re-runs, is its SOP Instance UIDs: one search request.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slidesnake.errors import SlideError, SlideOpenError, SlideReadError
from slidesnake.slides import stores
from slidesnake.slides.range_requests import Oversized, Unanswered
from slidesnake.slides.store_errors import open_error, silent_error
from slidesnake.slides.web_session import bounded_session

FIX_SERIES = (
    "give a folder holding one DICOM whole-slide series, or the DICOMweb URL of a series "
    "(.../studies/<study UID>/series/<series UID>)"
)


def is_dicom_folder(path: str | Path) -> bool:
    """A local folder given as a slide: a DICOM series, one instance per file."""
    return not stores.is_url(path) and Path(path).is_dir()


@dataclass
class DicomSeries:
    """What `Slide` needs of a DICOM series: OpenSlide-style properties and levels, and
    RGB reads of a level."""

    properties: dict[str, str]
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    wsi: Any  # wsidicom.WsiDicom
    scales: tuple[int, ...]  # wsidicom's level of each of ours

    def read(self, level: int, x: int, y: int, width: int, height: int) -> np.ndarray:
        """RGB uint8 of `level` from its pixel (x, y); white outside the image."""
        w, h = self.level_dimensions[level]
        out = np.full((height, width, 3), 255, np.uint8)
        left, top = max(x, 0), max(y, 0)
        right, bottom = min(x + width, w), min(y + height, h)
        if right > left and bottom > top:
            region = self.wsi.read_region(
                (left, top), self.scales[level], (right - left, bottom - top)
            )
            out[top - y : bottom - y, left - x : right - x] = np.asarray(region.convert("RGB"))
        return out

    def close(self) -> None:
        self.wsi.close()


def open_series(path: str | Path, slide_id: str) -> DicomSeries:
    """Open the DICOM series at `path` (a folder, a bucket prefix or a DICOMweb series
    URL); a folder or prefix must hold exactly one series."""
    from wsidicom import WsiDicom
    from wsidicom.file import WsiDicomFileSource

    where = stores.location(path)
    try:
        if is_dicom_folder(path) or stores.is_dicom_prefix(path):
            source = WsiDicomFileSource.open(
                Path(path) if is_dicom_folder(path) else _bucket_path(str(path))
            )
            _one_series(source, slide_id, where)
            wsi = WsiDicom(source, True)
        else:
            base, study, series = stores.dicomweb_parts(str(path))
            with warnings.catch_warnings():  # an ICC profile left on the server, unread
                warnings.filterwarnings("ignore", "No bulk data URI handler")
                logging.getLogger("pydicom").setLevel(logging.ERROR)
                wsi = WsiDicom.open_web(_client(base), study, series)
    except SlideOpenError:
        raise
    except Exception as err:
        raise _open_failure(err, slide_id, where) from None
    levels = list(wsi.levels)
    w0, h0 = levels[0].size.width, levels[0].size.height
    dims = tuple((lv.size.width, lv.size.height) for lv in levels)
    mpp = wsi.mpp
    properties = {
        "openslide.vendor": "dicom",
        "openslide.mpp-x": str(mpp.width),
        "openslide.mpp-y": str(mpp.height),
    }
    downsamples = tuple((w0 / w + h0 / h) / 2 for w, h in dims)
    return DicomSeries(properties, dims, downsamples, wsi, tuple(lv.level for lv in levels))


def _one_series(source: Any, slide_id: str, where: str) -> None:
    """A folder or prefix holding the levels of two series would be read as one of them,
    whichever wsidicom met first: refuse it, naming the series found."""
    from wsidicom.metadata import ImageType

    found = sorted(
        {
            str(r.uids.slide.series_instance)
            for r in source.readers
            if r.image_type == ImageType.VOLUME
        }
    )
    if len(found) > 1:
        source.close()
        raise SlideOpenError(
            slide_id,
            where,
            f"it holds the levels of {len(found)} DICOM series ({', '.join(found)}), and "
            "a slide is one series",
            "give each series a folder (or bucket prefix) of its own and a row of its own "
            "in the sample sheet, or give the series' DICOMweb URL",
        )


def series_stat(url: str, slide_id: str) -> stores.SlideStat:
    """A DICOMweb series' instances, as its identity: a changed instance changes it."""
    base, study, series = stores.dicomweb_parts(url)
    try:
        answer = _session().get(
            f"{base}/studies/{study}/series/{series}/instances",
            headers={"Accept": "application/dicom+json"},
        )
        if answer.status_code == 204 or (answer.ok and not answer.json()):
            raise FileNotFoundError(url)
        answer.raise_for_status()
    except Exception as err:
        where = stores.location(url)
        raise (
            bound_failure(err, slide_id, where) or open_error(_with_status(err), slide_id, where)
        ) from None
    uids = sorted(item["00080018"]["Value"][0] for item in answer.json())
    digest = hashlib.sha256("\n".join(uids).encode()).hexdigest()[:16]
    return stores.SlideStat(len(uids), f"DICOM instances sha256 {digest}")


def _bucket_path(url: str) -> Any:
    """The prefix as a universal_pathlib path, with the run's storage options."""
    from upath import UPath

    protocol = stores.PROTOCOLS[url.partition("://")[0].lower()]
    return UPath(url, **stores.settings().filesystem_options(protocol))


def _client(base: str) -> Any:
    """wsidicom's client over a bounded session, retrying as range reads do
    (storage.retries, from 0.2 s): dicomweb-client's own retries wait 1, 2, 4, 8 s after
    any error, a minute per thread for a server that does not answer."""
    from dicomweb_client import DICOMwebClient
    from wsidicom import WsiDicomWebClient

    client = DICOMwebClient(base, session=_session())
    attempts = stores.settings().retries + 1
    client.set_http_retry_params(max_attempts=attempts, wait_exponential_multiplier=200)
    return WsiDicomWebClient(client)


def _session() -> Any:
    """Requests bounded as every read of a store is (storage.*_timeout_s, max_answer_mb)."""
    settings = stores.settings()
    return bounded_session(settings.deadlines, settings.max_answer_mb << 20)


def _with_status(err: BaseException) -> BaseException:
    """requests' HTTPError carries its status on its response; expose it as `status`."""
    response = getattr(err, "response", None)
    if response is not None and getattr(response, "status_code", None):
        err.status = response.status_code  # type: ignore[attr-defined]
    return err


def _open_failure(err: Exception, slide_id: str, where: str) -> SlideError:
    from wsidicom.errors import WsiDicomNotFoundError

    bounded = bound_failure(err, slide_id, where)
    if bounded is not None:
        return bounded
    if isinstance(err, WsiDicomNotFoundError):
        return SlideOpenError(
            slide_id, where, f"no DICOM whole-slide series there ({err})", FIX_SERIES
        )
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status is not None:
        return open_error(_with_status(err), slide_id, where)
    return SlideOpenError(
        slide_id,
        where,
        f"wsidicom cannot open the series ({type(err).__name__})",
        "check that it is a VL Whole Slide Microscopy series, or export it again",
    )


def bound_failure(err: BaseException, slide_id: str, where: str) -> SlideError | None:
    """The slide's error for an answer past its bounds (in time or size), else None."""
    import requests

    if isinstance(err, Oversized):
        return SlideReadError(
            slide_id,
            where,
            f"the DICOMweb server sent {err} (storage.max_answer_mb)",
            "check the server; raise storage.max_answer_mb if its answers are rightly that large",
        )
    if isinstance(err, Unanswered | requests.Timeout | TimeoutError):
        return silent_error(err, slide_id, where)
    return None
