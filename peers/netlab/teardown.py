"""Tearing labs down on every way out of the owning process: ``with`` exit (the lab's
own), normal interpreter exit (atexit), and SIGTERM (a handler that tears down, then
lets the signal do what it would have done). Only SIGKILL and crashes get past these;
their leftovers are removed by the next lab (see :mod:`peers.netlab.namespaces`).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Protocol


class Closeable(Protocol):
    def close(self) -> None: ...


_live: dict[int, Closeable] = {}
_atexit_installed = False
_sigterm_installed = False
_previous_sigterm: Callable[[int, FrameType | None], object] | int | None = None


def register(lab: Closeable) -> None:
    """Tear ``lab`` down at exit or SIGTERM unless it is closed first."""
    _install_hooks()
    _live[id(lab)] = lab


def unregister(lab: Closeable) -> None:
    _live.pop(id(lab), None)


def close_all() -> None:
    """Close every registered lab; a failure is printed, and the others still close."""
    for lab in list(_live.values()):
        try:
            lab.close()
        except Exception:
            traceback.print_exc(file=sys.stderr)
        unregister(lab)


def _install_hooks() -> None:
    global _atexit_installed, _sigterm_installed, _previous_sigterm
    if not _atexit_installed:
        atexit.register(close_all)
        _atexit_installed = True
    # Signal handlers can only be set from the main thread; a lab made in another
    # thread still has atexit and the next lab's stale cleanup (and a later lab made
    # in the main thread installs the handler).
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    previous = signal.getsignal(signal.SIGTERM)
    if previous == signal.SIG_IGN:
        return  # the process chose to survive SIGTERM, so its labs live on too
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    close_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    # The default action: die of SIGTERM, as the process would have without us.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
