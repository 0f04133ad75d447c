"""Running one stage as one Snakemake job: logging to the job's log, one-line failures.

A cohort run can have thousands of jobs; when one fails, the user should read why in one
line on the terminal (and in full in the job's log), not dig through a traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from slidesnake.errors import SlideError, SlidesnakeError

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(log_path: str | Path | None = None) -> None:
    """Log to stderr and, when given, to the job's log file (replacing it)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w"))
    logging.basicConfig(level=logging.INFO, format=_FORMAT, handlers=handlers, force=True)
    logging.captureWarnings(True)


class Terminated(BaseException):
    """SIGTERM arrived: what SLURM sends on scancel, preemption or a time limit. Not an
    Exception, so that code which lets one model of a job fail alone does not take it
    for that model's failure."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


# The last line of a job that finished; a log that ends otherwise belongs to a job that
# failed (an ERROR line) or was killed before it could say anything.
JOB_DONE = "job done"


def run_job(
    stage: Callable[[], object], log_path: str | Path | None = None, slide_id: str | None = None
) -> None:
    """Run `stage`; on any error, log one line naming the slide and exit non-zero.

    slidesnake's own errors say what is wrong and what to do. Anything else (a library
    error, a full disk, an allocation that fails) gets its traceback in the log, then the
    same one line, so the cohort table can say why. SIGTERM unwinds the stage like an
    error, so temporary outputs are removed and loader workers stopped before the job
    exits with 128 + SIGTERM, as a shell would report it.
    """
    configure_logging(log_path)
    signal.signal(signal.SIGTERM, _raise_terminated)
    log = logging.getLogger("slidesnake")
    named = f"slide '{slide_id}': " if slide_id else ""
    try:
        stage()
    except SlidesnakeError as err:
        log.error("%s%s", "" if isinstance(err, SlideError) else named, err)
        sys.exit(1)
    except Terminated:
        log.error("%sstopped by SIGTERM; nothing was written, the next run redoes it", named)
        sys.exit(128 + signal.SIGTERM)
    except Exception as err:
        log.info("the traceback of the error below:\n%s", traceback.format_exc().rstrip())
        log.error(
            "%sunexpected %s: %s; nothing was written; the traceback is in this job's log",
            named,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "(no message)",
        )
        sys.exit(1)
    log.info(JOB_DONE)
