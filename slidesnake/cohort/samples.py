"""The sample sheet: which slides make the cohort, checked before any job starts.

A bad sheet is cheaper to fix before a thousand jobs are queued than after, so every
problem found is reported at once, each with the row it comes from.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from slidesnake.errors import SampleSheetError

# Slide ids become directory names under results/: letters, digits, '.', '_', '-' only,
# not starting with '.', and no '..'.
SAFE_ID = re.compile(r"^(?!.*\.\.)[A-Za-z0-9_-][A-Za-z0-9._-]*$")


def read_sample_sheet(path: str | Path, base_dir: str | Path = ".") -> pd.DataFrame:
    """Read a TSV with `slide_id`, `path` and optional `mpp`, indexed by slide id.

    Relative slide paths are taken from `base_dir` (Snakemake's working directory).
    """
    try:
        sheet = pd.read_csv(path, sep="\t", dtype={"slide_id": str, "path": str}, comment="#")
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise SampleSheetError(f"sample sheet {path}: cannot be read ({err})") from None
    missing_columns = {"slide_id", "path"} - set(sheet.columns)
    if missing_columns:
        raise SampleSheetError(
            f"sample sheet {path}: missing column(s) {sorted(missing_columns)}; "
            "it needs tab-separated 'slide_id' and 'path' (and optionally 'mpp')"
        )
    if "mpp" not in sheet.columns:
        sheet["mpp"] = float("nan")
    problems = _problems(sheet, Path(base_dir))
    if problems:
        raise SampleSheetError(f"sample sheet {path}:\n  " + "\n  ".join(problems))
    return sheet.set_index("slide_id", drop=False)


def _problems(sheet: pd.DataFrame, base_dir: Path) -> list[str]:
    problems = []
    for row, record in enumerate(sheet.itertuples(index=False), start=2):
        slide_id, path = record.slide_id, record.path
        if not isinstance(slide_id, str) or not SAFE_ID.match(slide_id):
            problems.append(
                f"line {row}: slide_id {slide_id!r} is not a safe file name "
                "(use letters, digits, '.', '_', '-'; no spaces, '/' or '..')"
            )
        if not isinstance(path, str) or not path.strip():
            problems.append(f"line {row}: slide '{slide_id}' has no path")
        elif not (base_dir / path).exists():
            problems.append(f"line {row}: slide '{slide_id}': file not found: {path}")
    duplicated = sheet["slide_id"][sheet["slide_id"].duplicated()].unique()
    problems += [f"slide_id '{d}' appears more than once" for d in duplicated]
    return problems
