"""Progress lines at a steady pace, and a watchdog that says what is stuck.

An overnight cohort must never hang silently: when no batch has finished for
`watchdog_s`, the log says so, and what the model loop was doing at the time.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)


class Progress:
    """Counts finished tiles; a background thread logs rate, ETA and stalls."""

    def __init__(self, total: int, every_s: float, watchdog_s: float) -> None:
        self.total = total
        self.every_s = every_s
        self.watchdog_s = watchdog_s
        self.done = 0
        self._state = "starting"
        self._started = self._last_batch = self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="progress", daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def state(self, what: str) -> None:
        self._state = what

    def advance(self, tiles: int) -> None:
        self.done += tiles
        self._last_batch = time.monotonic()

    def line(self) -> str:
        elapsed = time.monotonic() - self._started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = f"{(self.total - self.done) / rate:.0f} s" if rate > 0 else "unknown"
        return f"{self.done}/{self.total} tiles, {rate:.1f} tiles/s, ETA {eta}"

    def _watch(self) -> None:
        warned_at = 0.0
        while not self._stop.wait(min(self.every_s, self.watchdog_s, 5.0)):
            now = time.monotonic()
            stalled = now - self._last_batch
            if stalled >= self.watchdog_s and now - warned_at >= self.watchdog_s:
                warned_at = now
                log.warning(
                    "no batch has finished for %.0f s; the model loop is %s (%s). A loader "
                    "stuck on a slow or failing disk, or a hung GPU, looks like this",
                    stalled,
                    self._state,
                    self.line(),
                )
            elif now - self._last_line >= self.every_s:
                self._last_line = now
                log.info("%s", self.line())
