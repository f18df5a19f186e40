"""An expert server for plain (non-async) scripts.

``BlockingExpertServer(backends, dht=blocking_dht)`` hosts the modules on the event
loop thread of a :class:`peers.dht.BlockingDHT` (announcing them there) or of a
:class:`peers.BlockingPeer` (no announcements): the constructor returns once they are
served, ``close()`` (or leaving the ``with`` block) stops serving. The node itself stays
open: its owner closes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType

from peers.dht import BlockingDHT
from peers.facade import BlockingPeer
from swarm.experts.backend import ModuleBackend
from swarm.experts.server import ExpertServer, ServerStatistics
from swarm.experts.server_config import ServerConfig

#: Seconds ``close`` waits for the server to stop.
CLOSE_TIMEOUT_SECONDS = 10.0


class BlockingExpertServer:
    """Serves ``backends`` until closed. Raises what :class:`ExpertServer` raises on
    entry, and TimeoutError if it does not start within ``start_timeout`` seconds."""

    def __init__(
        self,
        backends: Sequence[ModuleBackend],
        config: ServerConfig | None = None,
        *,
        dht: BlockingDHT | None = None,
        peer: BlockingPeer | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        if (dht is None) == (peer is None):
            raise ValueError("give either a BlockingDHT (to announce) or a BlockingPeer")
        node = dht.peer if dht is not None else peer
        assert node is not None
        self._peer: BlockingPeer = node
        self.server = ExpertServer(
            self._peer.peer, backends, config, dht=None if dht is None else dht.node
        )
        self._stop: asyncio.Event | None = None
        self._done: asyncio.Future[None] | None = None
        self._peer.run(self._begin(), timeout=start_timeout)

    async def _begin(self) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._stop = asyncio.Event()
        self._done = asyncio.ensure_future(self._host(ready))
        await asyncio.wait([ready, self._done], return_when=asyncio.FIRST_COMPLETED)
        if self._done.done():
            self._done.result()  # it failed to start: raise why

    async def _host(self, ready: asyncio.Future[None]) -> None:
        assert self._stop is not None
        async with self.server:
            ready.set_result(None)
            await self._stop.wait()

    async def _end(self) -> None:
        assert self._stop is not None and self._done is not None
        self._stop.set()
        await self._done

    def statistics(self) -> ServerStatistics:
        return self.server.statistics()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._done is not None and not self._done.done():
            self._peer.run(self._end(), timeout=CLOSE_TIMEOUT_SECONDS)

    def __enter__(self) -> BlockingExpertServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
