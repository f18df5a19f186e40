"""Helpers shared by the benchmarks: statistics, child-process hygiene, output.

Every benchmark prints a human-readable table and ends with exactly one JSON line
(:func:`emit_result`), so a script can collect results with ``tail -n 1``.

Process hygiene: a benchmark kills only processes it started, by PID. A process we
started may itself start others (hivemind's Go daemon ``p2pd``); :func:`descendants`
finds them while the parent is still alive, so they can be stopped by PID too.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Seconds a process gets to exit after SIGTERM before it is SIGKILLed.
TERMINATE_GRACE_SECONDS = 5.0


class BenchError(Exception):
    """A benchmark step failed: a child did not start, answer, or behave in time."""


# --- statistics -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# --- processes ------------------------------------------------------------------------


def _children_map() -> dict[int, list[int]]:
    """PPID -> PIDs for every process visible in /proc (empty where there is no /proc)."""
    out: dict[int, list[int]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the PPID; the command name (field 2) may hold spaces, so split after ')'.
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 2:
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """PIDs of every live descendant of ``pid`` (children first)."""
    children = _children_map()
    found: list[int] = []
    todo = [pid]
    while todo and len(found) < 10_000:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return state != "Z"
    return True


def pid_command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    return ""


def stop_pids(pids: Sequence[int], *, expect_in_command: str = "") -> None:
    """SIGTERM then SIGKILL each live PID (which we started, directly or not).

    With ``expect_in_command``, a PID whose command line no longer contains it is left
    alone: the process exited and the PID was reused by someone else's.
    """
    live = [
        p
        for p in pids
        if pid_alive(p) and (not expect_in_command or expect_in_command in pid_command(p))
    ]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    while live and time.monotonic() < deadline:
        live = [p for p in live if pid_alive(p)]
        time.sleep(0.05)
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def stop_popen_tree(popen: subprocess.Popen[Any], *, graceful: bool = True) -> None:
    """Stop a process we started and everything it started, each by PID."""
    tree = descendants(popen.pid)
    if popen.poll() is None:
        if graceful:
            popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(TERMINATE_GRACE_SECONDS if graceful else 0.01)
        except subprocess.TimeoutExpired:
            popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(TERMINATE_GRACE_SECONDS)
    stop_pids(tree)


def memory_bytes(pid: int) -> tuple[int, int] | None:
    """Resident and proportional set sizes (RSS, PSS) of ``pid`` in bytes, from /proc;
    ``None`` if it is gone. PSS splits each shared page among the processes mapping it,
    so a forked child's pages are not counted twice; where the kernel has no
    ``smaps_rollup``, PSS falls back to RSS."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = pss = 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return rss, rss
    for line in rollup.splitlines():
        if line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
    return rss, pss or rss


class LineReader:
    """Reads a child's output lines in a thread, each stamped with ``perf_counter``."""

    def __init__(self, stream: Any) -> None:
        self._lines: queue.Queue[tuple[float, str] | None] = queue.Queue()
        self.tail: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        with contextlib.suppress(ValueError, OSError):
            for line in stream:
                self._lines.put((time.perf_counter(), line.rstrip("\n")))
        self._lines.put(None)

    def next_line(self, deadline: float) -> tuple[float, str]:
        """The next line and when it arrived; :class:`BenchError` at EOF or the deadline
        (a ``time.monotonic()`` value)."""
        try:
            item = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise BenchError("no output before the deadline; last lines: " + self._tail()) from None
        if item is None:
            self._lines.put(None)
            raise BenchError("the process closed its output; last lines: " + self._tail())
        self.tail = [*self.tail[-19:], item[1]]
        return item

    def _tail(self) -> str:
        return " | ".join(self.tail[-5:]) or "(none)"


# --- output ---------------------------------------------------------------------------


def print_table(title: str, rows: Sequence[Sequence[str]]) -> None:
    """A plain aligned table; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print(f"\n{title}")
    for n, row in enumerate(rows):
        print(
            "  "
            + "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def emit_result(
    benchmark: str, figures: dict[str, Any], ratios: dict[str, Any], **extra: Any
) -> None:
    """The closing JSON line. Ratios are oriented so that > 1 means we are better."""
    result = {"benchmark": benchmark, "figures": figures, "ratios": ratios, **extra}
    print(json.dumps(result, sort_keys=False), flush=True)
