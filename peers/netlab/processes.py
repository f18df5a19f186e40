"""The processes a lab started inside its namespaces, and stopping them: SIGTERM first
so they may clean up, SIGKILL after a grace period, always by the PID we started (never
by name), and every wait bounded."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

from peers.netlab.commands import NetlabError
from peers.processes import TERMINATE_GRACE_SECONDS, stop_processes


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
        stop_processes(self._popens, grace_seconds=grace_seconds)
        self._popens.clear()
