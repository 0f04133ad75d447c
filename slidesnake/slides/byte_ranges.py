"""Byte ranges of a slide file, from local disk or from a store, counted.

The tile decoder asks for one compressed tile's bytes at a time (`read`). From disk that
is a `pread`. From a store each request costs a round trip (20 ms and more), so the loader
first says which tiles it will need (`prefetch`): their ranges are sorted, neighbours
merged (a row of tiles is one range in an SVS), and the merged ranges fetched
concurrently in one call; `read` then finds its bytes held. `RangeFile` is the
seekable file tifffile reads a remote slide's index through, in cached blocks.

Both count bytes and requests, for metrics.json: the figures that say whether reading in
place costs what it should.
"""

from __future__ import annotations

import asyncio
import io
import os
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from fsspec.asyn import sync

from slidesnake.errors import SlideError, SlideReadError
from slidesnake.slides import stores
from slidesnake.slides.range_requests import (
    NoRanges,
    ObjectChanged,
    ObjectVersion,
    Oversized,
    changed_error,
    fetch_range,
    oversized_error,
)
from slidesnake.slides.store_errors import is_transient, read_error, status_of

# Ranges this close are fetched as one: a request costs more than a few KB of gap.
MERGE_GAP = 4096
# No merged range grows past this: a few such ranges keep several connections busy.
MAX_SPAN = 8 * 2**20
# Seconds before the first retry; doubled for each next one.
BACKOFF_S = 0.2
# Index blocks kept per slide: the index of a large slide is a few MB at most.
MAX_BLOCKS = 64
# Runs of fetched ranges held: the one being decoded and the one fetched ahead.
HELD_RUNS = 2


class FileRanges:
    """Byte ranges of a local file, by `pread` (shared offsets are safe across forks)."""

    def __init__(self, path: str | os.PathLike):
        self._fd = os.open(path, os.O_RDONLY)
        self.bytes_read = self.requests = 0

    def read(self, offset: int, size: int) -> bytes:
        self.bytes_read += size
        self.requests += 1
        return os.pread(self._fd, size, offset)

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Nothing to do: the page cache reads ahead."""

    def close(self) -> None:
        os.close(self._fd)


class RemoteRanges:
    """Byte ranges of one version of an object in a store, fetched merged and
    concurrently, with retries of transient failures. The version is the one the store
    named when this was made, before any fork: every process reads that version or
    fails (`range_requests`). Each process makes its own filesystem (an fsspec instance
    and its event loop must not cross a fork) and counts its own requests.

    Fetched ranges are held for the run of cells that asked for them and the next one
    (a worker decodes one run while the next is fetched), and a range already held is
    not fetched again: tiles that share bytes cost one request, not one per tile."""

    def __init__(self, url: str, slide_id: str):
        self.url, self.slide_id = url, slide_id
        self.where = stores.location(url)
        self._pid: int | None = None
        self._fs: tuple[Any, str] | None = None
        self._held: deque[dict[int, memoryview]] = deque(maxlen=HELD_RUNS)
        self.bytes_read = self.requests = 0
        # Asked with the filesystem the reads use: one client per process, not two.
        info = stores.object_info(*self._filesystem(), url, slide_id)
        self.stat = stores.stat_of(info)
        self.version = ObjectVersion.from_info(info)
        self.size = self.version.size

    def _filesystem(self) -> tuple[Any, str]:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._fs = stores.filesystem(self.url, self.slide_id)
            self._held.clear()
        return self._fs

    def read(self, offset: int, size: int) -> memoryview:
        held = self._find(offset, size)
        return held if held is not None else self.fetch([(offset, offset + size)])[0]

    def _find(self, offset: int, size: int) -> memoryview | None:
        for run in reversed(list(self._held)):
            held = run.get(offset)
            if held is not None and len(held) >= size:
                return held[:size]
        return None

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Fetch these (offset, size) ranges now, merged, for the `read`s that follow."""
        run: dict[int, memoryview] = {}
        wanted = []
        for offset, size in sorted({(o, n) for o, n in ranges if n > 0}):
            held = self._find(offset, size)
            if held is not None:
                run[offset] = held
            else:
                wanted.append((offset, offset + size))
        spans = merge_ranges(wanted)
        blobs = self.fetch([(start, end) for start, end, _ in spans])
        for (start, _, parts), blob in zip(spans, blobs, strict=True):
            for offset, end in parts:
                if len(run.get(offset, b"")) < end - offset:
                    run[offset] = blob[offset - start : end - start]
        self._held.append(run)

    def fetch(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each [start, end) range, fetched concurrently; ranges that fail
        for a transient reason are tried again, with backoff."""
        if not ranges:
            return []
        self._check_inside(ranges)
        settings = stores.settings()
        got: dict[int, memoryview] = {}
        pending = list(range(len(ranges)))
        for attempt in range(settings.retries + 1):
            fs, key = self._filesystem()
            self.requests += len(pending)
            blobs = sync(fs.loop, self._gather, fs, key, [ranges[i] for i in pending])
            failures = []
            for i, blob in zip(pending, blobs, strict=True):
                if isinstance(blob, BaseException):
                    failures.append((i, blob))
                else:
                    got[i] = self._whole(memoryview(blob), ranges[i])
                    self.bytes_read += len(blob)
            if not failures:
                return [got[i] for i in range(len(ranges))]
            failure = failures[0][1]
            if attempt == settings.retries or not is_transient(failure):
                raise self._error(failure, attempt + 1)
            pending = [i for i, _ in failures]
            time.sleep(BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    async def _gather(self, fs: Any, key: str, ranges: list[tuple[int, int]]) -> list:
        settings = stores.settings()
        slots = asyncio.Semaphore(settings.concurrency)

        async def one(start: int, end: int) -> bytes:
            async with slots:
                return await fetch_range(fs, key, start, end, self.version, settings.deadlines)

        return await asyncio.gather(*(one(*r) for r in ranges), return_exceptions=True)

    def _error(self, failure: BaseException, tries: int) -> SlideError:
        if isinstance(failure, ObjectChanged):
            return changed_error(self.slide_id, self.where, str(failure))
        if isinstance(failure, Oversized):
            return oversized_error(self.slide_id, self.where, str(failure))
        if isinstance(failure, NoRanges):
            return self._no_ranges(str(failure))
        if status_of(failure) == 416:
            return self._shorter("refused a byte range as past the object's end (HTTP 416)")
        return read_error(failure, self.slide_id, self.where, tries)

    def _check_inside(self, ranges: list[tuple[int, int]]) -> None:
        end = max(r[1] for r in ranges)
        if end > self.size:
            raise self._truncated(end)

    def _whole(self, blob: memoryview, wanted: tuple[int, int]) -> memoryview:
        size = wanted[1] - wanted[0]
        if len(blob) != size:
            raise self._shorter(
                f"answered a request for {size} bytes at byte {wanted[0]} with {len(blob)}"
            )
        return blob

    def _shorter(self, answer: str) -> SlideReadError:
        """A store whose object is shorter than the size it gave: a lie, or an object
        replaced by a shorter one under the same version (no store should allow that)."""
        return SlideReadError(
            self.slide_id,
            self.where,
            f"the server {answer}, though it said the object has {self.size} bytes: the "
            "object is shorter than its store says",
            "compare the object's size in its store with the bytes it holds, and check any "
            "server or proxy in front of it; if the object is cut short, upload it again",
        )

    def _no_ranges(self, answer: str) -> SlideReadError:
        return SlideReadError(
            self.slide_id,
            self.where,
            f"the server answered a byte range request with the whole object ({answer}): "
            "it does not honour Range requests, so every tile would cost the whole slide",
            "serve the slide from a server that answers Range requests (object stores "
            "and most web servers do), or copy it to a local or shared filesystem",
        )

    def _truncated(self, end: int) -> SlideReadError:
        return SlideReadError(
            self.slide_id,
            self.where,
            f"the object has {self.size} bytes but its TIFF index points to byte {end}: "
            "it is truncated (an interrupted upload or copy)",
            "upload the slide again",
        )

    def close(self) -> None:
        self._held.clear()


def merge_ranges(
    ranges: list[tuple[int, int]], gap: int = MERGE_GAP, max_span: int = MAX_SPAN
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Sorted [start, end) ranges as fewer (start, end, parts) spans: neighbours closer
    than `gap` bytes share a span, up to `max_span` bytes long."""
    spans: list[tuple[int, int, list[tuple[int, int]]]] = []
    for start, end in ranges:
        if spans and start - spans[-1][1] <= gap and end - spans[-1][0] <= max_span:
            first, last, parts = spans[-1]
            spans[-1] = (first, max(last, end), [*parts, (start, end)])
        else:
            spans.append((start, end, [(start, end)]))
    return spans


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote object, read in blocks of `block` bytes
    that are kept: tifffile parses a slide's index (header, IFDs, tile tables) through it
    in a handful of requests."""

    def __init__(self, ranges: RemoteRanges, block: int):
        super().__init__()
        self._ranges, self._block = ranges, block
        self._blocks: dict[int, memoryview] = {}
        self._pos = 0
        self.name = ranges.where

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._ranges.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        end = min(self._pos + len(out), self._ranges.size)
        self._fetch_blocks(range(self._pos // self._block, -(-end // self._block)))
        done = 0
        while self._pos + done < end:
            at = self._pos + done
            index, within = divmod(at, self._block)
            block = self._blocks[index]
            n = min(len(block) - within, end - at)
            out[done : done + n] = block[within : within + n]
            done += n
        self._pos += done
        return done

    def _fetch_blocks(self, indices: range) -> None:
        """Fetch the missing blocks of one read together (a tile table spans many)."""
        missing = [i for i in indices if i not in self._blocks]
        while len(self._blocks) + len(missing) > max(MAX_BLOCKS, len(missing)):
            self._blocks.pop(next(iter(self._blocks)))
        size = self._ranges.size
        spans = [(i * self._block, min((i + 1) * self._block, size)) for i in missing]
        for index, block in zip(missing, self._ranges.fetch(spans), strict=True):
            self._blocks[index] = block
