"""A stage server for plain (non-async) scripts.

``BlockingStageServer(dht, config)`` runs a :class:`StageServer` on the event loop
thread of a :class:`peers.dht.BlockingDHT`: the constructor returns once the stage is
served, ``close()`` (or leaving the ``with`` block) stops serving. The DHT node stays
open: its owner closes it.
"""

from __future__ import annotations

from peers.closing import ClosesOnExit
from peers.dht import BlockingDHT
from peers.facade import BackgroundService
from swarm.pipeline.server import StageServer, StageServerConfig, StageServerStatistics

#: Seconds ``close`` waits for the server to stop (a replica round in progress ends).
CLOSE_TIMEOUT_SECONDS = 30.0


class BlockingStageServer(ClosesOnExit):
    """Serves a stage until closed. Raises what :meth:`StageServer.run` raises on start,
    and TimeoutError if no stage is served within ``start_timeout`` seconds."""

    def __init__(
        self, dht: BlockingDHT, config: StageServerConfig, *, start_timeout: float = 120.0
    ) -> None:
        self.server = StageServer(dht.node, config)
        self._service = BackgroundService(
            dht.peer,
            lambda stop, ready: self.server.run(stop, lambda _: ready()),
            start_timeout=start_timeout,
            close_timeout=CLOSE_TIMEOUT_SECONDS,
        )

    @property
    def stage(self) -> int | None:
        return self.server.stage

    def statistics(self) -> StageServerStatistics:
        return self.server.statistics()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._service.close()
