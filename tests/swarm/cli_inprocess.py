"""``swarm.cli.main(argv)`` in the test process, for the checks of command-line mistakes.

Such a check needs no process of its own: a bad flag is refused before anything starts
(exit code 2, one line on stderr). A fresh ``python -m swarm.cli`` imports torch again,
about 3.6 s a time; in process the check takes milliseconds. Each test file keeps at
least one real ``python -m swarm.cli`` run, so that the entry point itself stays covered.

What ``main`` would leave behind in this process is put back: the root logger (``main``
calls ``logging.basicConfig``, which gives it a handler on the stderr captured here when
it has none), ``sys.path`` (a user's ``MODULE:ATTRIBUTE`` puts the current directory on
it) and the SIGINT and SIGTERM handlers.

If a regression let a bad command line through, the command would start here what it
starts: a peer, a swarm's training. So no peer can start while :func:`run_cli` runs (every
command, the demo and training included, starts one first): the check fails at once.
A test that uses it is also marked ``@pytest.mark.timeout(INPROCESS_TIMEOUT)``, against a
hang before any peer; that alone is not enough, as a command's event loop (uvloop) with
signal handlers took pytest-timeout's SIGALRM into a callback, logged its failure there
and kept serving.
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import subprocess
import sys
from unittest import mock

from peers.host import Peer
from swarm.cli import main

#: Seconds a test of a few in-process runs may take: milliseconds each, but the first
#: one may import torch and the training modules, on a loaded 2-core machine.
INPROCESS_TIMEOUT = 30


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``swarm ARGS`` run by ``main(args)`` here, as a finished process: its exit code
    (argparse's ``SystemExit`` turned into its code, as the interpreter would) and what
    it printed on stdout and stderr."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    path = sys.path[:]
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with (
            mock.patch.object(Peer, "__aenter__", _no_peer_here),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = _exit_code(e.code, err)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        sys.path[:] = path
        for sig, handler in signals.items():
            if handler is not None:
                signal.signal(sig, handler)
    return subprocess.CompletedProcess(["swarm", *args], code, out.getvalue(), err.getvalue())


async def _no_peer_here(self: Peer) -> Peer:
    raise AssertionError(
        "the command line was accepted: a peer was starting in the test process "
        f"({self.config.listen_addrs})"
    )


def _exit_code(code: object, stderr: io.StringIO) -> int:
    """The exit status ``sys.exit(code)`` gives a process (a message is printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1
