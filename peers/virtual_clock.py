"""An asyncio event loop on a virtual clock, for in-memory tests of whole protocols.

When no callback is ready, the loop does not sleep: its clock jumps to the next timer.
``asyncio.sleep``, ``asyncio.timeout`` and ``loop.time()`` all follow that clock, so an
hour of protocol time with only in-memory I/O (:mod:`peers.memory_network`) runs in as
long as its callbacks take, and the same program always sees the same times (trio's
MockClock with ``autojump_threshold=0``; see docs/design/memory-network.md).

The loop is for in-memory code only: real sockets and threads do not follow its clock
(work given to ``run_in_executor`` runs inline, at once; a real file descriptor is polled
but never waited for).
A loop with nothing ready and no timer while the main coroutine is unfinished would
wait forever: it raises :class:`Deadlock` instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

from peers.errors import PeersError

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

logger = logging.getLogger(__name__)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: Loop iterations in a row that may pass without the clock moving before the run is
#: declared a livelock: a million callbacks at one instant is far past any protocol's
#: burst (a 1000-peer round moves its frames at distinct delivery times) and still
#: ends a spinning ``while True: await asyncio.sleep(0)`` within a few seconds.
MAX_ITERATIONS_WITHOUT_ADVANCE = 1_000_000
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)
#: Tasks a Deadlock error names (with where each waits): enough to see the culprit.
_DESCRIBED_TASKS = 12


class VirtualClockError(PeersError):
    """A run on the virtual clock cannot go on (a bug of the code it runs)."""


class Deadlock(VirtualClockError):
    """Nothing is ready and no timer is set, yet the main coroutine has not finished."""


class Livelock(VirtualClockError):
    """Callbacks keep running but the clock never moves (a task spinning on sleep(0))."""


class VirtualTimeExceeded(VirtualClockError):
    """The clock would pass the run's ``max_virtual_seconds``."""


class _VirtualSelector(selectors.BaseSelector):
    """Never blocks: a select that would wait ``timeout`` seconds advances the clock."""

    def __init__(self, loop: VirtualEventLoop) -> None:
        self._loop = loop
        # The loop registers its self-pipe here; keep a real selector for it (and for
        # any real descriptor someone adds), so register/unregister behave as usual.
        self._real = selectors.DefaultSelector()

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # The self-pipe alone needs no polling: call_soon_threadsafe queues its callback
        # before writing the wake-up byte, and a full pipe only drops wake-ups.
        if len(self._real.get_map()) > 1:
            events = self._real.select(0)
            if events:
                self._loop._virtual_wait(0)
                return events
        self._loop._virtual_wait(timeout)
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual (see the module docstring)."""

    def __init__(
        self,
        *,
        start: float = 0.0,
        max_virtual_seconds: float | None = None,
        max_iterations_without_advance: int = MAX_ITERATIONS_WITHOUT_ADVANCE,
    ) -> None:
        if max_virtual_seconds is not None and max_virtual_seconds < 0:
            raise ValueError("max_virtual_seconds must not be negative")
        if max_iterations_without_advance < 1:
            raise ValueError("max_iterations_without_advance must be at least 1")
        self._virtual_now = float(start)
        self._virtual_limit = None if max_virtual_seconds is None else start + max_virtual_seconds
        self._max_idle_iterations = max_iterations_without_advance
        self._idle_iterations = 0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts
    ) -> asyncio.Future[T]:
        """Run ``func`` here and now, in the loop's thread, and return its settled future.

        Work handed to a thread (``asyncio.to_thread``: a state snapshot's copy and hash)
        is CPU work, which takes no virtual time here; run inline it also keeps the run
        deterministic, which a real thread finishing at a real moment would not. Only
        work that waits on something outside the loop (a socket, a sleep) cannot be
        simulated this way, and blocks the whole run while it waits."""
        future: asyncio.Future[T] = self.create_future()
        try:
            future.set_result(func(*args))
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as e:
            future.set_exception(e)
        return future

    def _virtual_wait(self, timeout: float | None) -> None:
        """What a select with ``timeout`` does here: jump the clock, or raise."""
        if timeout is None:
            raise Deadlock(
                "nothing is ready and no timer is set, at virtual time "
                f"{self._virtual_now:.9g} s; waiting: {self._describe_tasks()}"
            )
        target = self._virtual_now + timeout
        if self._virtual_limit is not None and target > self._virtual_limit:
            raise VirtualTimeExceeded(
                f"the next timer is at {target:.9g} s, past the run's limit "
                f"{self._virtual_limit:.9g} s; waiting: {self._describe_tasks()}"
            )
        if target > self._virtual_now:
            self._virtual_now = target
            self._idle_iterations = 0
            return
        self._idle_iterations += 1
        if self._idle_iterations > self._max_idle_iterations:
            raise Livelock(
                f"{self._max_idle_iterations} loop iterations without the clock moving, at "
                f"virtual time {self._virtual_now:.9g} s; running: {self._describe_tasks()}"
            )

    def _describe_tasks(self) -> str:
        tasks = [t for t in asyncio.all_tasks(self) if not t.done()]
        parts = [f"{t.get_name()} at {_where(t)}" for t in tasks[:_DESCRIBED_TASKS]]
        if len(tasks) > _DESCRIBED_TASKS:
            parts.append(f"and {len(tasks) - _DESCRIBED_TASKS} more")
        return "; ".join(parts) or "no task"


def _where(task: asyncio.Task[Any]) -> str:
    """Where ``task`` waits, as ``file:line in name``: the innermost coroutine frame of
    its await chain outside asyncio itself (``Event.wait`` says little; its caller does)."""
    where = "?"
    awaited: Any = task.get_coro()
    for _ in range(64):  # bounded: an await chain is short
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is None:
            break
        code = frame.f_code
        if where == "?" or not code.co_filename.startswith(_ASYNCIO_DIR):
            where = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
    return where


def run_virtual(
    coro: Coroutine[Any, Any, T],
    *,
    start: float = 0.0,
    max_virtual_seconds: float | None = None,
    max_iterations_without_advance: int = MAX_ITERATIONS_WITHOUT_ADVANCE,
) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualEventLoop`, and return its result.

    The clock starts at ``start``. Raises :class:`Deadlock` if the loop would wait with
    nothing to wake it, :class:`Livelock` after ``max_iterations_without_advance``
    iterations in a row at one instant, and :class:`VirtualTimeExceeded` if the clock
    would pass ``start + max_virtual_seconds``; whatever ``coro`` raises propagates.
    Either way the tasks still pending are then cancelled and awaited, async
    generators are closed, and the loop is closed.
    """
    loop = VirtualEventLoop(
        start=start,
        max_virtual_seconds=max_virtual_seconds,
        max_iterations_without_advance=max_iterations_without_advance,
    )
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_leftovers(loop)
            loop._idle_iterations = 0
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            except VirtualClockError as e:
                logger.warning("async generators did not close: %s", e)
        finally:
            loop.close()


def _cancel_leftovers(loop: VirtualEventLoop) -> None:
    """Cancel the tasks still pending and wait for them (as ``asyncio.run`` does)."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop._idle_iterations = 0  # the cleanup gets a budget of its own
    try:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    except VirtualClockError as e:  # a task that waits on, cancelled: report, go on
        logger.warning("tasks did not finish when cancelled: %s", e)
        return
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {
                    "message": "unhandled exception in a task left when run_virtual ended",
                    "exception": task.exception(),
                    "task": task,
                }
            )
