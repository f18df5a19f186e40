"""An expert server for plain (non-async) scripts.

``BlockingExpertServer(backends, dht=blocking_dht)`` hosts the modules on the event
loop thread of a :class:`peers.dht.BlockingDHT` (announcing them there) or of a
:class:`peers.BlockingPeer` (no announcements): the constructor returns once they are
served, ``close()`` (or leaving the ``with`` block) stops serving. The node itself stays
open: its owner closes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from peers.closing import ClosesOnExit
from peers.dht import BlockingDHT
from peers.facade import BackgroundService, BlockingPeer
from swarm.experts.backend import ModuleBackend
from swarm.experts.server import ExpertServer, ServerStatistics
from swarm.experts.server_config import ServerConfig

#: Seconds ``close`` waits for the server to stop.
CLOSE_TIMEOUT_SECONDS = 10.0


class BlockingExpertServer(ClosesOnExit):
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
        self._service = BackgroundService(
            self._peer, self._host, start_timeout=start_timeout, close_timeout=CLOSE_TIMEOUT_SECONDS
        )

    async def _host(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        async with self.server:
            ready()
            await stop.wait()

    def statistics(self) -> ServerStatistics:
        return self.server.statistics()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._service.close()
