"""A blocking facade over :class:`peers.host.Peer` for scripts that are not async.

The event loop (uvloop where installed) runs in a daemon thread owned by the facade.
Every method blocks until done; the ``*_future`` variants return a
``concurrent.futures.Future`` instead. ``close()`` (or leaving the ``with`` block, or
interpreter exit) closes the peer cleanly and joins the thread. The facade owns what it
runs: closing cancels the calls still running and waits for them before the peer and
then the loop close, so no task is left pending on a closed loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from multiaddr import Multiaddr

from peers.closing import ClosesOnExit
from peers.config import PeerConfig
from peers.errors import PeersError
from peers.host import Peer
from peers.identify import IdentifyInfo
from peers.identity import PeerID
from peers.owned_tasks import CANCEL_TIMEOUT_SECONDS, OwnedTasks, cancel_and_wait
from peers.rpc import CallContext
from peers.runtime import loop_factory

logger = logging.getLogger(__name__)
T = TypeVar("T")
#: Seconds ``close()`` waits for the peer to shut down before giving up on the thread.
CLOSE_TIMEOUT_SECONDS = 10.0
# Closing waits CANCEL_TIMEOUT_SECONDS for the calls still running (each cancelled),
# before the peer closes, and again for any other task left on the loop, before the
# loop closes: twice it leaves the peer's own shutdown within CLOSE_TIMEOUT_SECONDS.

_live: weakref.WeakSet[BlockingPeer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for peer in list(_live):
        peer.close()


class BlockingPeer(ClosesOnExit):
    """A :class:`Peer` usable from plain Python; starts listening on construction.

    It leaves the process's allocator as it is: an application that frees big tensor
    buffers over and over opts in with :func:`peers.runtime.keep_freed_memory`."""

    def __init__(self, config: PeerConfig | None = None) -> None:
        self._loop = loop_factory()()
        self._stop: asyncio.Event | None = None
        self._started: concurrent.futures.Future[Peer] = concurrent.futures.Future()
        self._tasks = OwnedTasks("BlockingPeer")  # what submit() runs; the loop's thread only
        self._thread = threading.Thread(
            target=self._run, args=(config,), daemon=True, name="swarmtrain-peer"
        )
        self._closed = False
        self._thread.start()
        self._peer = self._started.result()
        _live.add(self)

    def _run(self, config: PeerConfig | None) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(config))
        finally:
            try:
                self._loop.run_until_complete(_end_strays())
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            finally:
                self._loop.close()

    async def _main(self, config: PeerConfig | None) -> None:
        self._stop = asyncio.Event()
        try:
            async with Peer(config) as peer:
                self._started.set_result(peer)
                await self._stop.wait()
                # The calls still running use the peer: they end before it closes.
                await self._tasks.close(CANCEL_TIMEOUT_SECONDS)
        except Exception as e:
            if not self._started.done():
                self._started.set_exception(e)
            else:
                raise

    # --- plumbing ----------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run a coroutine on the peer's loop; a Future of its result.

        Raises :class:`PeersError` if the peer is closed. The facade owns the task:
        closing the peer cancels it (the Future is then cancelled) and waits for it.
        """
        if self._closed:
            coro.close()
            raise PeersError("peer is closed")
        return asyncio.run_coroutine_threadsafe(self._tasks.run(coro), self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the peer's loop and wait for its result.

        On ``timeout`` the coroutine is cancelled and :class:`TimeoutError` raised.
        """
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise TimeoutError(f"no result within {timeout} s") from e

    @property
    def peer(self) -> Peer:
        """The async Peer (use it only from coroutines passed to ``run``/``submit``)."""
        return self._peer

    @property
    def peer_id(self) -> PeerID:
        return self._peer.peer_id

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        return self._peer.listen_addrs

    # --- the Peer API, blocking ----------------------------------------------------

    def connect(self, addr: Multiaddr | str, timeout: float | None = None) -> PeerID:
        return self.run(self._peer.connect(addr), timeout)

    def ping(self, peer: PeerID | Multiaddr | str, timeout: float | None = None) -> float:
        return self.run(self._peer.ping(peer), timeout)

    def identify(
        self, peer: PeerID | Multiaddr | str, timeout: float | None = None
    ) -> IdentifyInfo:
        return self.run(self._peer.identify(peer), timeout)

    def call_unary(
        self,
        remote: PeerID | Multiaddr | str,
        protocol: str,
        request: object,
        response_type: type[T],
        *,
        timeout: float | None = None,
    ) -> T:
        return self.call_unary_future(
            remote, protocol, request, response_type, timeout=timeout
        ).result()

    def call_unary_future(
        self,
        remote: PeerID | Multiaddr | str,
        protocol: str,
        request: object,
        response_type: type[T],
        *,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[T]:
        return self.submit(
            self._peer.call_unary(remote, protocol, request, response_type, timeout=timeout)
        )

    def call_stream(
        self,
        remote: PeerID | Multiaddr | str,
        protocol: str,
        requests: Iterable[Any],
        response_type: type[T],
        *,
        timeout: float | None = None,
    ) -> list[T]:
        """A streaming call whose responses are collected into a list."""

        async def collect() -> list[T]:
            return [
                r
                async for r in self._peer.call_stream(
                    remote, protocol, requests, response_type, timeout=timeout
                )
            ]

        return self.run(collect())

    def add_unary_handler(
        self,
        protocol: str,
        handler: Callable[[Any, CallContext], Awaitable[Any]] | Callable[[Any, CallContext], Any],
        request_type: type[Any],
    ) -> None:
        """Serve a unary RPC. A plain (non-async) handler runs in a worker thread so it
        cannot stall the network loop."""
        if inspect.iscoroutinefunction(handler):
            async_handler = handler
        else:

            async def async_handler(request: Any, context: CallContext) -> Any:
                return await asyncio.to_thread(handler, request, context)

        self.run(
            _call_soon(lambda: self._peer.add_unary_handler(protocol, async_handler, request_type))
        )

    def add_stream_handler(
        self,
        protocol: str,
        handler: Callable[[AsyncIterator[Any], CallContext], AsyncIterator[Any]],
        request_type: type[Any],
    ) -> None:
        self.run(_call_soon(lambda: self._peer.add_stream_handler(protocol, handler, request_type)))

    # --- shutdown ----------------------------------------------------------------

    def close(self) -> None:
        """Close every connection, stop the loop and join its thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        if self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(CLOSE_TIMEOUT_SECONDS)


async def _call_soon(fn: Callable[[], None]) -> None:
    fn()


async def _end_strays() -> None:
    """The last step before the loop closes: cancel and wait for any task nobody owned
    (started by a call's code and not awaited), so none is destroyed pending."""
    current = asyncio.current_task()
    strays = [t for t in asyncio.all_tasks() if t is not current]
    if strays:
        logger.info("BlockingPeer: %d tasks left on the loop at close", len(strays))
    await cancel_and_wait(strays, CANCEL_TIMEOUT_SECONDS, "BlockingPeer")


Body = Callable[[asyncio.Event, Callable[[], None]], Coroutine[Any, Any, None]]


class BackgroundService(ClosesOnExit):
    """A long-lived coroutine on a :class:`BlockingPeer`'s loop, for the blocking server
    facades. ``body(stop, ready)`` serves until ``stop`` is set and calls ``ready()``
    once serving (again later is harmless). The constructor returns once it is ready,
    raises why it failed to start, or TimeoutError after ``start_timeout`` seconds;
    ``close()`` (idempotent) stops it, waiting up to ``close_timeout`` seconds."""

    def __init__(
        self, peer: BlockingPeer, body: Body, *, start_timeout: float, close_timeout: float
    ) -> None:
        self._peer = peer
        self._body = body
        self._close_timeout = close_timeout
        self._stop: asyncio.Event | None = None
        self._done: asyncio.Future[None] | None = None
        peer.run(self._begin(), timeout=start_timeout)

    async def _begin(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_ready() -> None:
            if not ready.done():
                ready.set_result(None)

        self._stop = asyncio.Event()
        self._done = asyncio.ensure_future(self._body(self._stop, on_ready))
        self._peer._tasks.add(self._done)  # closing the peer first stops it too
        await asyncio.wait([ready, self._done], return_when=asyncio.FIRST_COMPLETED)
        if self._done.done():
            self._done.result()  # it failed to start: raise why

    async def _end(self) -> None:
        assert self._stop is not None and self._done is not None
        self._stop.set()
        await self._done

    def close(self) -> None:
        if self._done is not None and not self._done.done():
            self._peer.run(self._end(), timeout=self._close_timeout)
