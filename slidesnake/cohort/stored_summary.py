"""The cohort summary of a run whose outputs live in storage (Snakemake's
--default-storage-provider), not on a shared disk.

Snakemake moves the inputs and outputs of jobs; the summary is written by the workflow's
handlers, outside any job, from what this and every earlier run left. So the handler
lists the storage, fetches the files the summary reads into a scratch folder (each with
its storage time: a log counts as this run's by its time), writes the summary there and
stores its files back, the slide list last, as on disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from slidesnake.aggregate.cohort_features import SLIDE_FEATURES, SLIDE_PREDICTION
from slidesnake.cohort.gallery import EMBEDDING_MAP, QC_PICTURES
from slidesnake.cohort.summary import COHORT_FILES, COHORT_SLIDES
from slidesnake.errors import ConfigError

# The per-slide files the summary reads; of an embeddings.zarr, only its metadata.
SUMMARY_READS = frozenset(
    {"metrics.json", "tiles.parquet", *QC_PICTURES, EMBEDDING_MAP, "heatmaps.png",
     SLIDE_FEATURES, SLIDE_PREDICTION, "embeddings.zarr/zarr.json"}
)  # fmt: skip
SLIDE_FOLDERS = ("results/slides", "logs/slides")


class StorageNotListable(ConfigError):
    """The storage provider gives no way to list what earlier runs stored."""


@contextmanager
def stored_cohort(provider: Any, prefix: str) -> Iterator[Path]:
    """A scratch folder holding what the summary reads of the cohort in storage under
    `prefix` (results/, logs/), whose cohort files are stored back on a clean exit."""
    with tempfile.TemporaryDirectory(prefix="slidesnake-summary-") as scratch:
        root = Path(scratch)
        for folder in SLIDE_FOLDERS:
            for key, mtime, fetch in _listing(provider, f"{prefix}/{folder}"):
                if _summary_reads(key):
                    path = root / folder / key
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fetch(path)
                    os.utime(path, (mtime, mtime))
        _remove(provider, f"{prefix}/results/{COHORT_SLIDES}")  # until the files are in
        yield root
        for name in (*COHORT_FILES, COHORT_SLIDES):
            if (root / "results" / name).is_file():
                _store(provider, f"{prefix}/results/{name}", root / "results" / name)


def _summary_reads(key: str) -> bool:
    """`key` (below a slide folder: <slide>/[<model>/]<name>) is read by the summary."""
    parts = PurePosixPath(key).parts
    if parts[-1].endswith(".log"):
        return True
    return any("/".join(parts[-n:]) in SUMMARY_READS for n in (1, 2) if len(parts) > n)


def _listing(provider: Any, query: str) -> Iterator[tuple[str, float, Callable[[Path], None]]]:
    """Each object below `query`: its key relative to it, its time and how to fetch it.
    Snakemake's storage interface has no listing, so this asks the S3 plugin's own."""
    folder = provider.object(query)
    if not hasattr(folder, "get_subkeys"):
        raise StorageNotListable(
            f"the cohort summary lists the outputs in storage, and storage provider "
            f"{type(provider).__module__} cannot list them. Fix: keep the outputs in S3 "
            "(--default-storage-provider s3), or on a shared disk"
        )
    start = len(folder.s3obj().key) + 1
    for item in folder.get_subkeys():
        yield item.key[start:], item.last_modified.timestamp(), _fetcher(item)


def _fetcher(item: Any) -> Callable[[Path], None]:
    return lambda path: item.Object().download_file(str(path))


def _store(provider: Any, query: str, path: Path) -> None:
    stored = provider.object(query)
    local = stored.local_path()
    local.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, local)
    stored.store_object()
    local.unlink()


def _remove(provider: Any, query: str) -> None:
    stored = provider.object(query)
    if stored.exists():
        stored.remove()
