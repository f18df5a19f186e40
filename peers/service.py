"""The skeleton every long-lived service on a peer shares: entered with ``async with``,
it registers the protocols it serves, runs its background work in a TaskGroup it owns,
and leaves nothing behind on exit, whether it started, failed to start or was cancelled
while starting (docs/design/services.md).

A service subclasses :class:`Service` and fills in two hooks:

- ``_start()``: what entering does once the TaskGroup is open: register handlers with
  :meth:`Service._serve` (each is removed on exit), start background work with
  :meth:`Service._spawn`, enter the services it is built from with
  :meth:`Service._enter`, and anything else (listen, bootstrap, announce). If it
  raises or is cancelled, everything done so far is undone before the error goes on.
- ``_stop()``: what leaving does first, before the handlers are removed and the
  background work cancelled (close listeners, release callers that wait).

On exit, in this order: ``_stop()``; every handler removed (no new request starts);
every background task cancelled and awaited (the TaskGroup closes); the inner services
left, last entered first. A background task's failure is its own: logged by its owner
or raised out of the TaskGroup on exit, never swallowed. The caller's exception out of
the ``async with`` body is never wrapped or replaced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from types import TracebackType
from typing import Any, Self, TypeVar

from peers.rpc import CallContext, add_unary_handler
from peers.serialization import MAX_FRAME_BYTES, MAX_VALUE_ITEMS
from peers.stream_api import RpcHost

_T = TypeVar("_T")


class Service:
    """Base class of a service entered with ``async with`` (see the module docstring).
    Subclasses call ``super().__init__()`` and override ``_start`` and ``_stop``."""

    def __init__(self) -> None:
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stack: AsyncExitStack | None = None
        self._removals: list[Callable[[], None]] = []

    async def __aenter__(self) -> Self:
        if self._group is not None:
            raise RuntimeError(f"{type(self).__name__} is already entered")
        self._stack = AsyncExitStack()
        self._group = asyncio.TaskGroup()
        await self._group.__aenter__()
        started = False
        try:
            await self._start()
            started = True
        finally:
            if not started:  # an error or a cancellation while starting: undo it all
                await self._leave()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The body's own exception propagates as it is: our group owns only our tasks,
        # and wrapping a caller's error in an ExceptionGroup would hide it.
        await self._leave()

    async def _leave(self) -> None:
        group, stack = self._group, self._stack
        if group is None or stack is None:
            return
        try:
            await self._stop()
        finally:
            removals, self._removals = self._removals, []
            for remove in reversed(removals):
                remove()
            for task in list(self._tasks):
                task.cancel()
            try:
                await group.__aexit__(None, None, None)
            finally:
                self._group = self._stack = None
                await stack.aclose()

    # --- hooks ------------------------------------------------------------------------

    async def _start(self) -> None:
        """Entering, once the TaskGroup is open (see the module docstring)."""

    async def _stop(self) -> None:
        """Leaving, first (see the module docstring)."""

    # --- for the hooks ----------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in this service's TaskGroup until it ends or the service stops."""
        if self._group is None:
            work.close()
            raise RuntimeError(f"{type(self).__name__} is not running")
        task = self._group.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _serve(self, register: Callable[[], None], remove: Callable[[], None]) -> None:
        """Call ``register`` now (e.g. add a protocol handler) and ``remove`` on exit."""
        register()
        self._removals.append(remove)

    def _serve_unary(
        self,
        host: RpcHost,
        protocol: str,
        handler: Callable[[Any, CallContext], Awaitable[Any]],
        request_type: type[Any],
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_value_items: int = MAX_VALUE_ITEMS,
    ) -> None:
        """Serve a unary RPC on ``host`` (:func:`peers.rpc.add_unary_handler`) until
        exit."""
        self._serve(
            lambda: add_unary_handler(
                host,
                protocol,
                handler,
                request_type,
                max_frame_bytes=max_frame_bytes,
                max_value_items=max_value_items,
            ),
            lambda: host.remove_stream_handler(protocol),
        )

    async def _enter(self, inner: AbstractAsyncContextManager[_T]) -> _T:
        """Enter ``inner`` (a service this one is built from); it is left on exit, after
        this service's own work has stopped."""
        assert self._stack is not None
        return await self._stack.enter_async_context(inner)
