"""``swarm dashboard``: join as a client, read the swarm every few seconds, serve the page."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from peers.dht import DHT
from peers.errors import PeersError
from swarm.dashboard.history import History
from swarm.dashboard.server import DashboardServer
from swarm.status import gather_view

logger = logging.getLogger(__name__)

#: Seconds between two reads of the swarm's status records by default: peers publish
#: every 10 s, so a faster read mostly shows the same records again.
DEFAULT_REFRESH_SECONDS = 2.0


async def follow_swarm(
    dht: DHT,
    server: DashboardServer,
    stop: asyncio.Event,
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    through: str = "",
) -> None:
    """Read the swarm through ``dht`` every ``refresh_seconds`` and publish each view,
    with its history, to ``server`` until ``stop`` is set. A read that fails is logged
    and the page keeps the previous view."""
    history = History()
    while not stop.is_set():
        try:
            view = await gather_view(dht)
        except PeersError as e:
            logger.warning("reading the swarm failed: %s", e)
        else:
            history.update(view, time.time())
            server.publish(
                {
                    "view": view.to_json(),
                    "history": history.to_json(),
                    "refresh_seconds": refresh_seconds,
                    "through": through,
                }
            )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(refresh_seconds):
                await stop.wait()
