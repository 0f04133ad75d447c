"""Where slides live: local paths, and URLs of object stores and web servers.

A slide given as `s3://`, `gs://` or `http(s)://` is read in place through fsspec, byte
ranges only (see byte_ranges); a job never downloads a slide whole. This module names
the stores, turns the run's `storage:` section into each filesystem's options, and says
what an object is (size and version) without reading it, for re-runs (`locator` says
it of a slide of any kind).

Credentials come from each store's standard places (environment, profiles, instance
roles) and never from the config, and a URL is only ever shown as `location()` makes it:
no user:password, no query string (a presigned URL's signature is a credential).

One storage configuration serves a whole process: the rule's job sets it (`configure`)
before it opens a slide, and forked loader workers inherit it.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from slidesnake.errors import SlideOpenError
from slidesnake.slides.range_requests import Deadlines, ObjectVersion, fetch_range
from slidesnake.slides.store_errors import open_error

# URL schemes read in place, and the fsspec protocol of each.
PROTOCOLS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
# Formats only OpenSlide reads, and only from a local file (several files, or a layout the
# in-place TIFF reader does not handle).
LOCAL_ONLY = {
    ".mrxs": "MIRAX",
    ".vms": "Hamamatsu VMS",
    ".vmu": "Hamamatsu VMU",
    ".ndpi": "Hamamatsu NDPI",
    ".scn": "Leica SCN",
    ".bif": "Ventana BIF",
    ".svslide": "Sakura",
    ".isyntax": "Philips iSyntax",
    ".czi": "Zeiss CZI",
}
# A DICOMweb series: its server's base URL, study and series instance UIDs (`fullmatch`ed).
DICOMWEB = re.compile(r"(https?://.+?)/studies/([0-9.]+)/series/([0-9.]+)/?")


@dataclass(frozen=True)
class StorageSettings:
    """The `storage:` section: how many requests, how far ahead, how long each may take
    and how large an answer read whole may be, and per-scheme options."""

    concurrency: int = 16
    readahead_tiles: int = 256
    retries: int = 4
    block_kb: int = 64
    connect_timeout_s: float = 10
    read_timeout_s: float = 30
    request_timeout_s: float = 120
    max_answer_mb: int = 64
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, section: Mapping[str, Any] | None) -> StorageSettings:
        section = dict(section or {})
        schemes = {key: section.pop(key) or {} for key in ("s3", "gs", "http") if key in section}
        return cls(**section, options=schemes)

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.connect_timeout_s, self.read_timeout_s, self.request_timeout_s)

    @property
    def stat_timeout_s(self) -> float:
        """A question with no body (HEAD, a listing's first page): connect, then answer."""
        return min(self.request_timeout_s, self.connect_timeout_s + self.read_timeout_s)

    def filesystem_options(self, protocol: str) -> dict[str, Any]:
        """fsspec's keyword arguments for `protocol`, from the per-scheme options, with
        the connect and read deadlines."""
        if protocol == "s3":
            own = dict(self.options.get("s3", {}))
            region = own.pop("region", None)
            timeouts = {"connect_timeout": self.connect_timeout_s}
            timeouts["read_timeout"] = self.read_timeout_s
            client = {"client_kwargs": {"region_name": region}} if region else {}
            return {**own, **client, "config_kwargs": timeouts}
        if protocol == "gcs":
            own = dict(self.options.get("gs", {}))
            return {**own, **({"token": "anon"} if own.pop("anon", False) else {})}
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
        )
        return {**self.options.get("http", {}), "client_kwargs": {"timeout": timeout}}


_settings = StorageSettings()


def configure(section: Mapping[str, Any] | None) -> None:
    """Read slides with the run's `storage:` section from now on, in this process."""
    global _settings
    _settings = StorageSettings.from_mapping(section)


def settings() -> StorageSettings:
    return _settings


def is_url(path: str | Path) -> bool:
    """Whether `path` names a slide read in place (a URL of a store we read)."""
    return isinstance(path, str) and urlsplit(path).scheme.lower() in PROTOCOLS


def carries_credentials(url: str) -> bool:
    """Whether `url` may hold a secret of its own: a user or password, a query (a
    presigned URL's signature, a token), a fragment or a path parameter (`;jsessionid=`).
    A slide's URL needs none of them, and Snakemake writes params down."""
    parts = urlsplit(url)
    return "@" in parts.netloc or any(mark in url for mark in "?#;")


def location(path: str | Path) -> str:
    """`path` as it may be shown and written: a URL without user, password, path
    parameters, query or fragment ('…' marks where something was left out)."""
    if not is_url(path):
        return str(path)
    parts = urlsplit(str(path))
    host = parts.netloc.rpartition("@")[2]
    shown = "/".join(segment.partition(";")[0] for segment in parts.path.split("/"))
    cut = shown != parts.path or any(mark in str(path) for mark in "?#")
    return f"{parts.scheme}://{host}{shown}" + ("…" if cut else "")


def filesystem(url: str, slide_id: str = "") -> tuple[Any, str]:
    """A new filesystem instance for `url` (never fsspec's shared one: an instance must
    not cross a fork) and the path it knows the object by."""
    import fsspec

    for chatty in (
        "aiobotocore",
        "botocore",
    ):  # an INFO line per client: where credentials were found
        logging.getLogger(chatty).setLevel(logging.WARNING)
    protocol = PROTOCOLS[urlsplit(url).scheme.lower()]
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError:
        raise SlideOpenError(
            slide_id,
            location(url),
            f"reading {urlsplit(url).scheme}:// URLs needs fsspec's {protocol} filesystem, "
            "which is not installed",
            "install it where the jobs run: pip install 'slidesnake[gcs]' (gcsfs)",
        ) from None
    fs = cls(skip_instance_cache=True, **_settings.filesystem_options(protocol))
    return fs, (url if protocol == "http" else cls._strip_protocol(url))


def host(path: str | Path) -> str:
    """The store a URL is read from (scheme and host), '' for a local path."""
    if not is_url(path):
        return ""
    parts = urlsplit(str(path))
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def is_dicomweb(path: str | Path) -> bool:
    """Whether `path` is the URL of a DICOMweb series."""
    return is_url(path) and DICOMWEB.fullmatch(str(path)) is not None


def is_dicom_prefix(path: str | Path) -> bool:
    """Whether `path` is a bucket prefix (ending in '/') holding a DICOM series."""
    return (
        is_url(path)
        and urlsplit(str(path)).scheme.lower() in ("s3", "gs", "gcs")
        and str(path).endswith("/")
    )


def dicomweb_parts(url: str) -> tuple[str, str, str]:
    """(server base URL, study UID, series UID) of a DICOMweb series URL."""
    found = DICOMWEB.fullmatch(url)
    if found is None:
        raise ValueError(f"not a DICOMweb series URL: {location(url)}")
    return found.group(1), found.group(2), found.group(3)


def check_format(url: str, slide_id: str) -> None:
    """Fail a URL to a format only OpenSlide reads, saying what to do instead."""
    suffix = Path(urlsplit(url).path).suffix.lower()
    if suffix == ".dcm":
        raise SlideOpenError(
            slide_id,
            location(url),
            "a DICOM file by URL is one instance of a series, not a slide",
            "give the series' DICOMweb URL (.../studies/<UID>/series/<UID>), or a local "
            "folder holding the series",
        )
    if suffix in LOCAL_ONLY:
        raise SlideOpenError(
            slide_id,
            location(url),
            f"{LOCAL_ONLY[suffix]} slides are read by OpenSlide only, from a local file; "
            "slides are read in place only as TIFF (SVS, generic or pyramidal TIFF)",
            "copy the slide (with its companion files) to a local or shared filesystem "
            "and give that path, or convert it to a pyramidal TIFF "
            "(vips tiffsave --tile --pyramid --compression jpeg)",
        )


class SlideStat(NamedTuple):
    """What identifies a slide's bytes without reading them: its size, and its version
    where the store keeps one (ETag, generation, Last-Modified) or its mtime on disk."""

    size: int
    version: str

    def describe(self) -> str:
        return f"{self.size} bytes, {self.version}"


def prefix_stat(url: str, slide_id: str) -> SlideStat:
    """A series under a bucket prefix: its objects' names, sizes and ETags, as one digest."""
    fs, key = filesystem(url, slide_id)
    try:
        objects = fs.ls(key, detail=True, timeout=_settings.request_timeout_s)
    except Exception as err:
        raise open_error(_why(fs, key, err), slide_id, location(url)) from None
    listing = sorted((item["name"], item.get("size") or 0, item.get("ETag")) for item in objects)
    digest = hashlib.sha256(repr(listing).encode()).hexdigest()[:16]
    size = sum(size for _, size, _ in listing)
    return SlideStat(size, f"{len(listing)} objects, sha256 {digest}")


def object_info(fs: Any, key: str, url: str, slide_id: str) -> dict[str, Any]:
    """What the store says of the object `key` of `fs` (the slide at `url`), asked
    within storage.connect_timeout_s + read_timeout_s."""
    try:
        return fs.info(key, timeout=_settings.stat_timeout_s)
    except Exception as err:
        raise open_error(_why(fs, key, err), slide_id, location(url)) from None


def object_stat(fs: Any, key: str, url: str, slide_id: str) -> SlideStat:
    """The size and version of the object `key` of `fs`, the slide at `url`."""
    return stat_of(object_info(fs, key, url, slide_id))


def stat_of(info: dict[str, Any]) -> SlideStat:
    """A SlideStat from what a store said of an object."""
    version = next(
        (
            f"{name} {info[name]}"
            for name in ("ETag", "generation", "VersionId", "LastModified", "Last-Modified")
            if info.get(name)
        ),
        "no version from the store",
    )
    return SlideStat(int(info.get("size") or 0), version)


def _why(fs: Any, key: str, err: Exception) -> BaseException:
    """The real failure behind `err`: fsspec's HTTP filesystem says "not found" for
    any failed HEAD (a 403 too), where a one-byte GET gives the server's status."""
    if not isinstance(err, FileNotFoundError) or "http" not in fs.protocol:
        return err
    from fsspec.asyn import sync

    try:  # bounded as any range read: a 1-byte question must not take an endless body
        sync(fs.loop, fetch_range, fs, key, 0, 1, ObjectVersion(1), _settings.deadlines)
    except Exception as failure:
        return failure
    return err
