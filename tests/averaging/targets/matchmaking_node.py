"""A LocalSwarm target: a DHT node with a :class:`Matchmaker`, searching when told.

Options: ``initial_peers`` (multiaddrs), ``config`` (``MatchmakingConfig`` fields).
Start it with ``"listen": []`` for a client-mode peer. Reports ``joined``, then for each
``{"op": "look", "key": k, "timeout": s}`` reports ``group`` (``round_id`` hex,
``members``, ``client_mode``, whether every member's metadata is its own PeerID, and
``seconds``) or ``failed`` (``error``, ``seconds``).
"""

from __future__ import annotations

import asyncio

from averaging.matchmaking.matchmaker import Matchmaker
from averaging.matchmaking.records import MatchmakingConfig, MatchmakingError
from peers.dht.node import DHT, DHTConfig
from peers.testing import Node


async def matchmaking_node(node: Node) -> None:
    options = node.options
    dht_config = DHTConfig(
        initial_peers=tuple(options.get("initial_peers", ())),
        rpc_timeout=2.0,
        maintenance_interval=3600.0,
    )
    config = MatchmakingConfig(**options.get("config", {}))
    me = str(node.peer.peer_id)
    async with DHT(node.peer, dht_config) as dht, Matchmaker(dht, config) as matchmaker:
        node.report({"event": "joined", "client_mode": dht.client_mode})
        loop = asyncio.get_running_loop()
        while True:
            command = await node.receive()
            if command.get("op") != "look":
                continue
            key = command["key"]
            started = loop.time()
            try:
                group = await matchmaker.look_for_group(
                    key, metadata=me.encode(), timeout=command.get("timeout")
                )
            except MatchmakingError as e:
                node.report(
                    {
                        "event": "failed",
                        "key": key,
                        "error": str(e),
                        "seconds": loop.time() - started,
                    }
                )
                continue
            node.report(
                {
                    "event": "group",
                    "key": key,
                    "round_id": group.round_id.hex(),
                    "members": [str(m) for m in group.members],
                    "client_mode": list(group.client_mode),
                    "metadata_ok": all(
                        meta == str(m).encode()
                        for m, meta in zip(group.members, group.metadata, strict=True)
                    ),
                    "seconds": loop.time() - started,
                }
            )
