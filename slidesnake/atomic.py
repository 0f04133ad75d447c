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
    _remove_stale(final)
    tmp = _temporary(final)
    try:
        yield tmp
        remove_output(final)
        os.replace(tmp, final)
    finally:
        remove_output(tmp)


def remove_output(path: Path) -> None:
    """Remove a file or a directory (a zarr store), if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class OutputSet:
    """Files replaced together: each is written to a temporary sibling, and `commit`
    renames them all only once every one is written, then removes the members not
    written this time (a picture that no longer applies). Until the commit, the old
    files stand as they were."""

    def __init__(self, members: list[Path]) -> None:
        self.members = [Path(member) for member in members]
        self._staged: dict[Path, Path] = {}

    def path(self, final: str | Path) -> Path:
        """Where to write the member `final` now."""
        final = Path(final)
        if final not in self.members:
            raise ValueError(f"{final} is not a member of this output set")
        tmp = _temporary(final)
        self._staged[final] = tmp
        return tmp

    def drop(self, final: str | Path) -> None:
        """Write nothing for `final` this time: the commit removes it."""
        remove_output(self._staged.pop(Path(final)))

    def commit(self) -> None:
        for final in self.members:
            staged = self._staged.get(final)
            if staged is not None and staged.exists():
                os.replace(staged, final)
            else:
                remove_output(final)

    def discard(self) -> None:
        for staged in self._staged.values():
            remove_output(staged)


@contextmanager
def output_set(members: list[Path]) -> Iterator[OutputSet]:
    """An OutputSet committed when the block succeeds, discarded when it fails."""
    for member in members:
        _remove_stale(Path(member))
    outputs = OutputSet(members)
    try:
        yield outputs
        outputs.commit()
    finally:
        outputs.discard()


def _temporary(final: Path) -> Path:
    """Where `final` is written first: a hidden sibling named by this process."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def _remove_stale(final: Path) -> None:
    """Temporaries of `final` that a job killed with SIGKILL left."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        remove_output(stale)
