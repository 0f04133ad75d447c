"""Where a slide lives: what a sample sheet's path names, and what identifies its bytes.

A path is one of five kinds: a local file (opened by OpenSlide), a TIFF in a store read
in place (s3://, gs://, http(s)://), or a DICOM series in a local folder, under a bucket
prefix (a URL ending in '/') or on a DICOMweb server (.../studies/<UID>/series/<UID>).
Everything that must tell them apart asks here: the slide's opener, the job's modules,
the identity (size and version) that re-runs a slide whose bytes changed, and the
records that say which slide a store holds.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slidesnake.errors import SlideError, SlideOpenError, StoreTimeoutError
from slidesnake.slides import stores
from slidesnake.slides.dicom_wsi import is_dicom_folder, series_stat
from slidesnake.slides.stores import SlideStat


class SlideKind(enum.Enum):
    FILE = "a local file"
    IN_PLACE_TIFF = "a TIFF in a store"
    DICOM_FOLDER = "a DICOM series in a folder"
    DICOM_PREFIX = "a DICOM series under a bucket prefix"
    DICOMWEB = "a DICOMweb series"

    @property
    def dicom(self) -> bool:
        return self in (SlideKind.DICOM_FOLDER, SlideKind.DICOM_PREFIX, SlideKind.DICOMWEB)

    @property
    def local(self) -> bool:
        return self in (SlideKind.FILE, SlideKind.DICOM_FOLDER)


def slide_kind(path: str | Path) -> SlideKind:
    """What `path` names."""
    if stores.is_dicomweb(path):
        return SlideKind.DICOMWEB
    if stores.is_dicom_prefix(path):
        return SlideKind.DICOM_PREFIX
    if stores.is_url(path):
        return SlideKind.IN_PLACE_TIFF
    return SlideKind.DICOM_FOLDER if is_dicom_folder(path) else SlideKind.FILE


def shown(path: str | Path) -> str | Path:
    """`path` as it may be shown and written: a URL without its credentials."""
    return stores.location(path) if stores.is_url(path) else Path(path)


def stat_slide(path: str | Path, slide_id: str) -> SlideStat:
    """The slide's size and version; a missing or forbidden one fails its slide. A DICOM
    series (a folder, or on DICOMweb) is identified by its instances."""
    kind = slide_kind(path)
    if kind is SlideKind.DICOMWEB:
        return series_stat(str(path), slide_id)
    if kind is SlideKind.DICOM_FOLDER:
        return _folder_stat(Path(path))
    if kind is SlideKind.DICOM_PREFIX:
        return stores.prefix_stat(str(path), slide_id)
    if kind is SlideKind.FILE:
        status = os.stat(path)
        return SlideStat(status.st_size, f"mtime {status.st_mtime_ns} ns")
    fs, key = stores.filesystem(str(path), slide_id)
    return stores.object_stat(fs, key, str(path), slide_id)


def _folder_stat(folder: Path) -> SlideStat:
    """A series folder: the names, sizes and mtimes of its files, as one digest."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    listing = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    digest = hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
    return SlideStat(sum(size for _, size, _ in listing), f"{len(files)} files, sha256 {digest}")


def stat_slides(paths: Iterable[str]) -> dict[str, str]:
    """Each URL's `SlideStat.describe()`, or why it has none: one request per slide, up
    to `storage.concurrency` at once (10,000 slides at 20 ms each take about 12 s). A
    host that lets one question go unanswered past its deadline is not asked again: its
    other slides fail with the same reason, and the run goes on without waiting."""
    urls = sorted({p for p in paths if stores.is_url(p)})
    if not urls:
        return {}
    by_protocol: dict[str, Any] = {}
    for url in urls:
        protocol = stores.PROTOCOLS[urlsplit(url).scheme.lower()]
        if protocol not in by_protocol:
            by_protocol[protocol] = _filesystem_or_error(url)
    silent: dict[str, str] = {}

    def describe(url: str) -> str:
        if stores.host(url) in silent:
            return silent[stores.host(url)]
        fs = by_protocol[stores.PROTOCOLS[urlsplit(url).scheme.lower()]]
        try:
            if slide_kind(url).dicom:
                return stat_slide(url, "").describe()
            if isinstance(fs, SlideOpenError):
                raise fs
            key = url if "http" in fs.protocol else fs._strip_protocol(url)
            return stores.object_stat(fs, key, url, "").describe()
        except StoreTimeoutError as err:
            silent[stores.host(url)] = f"unreadable ({err.problem})"
            return silent[stores.host(url)]
        except SlideError as err:
            return f"unreadable ({err.problem})"

    with ThreadPoolExecutor(stores.settings().concurrency) as pool:
        return dict(zip(urls, pool.map(describe, urls), strict=True))


def _filesystem_or_error(url: str) -> Any:
    try:
        return stores.filesystem(url)[0]
    except SlideOpenError as err:
        return err
