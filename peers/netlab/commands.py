"""Running the lab's setup commands (``ip``, ``nft``, ``tc``, ``sysctl``): always with a
timeout, always checked, and failing with an error that names the command and quotes
its stderr, so a broken lab says which step broke and why."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence

from peers.errors import PeersError

#: Seconds one setup command may take. An ``ip`` or ``nft`` call takes milliseconds;
#: ten seconds only matters on a badly overloaded machine, and still bounds the wait.
DEFAULT_COMMAND_TIMEOUT = 10.0
#: Characters of a failed command's stderr kept in the error: enough for ``nft``'s
#: caret-marked syntax errors, short enough for a readable test failure.
STDERR_TAIL_CHARS = 2000


class NetlabError(PeersError):
    """The namespace lab could not be built, used or torn down."""


class CommandError(NetlabError):
    """A command exited non-zero (or could not start); carries its argv and stderr."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stderr: str) -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(
            f"`{shlex.join(self.argv)}` exited with {returncode}: {stderr[-STDERR_TAIL_CHARS:]}"
        )


class CommandTimeout(CommandError):
    """A command ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout: float, stderr: str) -> None:
        super().__init__(argv, None, stderr)
        self.timeout = timeout
        self.args = (f"`{shlex.join(self.argv)}` ran past {timeout} s and was killed: {stderr}",)


def run_checked(
    argv: Sequence[str], *, timeout: float, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to completion and return its result (text, output captured).

    Raises :class:`CommandError` if it cannot be started or (unless ``check`` is false)
    exits non-zero, and :class:`CommandTimeout` (after killing it) if it runs past
    ``timeout`` seconds.
    """
    try:
        done = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        # ``TimeoutExpired`` may hold bytes even in text mode (it is raised mid-read).
        raw = e.stderr or ""
        stderr = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        raise CommandTimeout(argv, timeout, stderr) from e
    except OSError as e:
        raise CommandError(argv, None, str(e)) from e
    if check and done.returncode != 0:
        raise CommandError(argv, done.returncode, done.stderr.strip())
    return done
