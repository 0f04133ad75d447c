"""The one check between a network's output and a file: every value finite.

A NaN weight, an fp16 overflow or a server's bad answer would otherwise become a slide
marked done with features, predictions or a heatmap that mean nothing.
"""

from __future__ import annotations

import numpy as np

from slidesnake.errors import NonFiniteError


def require_finite(values: np.ndarray, what: str, fix: str) -> None:
    """NonFiniteError naming `what` and how many values are NaN or infinite, if any is."""
    finite = np.isfinite(values)
    if finite.all():
        return
    bad = values.size - int(np.count_nonzero(finite))
    rows = f" in {int((~finite).reshape(len(values), -1).any(axis=1).sum())} rows" if (
        values.ndim > 1) else ""  # fmt: skip
    raise NonFiniteError(
        f"{what} hold {bad} NaN or infinite values{rows}; nothing was written. Fix: {fix}"
    )
