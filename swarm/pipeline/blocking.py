"""A stage server for plain (non-async) scripts.

``BlockingStageServer(dht, config)`` runs a :class:`StageServer` on the event loop
thread of a :class:`peers.dht.BlockingDHT`: the constructor returns once the stage is
served, ``close()`` (or leaving the ``with`` block) stops serving. The DHT node stays
open: its owner closes it.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from peers.dht import BlockingDHT
from swarm.pipeline.server import StageServer, StageServerConfig, StageServerStatistics

#: Seconds ``close`` waits for the server to stop (a replica round in progress ends).
CLOSE_TIMEOUT_SECONDS = 30.0


class BlockingStageServer:
    """Serves a stage until closed. Raises what :meth:`StageServer.run` raises on start,
    and TimeoutError if no stage is served within ``start_timeout`` seconds."""

    def __init__(
        self, dht: BlockingDHT, config: StageServerConfig, *, start_timeout: float = 120.0
    ) -> None:
        self._peer = dht.peer
        self.server = StageServer(dht.node, config)
        self._stop: asyncio.Event | None = None
        self._done: asyncio.Future[None] | None = None
        self._peer.run(self._begin(), timeout=start_timeout)

    async def _begin(self) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def on_ready(_: StageServer) -> None:
            if not ready.done():
                ready.set_result(None)

        self._stop = asyncio.Event()
        self._done = asyncio.ensure_future(self.server.run(self._stop, on_ready))
        await asyncio.wait([ready, self._done], return_when=asyncio.FIRST_COMPLETED)
        if self._done.done():
            self._done.result()  # it failed to start: raise why

    async def _end(self) -> None:
        assert self._stop is not None and self._done is not None
        self._stop.set()
        await self._done

    @property
    def stage(self) -> int | None:
        return self.server.stage

    def statistics(self) -> StageServerStatistics:
        return self.server.statistics()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._done is not None and not self._done.done():
            self._peer.run(self._end(), timeout=CLOSE_TIMEOUT_SECONDS)

    def __enter__(self) -> BlockingStageServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
