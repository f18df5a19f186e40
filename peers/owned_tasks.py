"""Tasks an object started on its event loop and must end before it closes.

The blocking facades start work on their loop from another thread (``submit``), where
no ``async with`` TaskGroup can hold it, and a call's error belongs to its caller's
Future rather than to a group that would cancel its siblings. :class:`OwnedTasks` is
the owner for such work: each task registers itself while it runs, and closing cancels
every one still running and waits (a bounded time) for it to end, so none is left
pending on a loop that is about to close.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from peers.errors import PeersError

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: Seconds an owner waits for its cancelled tasks to end when it closes. A cancelled
#: task ends at its next await: only one that suppresses cancellation takes longer, and
#: it is logged and left.
CANCEL_TIMEOUT_SECONDS = 3.0


class OwnedTasks:
    """The tasks running work for one owner. Used only on its loop's thread."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, task: asyncio.Task[Any]) -> None:
        """Own ``task`` (until it ends). Raises :class:`PeersError` once closing."""
        if self._closing:
            raise PeersError(f"{self._owner} is closed")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` in the current task, which is owned meanwhile.

        Raises what ``work`` raises, and :class:`PeersError` without starting it once
        closing; :meth:`close` cancels it (CancelledError).
        """
        task = asyncio.current_task()
        assert task is not None, "run() needs a task"
        try:
            self.add(task)
        except PeersError:
            work.close()  # never started: no "never awaited" warning
            raise
        try:
            return await work
        finally:
            self._tasks.discard(task)

    async def close(self, timeout: float) -> None:
        """Refuse new work, cancel every owned task (but the caller's own) and wait up to
        ``timeout`` seconds for them to end. Raises nothing but CancelledError (when the
        closer itself is cancelled): a task still running after ``timeout`` ignored
        cancellation and is logged (as a warning), not waited for."""
        self._closing = True
        current = asyncio.current_task()
        await cancel_and_wait([t for t in self._tasks if t is not current], timeout, self._owner)


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout: float, owner: str) -> None:
    """Cancel ``tasks`` and wait up to ``timeout`` seconds for them to end (see
    :meth:`OwnedTasks.close`). An error other than cancellation that one raised on the
    way out is logged (info) and so marked retrieved: its awaiter, if any, gets it too."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    _, stuck = await asyncio.wait(pending, timeout=timeout)
    for task in pending:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.info("%s: %s failed while closing: %r", owner, task.get_name(), task.exception())
    for task in stuck:
        logger.warning(
            "%s: %s still runs %s s after being cancelled; closing without it",
            owner,
            task.get_name(),
            timeout,
        )
