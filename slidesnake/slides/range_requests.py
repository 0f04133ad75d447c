"""One byte range of one version of an object in a store: one request, bounded in time
and in size, that never mixes versions.

A store is a server we do not control. So each request here carries the version of the
object the job identified when it opened the slide (S3 `VersionId` or `If-Match`, HTTP
`If-Match` or `If-Unmodified-Since`) and checks the version the answer names; it has a
deadline for connecting, for each silence and for the whole answer; and it reads no more
body than the range asked for, with no content or transfer coding that could inflate it.
fsspec's own `cat_ranges` reads whatever body comes, so the requests are made here, on
the filesystem's own session and event loop.

S3 and HTTP(S) are read this way. gs:// goes through gcsfs, pinned to the object's
generation, within the same deadline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from slidesnake.errors import SlideReadError
from slidesnake.slides.store_errors import status_of


@dataclass(frozen=True)
class ObjectVersion:
    """What the store said the object is when the job first asked: its size and the
    marks that say which version it is. Every range read is pinned to it."""

    size: int
    etag: str | None = None
    last_modified: str | None = None
    version_id: str | None = None  # S3 VersionId, GCS generation

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> ObjectVersion:
        """From an fsspec `info()` answer (S3, GCS or HTTP)."""
        etag = info.get("ETag") or info.get("etag")
        modified = info.get("LastModified") or info.get("Last-Modified") or info.get("updated")
        version = info.get("VersionId") or info.get("generation")
        return cls(
            int(info.get("size") or 0),
            str(etag) if etag else None,
            str(modified) if modified else None,
            str(version) if version else None,
        )


@dataclass(frozen=True)
class Deadlines:
    """storage.connect_timeout_s, read_timeout_s (the longest silence) and
    request_timeout_s (a whole answer, body included)."""

    connect_s: float
    read_s: float
    request_s: float


class ObjectChanged(Exception):
    """The object is no longer the version the job opened."""


class Oversized(Exception):
    """The server sent more, or other, than the range asked for."""


class NoRanges(Exception):
    """The server answers a range request with the whole object."""


class Unanswered(TimeoutError):
    """No whole answer within the deadline."""


async def fetch_range(
    fs: Any, key: str, start: int, end: int, pinned: ObjectVersion, deadlines: Deadlines
) -> bytes:
    """Bytes [start, end) of the version `pinned` of object `key` of `fs`."""
    try:
        return await asyncio.wait_for(
            _fetch(fs, key, start, end, pinned, deadlines), deadlines.request_s
        )
    except TimeoutError as err:
        if type(err) is not TimeoutError:  # a connect or read deadline, said by the client
            raise
        raise Unanswered(f"no whole answer within {deadlines.request_s:g} s") from None


async def _fetch(fs, key, start, end, pinned, deadlines) -> bytes:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("s3", "s3a"):
        return await _s3_range(fs, key, start, end, pinned)
    if protocol in ("http", "https"):
        return await _http_range(fs, key, start, end, pinned, deadlines)
    return await _generic_range(fs, key, start, end, pinned)


async def _http_range(fs, url, start, end, pinned: ObjectVersion, deadlines) -> bytes:
    import aiohttp

    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    if pinned.etag and not pinned.etag.startswith("W/"):
        headers["If-Match"] = pinned.etag
    elif pinned.last_modified:
        headers["If-Unmodified-Since"] = pinned.last_modified
    timeout = aiohttp.ClientTimeout(sock_connect=deadlines.connect_s, sock_read=deadlines.read_s)
    session = await fs.set_session()
    async with session.get(
        fs.encode_url(url), headers=headers, timeout=timeout, auto_decompress=False
    ) as answer:
        if answer.status == 412:
            raise ObjectChanged("the server says it no longer matches (HTTP 412)")
        answer.raise_for_status()
        if answer.status != 206:
            raise NoRanges(f"HTTP {answer.status} with the whole object")
        _check_version(answer.headers.get("ETag"), answer.headers.get("Last-Modified"), pinned)
        _check_codings(answer.headers)
        _check_length(answer.headers.get("Content-Length"), end - start)
        return await _bounded(answer.content.read, end - start)


async def _s3_range(fs, key, start, end, pinned: ObjectVersion) -> bytes:
    bucket, name, _ = fs.split_path(key)
    asked: dict[str, Any] = {"Bucket": bucket, "Key": name, "Range": f"bytes={start}-{end - 1}"}
    if pinned.version_id:
        asked["VersionId"] = pinned.version_id
    elif pinned.etag:
        asked["IfMatch"] = pinned.etag
    await fs.set_session()
    client = await fs.get_s3(bucket)
    try:
        answer = await client.get_object(**asked)
    except Exception as err:
        if status_of(err) == 412:
            raise ObjectChanged("the store says it no longer matches (HTTP 412)") from None
        raise
    body = answer["Body"]
    try:
        if not pinned.version_id:
            _check_version(answer.get("ETag"), None, pinned)
        _check_length(answer.get("ContentLength"), end - start)
        return await _bounded(body.read, end - start)
    finally:
        body.close()


async def _generic_range(fs, key, start, end, pinned: ObjectVersion) -> bytes:
    """gcsfs: the object's generation pins the read (gcsfs reads `key#generation`)."""
    if pinned.version_id and getattr(fs, "version_aware", False):
        key = f"{key}#{pinned.version_id}"
    data = await fs._cat_file(key, start=start, end=end)
    _check_length(len(data), end - start)
    return data


def _check_version(etag: str | None, modified: str | None, pinned: ObjectVersion) -> None:
    """The answer names the version it came from: it must be the pinned one."""
    if etag and pinned.etag and _bare(etag) != _bare(pinned.etag):
        raise ObjectChanged(f"its ETag is now {etag}, not {pinned.etag}")
    if modified and pinned.last_modified and not pinned.etag and modified != pinned.last_modified:
        raise ObjectChanged(f"it was modified at {modified}, not {pinned.last_modified}")


def _bare(etag: str) -> str:
    return etag.removeprefix("W/").strip('"')


def _check_codings(headers: Any) -> None:
    """A byte range is the object's bytes: a content or transfer coding (gzip, deflate)
    would make the body other bytes, and inflating one costs what the sender chooses."""
    coding = headers.get("Content-Encoding", "identity").strip().lower()
    transfer = headers.get("Transfer-Encoding", "chunked").strip().lower()
    if coding not in ("", "identity") or transfer not in ("", "chunked", "identity"):
        raise Oversized(f"the answer is encoded ({coding or transfer}); ranges must be raw bytes")


def _check_length(declared: Any, wanted: int) -> None:
    if declared is not None and int(declared) > wanted:
        raise Oversized(f"{int(declared)} bytes declared for a range of {wanted}")


async def _bounded(read: Any, size: int) -> bytes:
    """At most `size` bytes from `read(n)`; Oversized if the body goes on."""
    body = bytearray()
    while len(body) <= size:
        chunk = await read(size + 1 - len(body))
        if not chunk:
            break
        body += chunk
    if len(body) > size:
        raise Oversized(f"more than the {size} bytes asked for")
    return bytes(body)


def changed_error(slide_id: str, where: str, why: str) -> SlideReadError:
    return SlideReadError(
        slide_id,
        where,
        f"the object changed while it was read ({why}); nothing of it was kept",
        "the next run reads the new version from its tissue mask on; if it keeps "
        "changing, read it once it is no longer being written",
    )


def oversized_error(slide_id: str, where: str, why: str) -> SlideReadError:
    return SlideReadError(
        slide_id,
        where,
        f"the server did not answer a byte range with that range's bytes ({why})",
        "serve the slide from a store or web server that answers Range requests with the "
        "raw bytes asked for, or copy it to a local or shared filesystem",
    )
