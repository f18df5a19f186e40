"""The processes a lab started inside its namespaces, and stopping them: SIGTERM first
so they may clean up, SIGKILL after a grace period, always by the PID we started (never
by name), and every wait bounded."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from peers.netlab.commands import NetlabError

#: Seconds processes get, all together, to exit after SIGTERM before SIGKILL: enough
#: for a Python peer to close its sockets, short enough that a hung one does not stall
#: a test's teardown.
TERMINATE_GRACE_SECONDS = 3.0
#: Seconds to wait for a SIGKILLed process to be reaped. The kernel acts at once; the
#: bound only guards against a process stuck in uninterruptible sleep.
KILL_WAIT_SECONDS = 2.0


def netns_exec_argv(namespace: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``namespace``. ``ip netns exec`` execs it directly, so the
    PID of the started process is that of the command itself."""
    if not argv:
        raise ValueError("argv must name a program")
    return ["ip", "netns", "exec", namespace, *argv]


class OwnedProcesses:
    """Every process a lab started, to stop at teardown."""

    def __init__(self) -> None:
        self._popens: list[subprocess.Popen[Any]] = []
        self._stopped = False

    def start(
        self, namespace: str, argv: Sequence[str], **popen_kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``namespace`` (``popen_kwargs`` go to ``Popen``) and
        record it. Raises ``OSError`` if ``ip`` cannot be started, and
        :class:`~peers.netlab.NetlabError` once the lab is torn down."""
        if self._stopped:
            raise NetlabError("the lab is closed; its namespaces are gone")
        popen: subprocess.Popen[Any] = subprocess.Popen(
            netns_exec_argv(namespace, argv), **popen_kwargs
        )
        self._popens.append(popen)
        return popen

    @property
    def pids(self) -> list[int]:
        return [popen.pid for popen in self._popens]

    def stop_all(self, *, grace_seconds: float = TERMINATE_GRACE_SECONDS) -> None:
        """SIGTERM every live one, wait up to ``grace_seconds`` in all, SIGKILL the
        rest, and reap them; closes the pipes the lab's caller left open. Later
        :meth:`start` calls fail."""
        self._stopped = True
        for popen in self._popens:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for popen in self._popens:
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
        self._popens.clear()
