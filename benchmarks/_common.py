"""Helpers shared by the benchmarks: statistics, child-process hygiene, output.

Every benchmark prints a human-readable table and ends with exactly one JSON line
(:func:`emit_result`), so a script can collect results with ``tail -n 1``.

Process hygiene: a benchmark kills only processes it started, by PID. A process we
started may itself start others (hivemind's Go daemon ``p2pd``); :func:`descendants`
finds them while the parent is still alive, so they can be stopped by PID too.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import multiprocessing.process
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
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


#: Where torch keeps the shared memory of tensors passed between processes, in files
#: named ``torch_<creator's pid>_...``. hivemind's averager and MoE server pass tensors
#: that way, and a process stopped by a signal never unlinks its files: each run leaked
#: tens of files (one vector each) that held RAM until reboot (7.5 GB found here).
SHARED_MEMORY_DIR = Path("/dev/shm")


def remove_shared_memory_of(pids: Sequence[int]) -> int:
    """Unlink torch's shared-memory files created by ``pids`` (ours, and no longer
    running: a live PID is skipped, it may have been reused). Returns how many."""
    removed = 0
    for pid in pids:
        if pid_alive(pid):
            continue
        for path in SHARED_MEMORY_DIR.glob(f"torch_{pid}_*"):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def stop_pids(pids: Sequence[int], *, expect_in_command: str = "") -> None:
    """SIGTERM then SIGKILL each live PID (which we started, directly or not), then
    remove the shared memory they leave behind (:func:`remove_shared_memory_of`).

    With ``expect_in_command``, a PID whose command line no longer contains it is left
    alone: the process exited and the PID was reused by someone else's.
    """
    live = [
        p
        for p in pids
        if pid_alive(p) and (not expect_in_command or expect_in_command in pid_command(p))
    ]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        while live and time.monotonic() < deadline:
            live = [p for p in live if pid_alive(p)]
            time.sleep(0.02)
    remove_shared_memory_of(pids)


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


def timed_steps(steps: Sequence[Any], warmup: int, train: Callable[[Any], object]) -> float:
    """Seconds ``train(step)`` takes over ``steps[warmup:]`` (after the warm-up ones)."""
    started = 0.0
    for i, step in enumerate(steps):
        if i == warmup:
            started = time.perf_counter()
        train(step)
    return time.perf_counter() - started


def emit_result(
    benchmark: str, figures: dict[str, Any], ratios: dict[str, Any], **extra: Any
) -> None:
    """The closing JSON line. Ratios are oriented so that > 1 means we are better."""
    result = {"benchmark": benchmark, "figures": figures, "ratios": ratios, **extra}
    print(json.dumps(result, sort_keys=False), flush=True)


# --- child processes shared by the benchmarks -----------------------------------------

#: A hivemind ``p2pd``'s unix socket in its command line (left behind if it is killed).
P2PD_SOCKET = re.compile(r"-listen=/unix(/\S*/hivemind-p2pd-[\w-]+\.sock)(?:\s|$)")
#: Lines a wait reads at most: a child printing endlessly cannot hold us.
MAX_LINES_PER_WAIT = 100_000


@dataclass(frozen=True)
class Placement:
    """Where each member's process runs: on loopback (the default) or, for
    ``bench_wan.py``, on the namespace lab's hosts (a namespace and an address per rank)."""

    namespaces: tuple[str | None, ...] = ()
    hosts: tuple[str, ...] = ()

    def namespace(self, rank: int) -> str | None:
        return self.namespaces[rank] if self.namespaces else None

    def host(self, rank: int) -> str:
        return self.hosts[rank] if self.hosts else "127.0.0.1"


LOOPBACK = Placement()


class JsonChild:
    """A ``python SCRIPT ARGS...`` child that reads JSON commands on stdin and prints JSON
    reports on stdout; its output, and the processes it started (by PID). With
    ``namespace`` it runs inside that network namespace (the namespace lab's hosts)."""

    def __init__(
        self, script: Path, args: list[str], *, name: str = "process", namespace: str | None = None
    ) -> None:
        level = os.environ.get("HIVEMIND_LOGLEVEL", "WARNING")  # DEBUG to see what it does
        env = dict(os.environ, PYTHONUNBUFFERED="1", HIVEMIND_LOGLEVEL=level)
        self.name = name
        # ``ip netns exec`` execs the interpreter: our PID is the child's own.
        prefix = ["ip", "netns", "exec", namespace] if namespace is not None else []
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.out = LineReader(self.popen.stdout)
        self.err = LineReader(self.popen.stderr)
        self.tree: set[int] = set()
        """Descendants seen so far: they outlive the parent if it dies first."""
        self.sockets: set[str] = set()
        """The unix sockets its ``p2pd`` listens on (left behind if it is killed)."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def send(self, message: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(json.dumps(message) + "\n")
            self.popen.stdin.flush()
        except OSError as e:
            raise BenchError(f"{self.name} {self.pid} is gone: {e}; {self.errors()}") from e

    def wait_report(self, event: str, timeout: float) -> dict[str, Any]:
        """The next report of ``event``; :class:`BenchError` if none comes in time."""
        deadline = time.monotonic() + timeout
        try:
            for _ in range(MAX_LINES_PER_WAIT):
                _, line = self.out.next_line(deadline)
                if not line.startswith("{"):
                    continue
                with contextlib.suppress(json.JSONDecodeError):
                    report: dict[str, Any] = json.loads(line)
                    if report.get("event") == event:
                        # Children come and go (hivemind's averager, DHT, p2pd): note
                        # them while they live, to stop them and clean up after them.
                        self.remember_tree()
                        return report
        except BenchError as e:
            raise BenchError(f"{self.name} {self.pid}: {e}; {self.errors()}") from None
        raise BenchError(f"{self.name} {self.pid} printed too much without {event!r}")

    def drain_errors(self) -> list[str]:
        """Every stderr line printed since the last call (hivemind logs there)."""
        lines: list[str] = []
        with contextlib.suppress(BenchError):
            while len(lines) < MAX_LINES_PER_WAIT:
                lines.append(self.err.next_line(time.monotonic())[1])
        return lines

    def errors(self) -> str:
        """The last lines of its stderr (what it has printed so far)."""
        self.drain_errors()
        return "stderr: " + (" | ".join(self.err.tail[-5:]) or "(none)")

    def remember_tree(self) -> None:
        for pid in descendants(self.pid):
            self.tree.add(pid)
            found = P2PD_SOCKET.search(pid_command(pid))
            if found and "p2pd" in pid_command(pid):
                self.sockets.add(found.group(1))


@dataclass
class PipeChild:
    """One spawned ``multiprocessing`` child and our end of its command pipe."""

    name: str
    process: multiprocessing.process.BaseProcess
    conn: Connection
    daemon_pids: list[int] = field(default_factory=list)
    """PIDs of daemons the child reported starting (hivemind's p2pd)."""


def receive_from(child: PipeChild, timeout: float) -> Any:
    """The child's next answer; :class:`BenchError` if it fails, dies or is late. It sends
    ``(kind, body)``: ``("pids", [...])`` records daemons it started, ``("error", text)``
    fails, anything else is the answer."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"{child.name} did not answer within {timeout:.0f} s")
        if child.conn.poll(min(0.2, remaining)):
            try:
                kind, body = child.conn.recv()
            except (EOFError, OSError) as e:
                raise BenchError(f"{child.name} exited (code {child.process.exitcode})") from e
            if kind == "pids":
                child.daemon_pids.extend(body)
                continue
            if kind == "error":
                raise BenchError(f"{child.name} failed:\n{body}")
            return body
        if not child.process.is_alive() and not child.conn.poll(0):
            raise BenchError(f"{child.name} exited (code {child.process.exitcode})")


def run_role(
    roles: dict[str, Callable[[Connection, dict[str, Any]], None]],
    role: str,
    conn: Connection,
    options: dict[str, Any],
) -> None:
    """Run a spawned child's ``role``; a failure goes to the parent on the pipe as
    ``("error", traceback)`` and the child exits with status 1."""
    try:
        roles[role](conn, options)
    except Exception:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
        raise SystemExit(1) from None


def importable_hivemind(modules: str, timeout: float) -> tuple[str | None, str]:
    """hivemind's version, or ``None`` and why it cannot be used. Checked in a child
    that imports ``modules`` (e.g. ``"hivemind.p2p"``), so this process never imports
    torch or hivemind."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", f"import {modules}, hivemind; print(hivemind.__version__)"],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"importing hivemind took over {timeout:.0f} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["unknown error"])[-1]
        return None, f"hivemind is not importable ({last}); install the 'bench' extra"
    return done.stdout.strip(), ""


def installed_hivemind() -> tuple[str | None, str]:
    """hivemind's installed version, or ``None`` and why it cannot be used. Looked up
    without importing it (that takes seconds: it imports torch); if it is installed but
    broken, its first peer fails with hivemind's own error and the run goes on without it."""
    if importlib.util.find_spec("hivemind") is None:
        return None, "hivemind is not installed; install the 'bench' extra"
    try:
        return importlib.metadata.version("hivemind"), ""
    except importlib.metadata.PackageNotFoundError:
        return "unknown", ""
