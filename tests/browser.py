"""Headless Chromium (Debian's `chromium`) for the tests of pages: the DOM after the
page's scripts ran, what it wrote to its console, and screenshots."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]


def require_chromium() -> str:
    """Chromium's path; skips where it is absent, unless CI requires it."""
    if CHROMIUM is None:
        if os.environ.get("SLIDESNAKE_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not installed (.ci/run installs Debian's)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return CHROMIUM


def _chromium(*args: str) -> subprocess.CompletedProcess:
    command = [require_chromium(), *FLAGS, "--virtual-time-budget=10000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def rendered(url: str) -> tuple[str, list[str]]:
    """The DOM of `url` once its scripts ran, and every line it wrote to its console
    (an uncaught error among them)."""
    done = _chromium("--dump-dom", url)
    return done.stdout, [line for line in done.stderr.splitlines() if ":CONSOLE" in line]


def screenshot(url: str, path: Path, size: str = "1400,1000") -> Path:
    _chromium(f"--window-size={size}", f"--screenshot={path}", url)
    return path
