"""Write outputs so that a file or directory either is complete or does not exist.

A killed job must not leave anything that Snakemake, or a user, could take for a result.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; rename it to `path` only if the block succeeds.

    Temporaries left by a job killed with SIGKILL are removed first: Snakemake never runs
    two jobs for one output at once, so any temporary found here is stale.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        _remove(stale)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        _remove(final)
        os.replace(tmp, final)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
