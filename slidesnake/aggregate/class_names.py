"""The names a prediction head's classes may take: each becomes a column beside columns
of our own (x, y in predictions.parquet; method in slide_prediction.tsv; slide_id in the
cohort's slide_predictions.tsv), so a class named like one would overwrite it."""

from __future__ import annotations

from collections.abc import Sequence

from slidesnake.errors import ConfigError

RESERVED = ("slide_id", "method", "x", "y")


def check_class_names(classes: Sequence[str] | None) -> None:
    """ConfigError for names that are not strings, repeat, or are a table's own column."""
    if classes is None:
        return
    problems = [f"{name!r} is not a string" for name in classes if not isinstance(name, str)]
    repeated = sorted({name for name in classes if list(classes).count(name) > 1}, key=str)
    problems += [f"{name!r} appears more than once" for name in repeated]
    problems += [
        f"{name!r} is a column of the prediction tables" for name in classes if name in RESERVED
    ]
    problems += [
        f"{name!r} holds a control character (a newline, a tab)"
        for name in classes
        if isinstance(name, str) and any(ord(c) < 32 or ord(c) == 127 for c in name)
    ]
    if problems:
        raise ConfigError(
            f"head.classes: {'; '.join(problems)}; give each class its own name, none of "
            f"{list(RESERVED)}"
        )
