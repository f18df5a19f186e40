"""A one-line progress display for the terminal, with no dependency.

On a terminal the line is redrawn in place (``\\r``) at most every ``redraw_seconds``;
elsewhere (a pipe, a log file, CI) it is printed as plain lines, one per tenth of the
way and at least every ``plain_seconds``, so a log stays short and readable.
:func:`format_bar` is the pure part.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

#: Characters of the bar itself; with the fields the line fits 100 columns.
BAR_WIDTH = 20


def format_bar(done: float, total: float, fields: Sequence[tuple[str, str]]) -> str:
    """``[#######-------------]  35%  samples 7,168/20,480  loss 0.412 ...``"""
    fraction = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    filled = int(fraction * BAR_WIDTH)
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    parts = [f"[{bar}] {fraction:4.0%}", *(f"{name} {value}" for name, value in fields)]
    return "  ".join(parts)


class ProgressBar:
    """Shows progress toward ``total`` on ``stream``; call :meth:`update` as often as
    you like (it throttles itself) and :meth:`close` once at the end."""

    def __init__(
        self,
        total: float,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        redraw_seconds: float = 0.1,
        plain_seconds: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.redraw_seconds = redraw_seconds
        self.plain_seconds = plain_seconds
        self._clock = clock
        self._last_time = -float("inf")
        self._last_tenth = -1
        self._width = 0  # of the line on screen (TTY), to blank what a shorter one leaves
        self._closed = False

    def update(self, done: float, fields: Sequence[tuple[str, str]]) -> None:
        """Show ``done`` out of ``total`` with ``fields`` (name, value), if it is time."""
        if self._closed:
            return
        now = self._clock()
        tenth = int(10 * done / self.total) if self.total > 0 else 0
        if self.tty:
            due = now - self._last_time >= self.redraw_seconds
        else:
            due = tenth > self._last_tenth or now - self._last_time >= self.plain_seconds
        if due:
            self._show(format_bar(done, self.total, fields))
            self._last_time, self._last_tenth = now, tenth

    def write(self, text: str) -> None:
        """Print a line of text above the bar (the bar is redrawn by the next update)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self, done: float, fields: Sequence[tuple[str, str]]) -> None:
        """Show the final state and end the line."""
        if self._closed:
            return
        self._closed = True
        line = format_bar(done, self.total, fields)
        if self.tty:
            self._show(line)
            self.stream.write("\n")
        elif int(10 * done / self.total if self.total > 0 else 0) != self._last_tenth:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _show(self, line: str) -> None:
        if self.tty:
            self.stream.write("\r" + line + " " * max(0, self._width - len(line)))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def human_bytes(num_bytes: float) -> str:
    """``1.5 MB`` (decimal units, as network figures are quoted)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(num_bytes) < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")
