"""Stopping the children we started (peers/processes.py): one shared grace period,
SIGKILL for those that ignore SIGTERM, a paused one resumed so it can exit, all reaped."""

from __future__ import annotations

import signal
import subprocess
import sys

from peers.processes import stop_processes

IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " print('ready', flush=True); time.sleep(60)"
)
SLEEPS = "import time; print('ready', flush=True); time.sleep(60)"


def _start(code: str) -> subprocess.Popen[str]:
    popen = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    assert popen.stdout is not None and popen.stdout.readline().strip() == "ready"
    return popen


def test_every_child_is_stopped_and_reaped() -> None:
    stubborn, plain, paused = _start(IGNORES_TERM), _start(SLEEPS), _start(SLEEPS)
    paused.send_signal(signal.SIGSTOP)
    stop_processes([stubborn, plain, paused], grace_seconds=0.5)
    assert stubborn.returncode == -signal.SIGKILL  # ignored SIGTERM: killed
    assert plain.returncode == -signal.SIGTERM
    assert paused.returncode == -signal.SIGTERM  # resumed, then it handled SIGTERM
    for popen in (stubborn, plain, paused):
        assert popen.stdout is not None and popen.stdout.closed
    stop_processes([stubborn, plain, paused])  # again: nothing left to do, no error
