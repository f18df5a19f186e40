"""A LocalSwarm target for the dial filter's attack test: a DHT node that can also run a
canary (a plain TCP listener on this namespace's loopback that counts who connects) and
dial a peer by its PeerID alone, from what its address book learned.

Options: ``"initial_peers"``: where its DHT joins (none: it is the first).

Commands (JSON from the test, each answered by one report):
- ``{"cmd": "canary"}``: start the canary; report its port;
- ``{"cmd": "canary_count"}``: report how many connections the canary accepted;
- ``{"cmd": "ping", "peer_id": P}``: dial P by its PeerID and ping it; report whether
  it worked and the error if not;
- ``{"cmd": "statistics"}``: our peer's statistics.
"""

from __future__ import annotations

import asyncio
import dataclasses

from peers.dht.node import DHT, DHTConfig
from peers.errors import PeersError
from peers.identity import PeerID
from peers.testing import Node

#: Seconds the victim's dial may take: the addresses it tries lead nowhere fast.
PING_SECONDS = 10.0


async def dial_probe_peer(node: Node) -> None:
    accepted = 0

    async def on_canary(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.close()

    canary: asyncio.Server | None = None
    config = DHTConfig(initial_peers=tuple(node.options.get("initial_peers", ())))
    async with DHT(node.peer, config):
        node.report({"event": "dht_ready"})
        try:
            while True:
                command = await node.receive()
                if command["cmd"] == "canary":
                    canary = await asyncio.start_server(on_canary, "127.0.0.1", 0)
                    port = canary.sockets[0].getsockname()[1]
                    node.report({"event": "canary", "port": port})
                elif command["cmd"] == "canary_count":
                    node.report({"event": "canary_count", "count": accepted})
                elif command["cmd"] == "ping":
                    try:
                        async with asyncio.timeout(PING_SECONDS):
                            await node.peer.ping(PeerID.from_base58(command["peer_id"]))
                        node.report({"event": "pinged", "ok": True})
                    except (PeersError, TimeoutError) as e:
                        node.report({"event": "pinged", "ok": False, "error": repr(e)})
                elif command["cmd"] == "statistics":
                    stats = dataclasses.asdict(node.peer.statistics())
                    node.report({"event": "statistics", **stats})
        finally:
            if canary is not None:
                canary.close()
