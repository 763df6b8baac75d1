"""A one-line progress bar on stderr for long runs, and Ctrl-C as a request to stop early.

The bar draws only on a terminal (never into logs or test output) and at most ten times a
second. `Interrupt` turns the first Ctrl-C into a stop event, so that a run ends cleanly and
its results so far are printed and saved; a second Ctrl-C aborts at once.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import TextIO

from pdserve.bench.metrics import COMPLETED, RequestRecord

_REDRAW_S = 0.1
_BAR_WIDTH = 30


class Progress:
    """Counts finished requests of one run and redraws `[####    ] 12/100 (1 failed) 3.2s`."""

    def __init__(
        self, total: int, label: str = "", enabled: bool | None = None, stream: TextIO | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = total
        self.label = label
        self.num_done = 0
        self.num_failed = 0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += record.status != COMPLETED
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= _REDRAW_S or self.num_done == self.total):
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled and self.num_done:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        filled = _BAR_WIDTH * self.num_done // max(1, self.total)
        bar = "#" * filled + " " * (_BAR_WIDTH - filled)
        failed = f" ({self.num_failed} failed)" if self.num_failed else ""
        label = f"{self.label} " if self.label else ""
        self.stream.write(
            f"\r{label}[{bar}] {self.num_done}/{self.total}{failed} {now - self._start:.1f}s"
        )
        self.stream.flush()


class Interrupt:
    """Within `with Interrupt() as stop:`, Ctrl-C sets the event bound with `bind` (and
    `stop.requested`) instead of raising; a second Ctrl-C raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._previous = None

    def __enter__(self) -> Interrupt:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def bind(self) -> asyncio.Event:
        """A stop event for the running loop, already set if Ctrl-C came before."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        if self.requested:
            self._event.set()
        return self._event

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\ninterrupted: stopping with the results so far (Ctrl-C again to abort)",
            file=sys.stderr,
        )
        if self._loop is not None and self._event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._event.set)
