"""Files a cohort names beside its slides (regions, coordinates, heads, encoders,
checkpoints), checked as slides are before anything reads them.

A FIFO blocks its reader for ever and a device such as /dev/zero is read until memory
runs out; a file larger than its format ever needs is refused by its size, before a
parser spends time and memory on it. Side files are identified by their digest: their
size and modification time survive `cp -p` and restores from backup.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

MB = 1 << 20

# The largest file of each kind that is read whole into memory.
MAX_BYTES = {
    "regions": 100 * MB,  # a GeoJSON of ~3 million vertices
    "coordinates": 256 * MB,  # a CSV of ~15 million tiles
    "head": 1024 * MB,
    "samples": 256 * MB,  # a sample sheet of ~1 million slides
}


def side_file_problem(path: str | Path, max_bytes: int | None = None) -> str | None:
    """Why `path` cannot be read as a side file, or None: it must exist, be a regular
    file (after symbolic links) and hold at most `max_bytes`."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return "file not found"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISDIR(status.st_mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(status.st_mode):
        return "is not a regular file (a pipe, socket or device would block or never end)"
    if max_bytes is not None and status.st_size > max_bytes:
        return f"holds {status.st_size / MB:.0f} MB, more than the {max_bytes // MB} MB allowed"
    return None


def read_capped(path: str | Path, max_bytes: int) -> bytes:
    """The file's bytes; OSError if it grew past `max_bytes` since it was checked."""
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(f"more than {max_bytes // MB} MB")
    return data


def file_digest(path: str | Path) -> str:
    """sha256 of a side file, for the params of the rules that read it, or the problem
    of a file that cannot be read (its job then fails with the reason)."""
    problem = side_file_problem(path)
    return problem if problem is not None else cached_sha256(path)


def cached_sha256(path: str | Path) -> str:
    """sha256 of a file, cached by the file's inode, size, modification and change times:
    the change time cannot be set back, so a file replaced by `cp -p` or a restore
    misses the cache."""
    status = os.stat(path)
    key = f"{os.path.realpath(path)}\0{stat_key(status)}"
    return cached_digest(key, lambda: sha256(path))


def stat_key(status: os.stat_result) -> str:
    """What identifies a file's content without reading it, for `cached_digest`."""
    return f"{status.st_ino}\0{status.st_size}\0{status.st_mtime_ns}\0{status.st_ctime_ns}"


def cached_digest(key: str, compute: Callable[[], str]) -> str:
    """`compute()`, cached under $XDG_CACHE_HOME/slidesnake by `key`, which names what it
    reads and identifies its state (`stat_key`)."""
    cached = digest_cache() / hashlib.sha256(key.encode()).hexdigest()
    try:
        return cached.read_text().strip()
    except OSError:
        pass
    value = compute()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        temporary = cached.with_name(f".{cached.name}.{os.getpid()}")
        temporary.write_text(value + "\n")
        os.replace(temporary, cached)
    except OSError:
        pass  # a read-only home costs a hash per use, nothing else
    return value


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MB), b""):
            digest.update(block)
    return digest.hexdigest()


def digest_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "slidesnake" / "sha256"
