"""Stopping child processes we started: SIGTERM first so they may clean up, SIGKILL
after one grace period shared by all of them, always by the handle we started them with
(never by name), and every wait bounded. The local swarm harness
(:mod:`peers.testing`), the namespace lab (:mod:`peers.netlab`) and the demo
(:mod:`swarm.demo`) stop their children with :func:`stop_processes`."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any

#: Seconds children get, all together, to exit after SIGTERM before SIGKILL: enough for
#: a Python peer to close its sockets and save a checkpoint, short enough that a hung
#: one does not stall a teardown for long.
TERMINATE_GRACE_SECONDS = 5.0
#: Seconds to wait for a SIGKILLed child to be reaped. The kernel acts at once; the
#: bound only guards against a process stuck in uninterruptible sleep.
KILL_WAIT_SECONDS = 2.0


def stop_processes(
    popens: Iterable[subprocess.Popen[Any]], *, grace_seconds: float = TERMINATE_GRACE_SECONDS
) -> None:
    """SIGCONT and SIGTERM every one still running (a paused child must run to handle
    its SIGTERM), wait up to ``grace_seconds`` in all, SIGKILL the rest, reap them, and
    close the pipes left open."""
    popens = list(popens)
    for popen in popens:
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGCONT)
                popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for popen in popens:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(KILL_WAIT_SECONDS)
        for pipe in (popen.stdin, popen.stdout, popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
