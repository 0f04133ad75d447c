"""The sample sheet: which slides make the cohort, checked before any job starts.

A bad sheet is cheaper to fix before a thousand jobs are queued than after, so every
problem found is reported at once, each with the row it comes from. Every cell is read as
the text it is: pandas would turn an id 'NA' into a missing value and cut a path at '#'.
A slide file that is missing is not a problem of the sheet: that slide fails its own jobs
and the others run.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pandas as pd

from slidesnake.errors import SampleSheetError
from slidesnake.side_files import MAX_BYTES, side_file_problem
from slidesnake.slides.mpp import PLAUSIBLE_MPP
from slidesnake.slides.stores import carries_credentials, is_url, location

# Slide ids become directory names under results/slides/: letters, digits, '.', '_', '-',
# starting with a letter, digit or '_' (not an option, not hidden), no '..', and short
# enough for any file system once a job's temporary suffix is added. Always `fullmatch`ed:
# a `$` would let a final newline through.
SAFE_ID = re.compile(r"(?!.*\.\.)[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
# The workflow's `slide_id` wildcard: the same characters, as a pattern whose cost does not
# grow with the cohort (an alternation of every id made each match O(slides)).
SLIDE_ID_WILDCARD = r"[A-Za-z0-9_][A-Za-z0-9._-]*"


def read_sample_sheet(path: str | Path, base_dir: str | Path = ".") -> pd.DataFrame:
    """Read a TSV with `slide_id`, `path`, optional `mpp`, `roi` (a GeoJSON of regions to
    tile) and `coords` (another tool's tile coordinates), indexed by slide id.

    Relative slide paths are taken from `base_dir` (Snakemake's working directory). Lines
    whose first cell starts with '#' are comments. The sheet is checked as the files it
    names are: a FIFO would hang the run at DAG time, /dev/zero would fill its memory.
    """
    problem = side_file_problem(path, MAX_BYTES["samples"])
    if problem is not None:
        raise SampleSheetError(
            f"sample sheet {path}: {problem}; give a tab-separated file (samples: in the config)"
        )
    try:
        sheet = pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False, na_filter=False)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise SampleSheetError(f"sample sheet {path}: cannot be read ({err})") from None
    missing_columns = {"slide_id", "path"} - set(sheet.columns)
    if missing_columns:
        raise SampleSheetError(
            f"sample sheet {path}: missing column(s) {sorted(missing_columns)}; "
            "it needs tab-separated 'slide_id' and 'path' (and optionally 'mpp')"
        )
    sheet = sheet[~sheet["slide_id"].str.startswith("#")]
    for optional in ("mpp", "roi", "coords"):
        if optional not in sheet.columns:
            sheet = sheet.assign(**{optional: ""})
    problems = _problems(sheet, Path(base_dir))
    if problems:
        raise SampleSheetError(f"sample sheet {path}:\n  " + "\n  ".join(problems))
    sheet = sheet.assign(mpp=[float(mpp) if mpp.strip() else math.nan for mpp in sheet["mpp"]])
    return sheet.set_index("slide_id", drop=False)


def sheet_warnings(sheet: pd.DataFrame, base_dir: str | Path = ".") -> list[str]:
    """What does not stop the cohort but deserves a line: missing files, shared files."""
    warnings = [
        f"slide '{slide_id}': file not found: {path}; its jobs will fail, the others run"
        for slide_id, path in zip(sheet["slide_id"], sheet["path"], strict=True)
        if not is_url(path) and not (Path(base_dir) / path).exists()
    ]
    resolved = pd.Series(
        [location(p) if is_url(p) else os.path.realpath(Path(base_dir) / p) for p in sheet["path"]]
    )
    for shared in resolved[resolved.duplicated()].unique():
        ids = sheet["slide_id"][(resolved == shared).to_numpy()].tolist()
        warnings.append(f"slides {ids} are the same file {shared}")
    return warnings


def _problems(sheet: pd.DataFrame, base_dir: Path) -> list[str]:
    problems = []
    for row, record in enumerate(sheet.itertuples(index=False), start=2):
        slide_id = record.slide_id
        if not SAFE_ID.fullmatch(slide_id):
            problems.append(
                f"line {row}: slide_id {slide_id!r} is not a portable file name (use at "
                "most 128 letters, digits, '.', '_', '-', starting with a letter, digit "
                "or '_'; no spaces, '/' or '..')"
            )
        problems += _path_problems(row, slide_id, record, base_dir)
        problems += _mpp_problems(row, slide_id, record.mpp)
    duplicated = sheet["slide_id"][sheet["slide_id"].duplicated()].unique()
    problems += [f"slide_id '{d}' appears more than once" for d in duplicated]
    return problems


def _path_problems(row: int, slide_id: str, record, base_dir: Path) -> list[str]:
    """The slide and its side files must be regular files (a FIFO blocks its job for
    ever, a device is read for ever); missing ones fail their own slide's jobs."""
    if not record.path.strip():
        return [f"line {row}: slide '{slide_id}' has no path"]
    problems = []
    for column in ("path", "roi", "coords"):
        path = getattr(record, column).strip()
        if column == "path" and is_url(path):
            if carries_credentials(path):  # Snakemake records each job's params on disk
                problems.append(
                    f"line {row}: slide '{slide_id}': the URL may carry credentials "
                    "(user:password@, a signed ?query, a #fragment or a ;parameter), which "
                    "the run would record in .snakemake/; give them the store's usual way "
                    "(environment, profile, instance role) and the plain URL here"
                )
            continue  # read in place: what the store says is checked once per run
        if column == "path" and (base_dir / path).is_dir():
            if not any((base_dir / path).glob("*.dcm")):
                problems.append(
                    f"line {row}: slide '{slide_id}': {path} is a directory without DICOM "
                    "(.dcm) files; give the slide's file, or a folder holding one DICOM series"
                )
            continue
        problem = side_file_problem(base_dir / path) if path else None
        if problem is not None and problem != "file not found":
            what = "" if column == "path" else f"{column} "
            fix = "the slide's file" if column == "path" else f"a {column} file"
            problems.append(f"line {row}: slide '{slide_id}': {what}{path} {problem}; give {fix}")
    return problems


def _mpp_problems(row: int, slide_id: str, mpp: str) -> list[str]:
    if not mpp.strip():
        return []
    low, high = PLAUSIBLE_MPP
    try:
        value = float(mpp)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        return [
            f"line {row}: slide '{slide_id}': mpp {mpp!r} is not a number of microns per "
            f"pixel between {low} and {high}; leave it empty to read it from the slide"
        ]
    return []
