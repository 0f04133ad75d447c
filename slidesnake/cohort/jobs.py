"""Running one stage as one Snakemake job: logging to the job's log, one-line failures.

A cohort run can have thousands of jobs; when one fails, the user should read why in one
line on the terminal (and in full in the job's log), not dig through a traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from slidesnake.errors import SlidesnakeError

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(log_path: str | Path | None = None) -> None:
    """Log to stderr and, when given, to the job's log file (replacing it)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_path, mode="w"))
    logging.basicConfig(level=logging.INFO, format=_FORMAT, handlers=handlers, force=True)
    logging.captureWarnings(True)


class Terminated(Exception):
    """SIGTERM arrived: what SLURM sends on scancel, preemption or a time limit."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def run_job(stage: Callable[[], object], log_path: str | Path | None = None) -> None:
    """Run `stage`; on a slidesnake error, log it and exit non-zero with that one line.

    SIGTERM unwinds the stage like an error, so temporary outputs are removed and loader
    workers stopped before the job exits with 128 + SIGTERM, as a shell would report it.
    """
    configure_logging(log_path)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        stage()
    except SlidesnakeError as err:
        logging.getLogger("slidesnake").error("%s", err)
        sys.exit(1)
    except Terminated:
        logging.getLogger("slidesnake").error(
            "stopped by SIGTERM; nothing was written, the next run redoes this slide"
        )
        sys.exit(128 + signal.SIGTERM)
