"""A blocking DHT for scripts that are not async: three lines to join and share state.

dht = BlockingDHT(initial_peers=["/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."])
dht.store("progress", {"step": 120}, ttl=60)
print(dht.get("progress"))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence

from peers.closing import ClosesOnExit
from peers.config import PeerConfig
from peers.dht.node import DHT, DHTConfig, DHTStatistics, ValueWithExpiration, dht_time
from peers.facade import BlockingPeer

logger = logging.getLogger(__name__)
#: Seconds ``close`` waits for the node to leave before closing the peer under it.
CLOSE_TIMEOUT_SECONDS = 10.0


class BlockingDHT(ClosesOnExit):
    """A DHT node on its own :class:`BlockingPeer`; every call blocks until done."""

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        *,
        config: DHTConfig | None = None,
        peer_config: PeerConfig | None = None,
    ) -> None:
        if config is None:
            config = DHTConfig(initial_peers=tuple(str(a) for a in initial_peers))
        self._peer = BlockingPeer(peer_config)
        self._ready: concurrent.futures.Future[DHT] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._holder = self._peer.submit(self._hold(config))
        try:
            self._dht = self._ready.result()
        except Exception:
            self._peer.close()
            raise

    async def _hold(self, config: DHTConfig) -> None:
        self._stop = asyncio.Event()
        try:
            async with DHT(self._peer.peer, config) as dht:
                self._ready.set_result(dht)
                await self._stop.wait()
        except Exception as e:
            if not self._ready.done():
                self._ready.set_exception(e)
            else:
                raise

    @property
    def node(self) -> DHT:
        """The async DHT (use it only from coroutines passed to ``peer.run``)."""
        return self._dht

    @property
    def peer(self) -> BlockingPeer:
        return self._peer

    def store(
        self,
        key: str | bytes,
        value: object,
        expiration_time: float | None = None,
        *,
        ttl: float | None = None,
        subkey: str | bytes | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Store until ``expiration_time`` (wall clock) or for ``ttl`` seconds."""
        if (expiration_time is None) == (ttl is None):
            raise ValueError("give exactly one of expiration_time and ttl")
        expires = expiration_time if expiration_time is not None else dht_time() + (ttl or 0)
        return self._peer.run(self._dht.store(key, value, expires, subkey=subkey), timeout)

    def get(
        self, key: str | bytes, *, latest: bool = True, timeout: float | None = None
    ) -> ValueWithExpiration | dict[bytes, ValueWithExpiration] | None:
        """See :meth:`DHT.get`."""
        return self._peer.run(self._dht.get(key, latest=latest), timeout)

    def statistics(self) -> DHTStatistics:
        return self._dht.statistics()

    def close(self) -> None:
        """Leave the DHT and close the peer. Idempotent."""
        if self._stop is not None and not self._holder.done():
            self._peer.run(self._request_stop())
            try:
                self._holder.result(CLOSE_TIMEOUT_SECONDS)
            except Exception as e:  # leaving must not fail: say so and close the peer
                logger.warning("the DHT did not leave cleanly: %r", e)
        self._peer.close()

    async def _request_stop(self) -> None:
        assert self._stop is not None
        self._stop.set()
