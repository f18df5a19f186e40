"""A LocalSwarm target for the DHT Sybil test: a DHT node that reports where its
routing table's contacts come from, and can start many more identities of its own (on
this process's one address) that join a victim and store records at it.

Options: ``"initial_peers"``: where its DHT joins (none: it is the first).

Commands (JSON from the test, each answered by one report):
- ``{"cmd": "table"}``: this node's DHT statistics, and its contacts' PeerIDs;
- ``{"cmd": "sybils", "count": N, "victim": ADDR, "records": R}``: start N identities,
  each a DHT node joined through ADDR, then each stores R records of its own straight
  at the victim; report the PeerIDs and how many records the victim accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

from peers.addresses import parse_multiaddr, split_peer_id
from peers.config import PeerConfig
from peers.dht.node import DHT, DHTConfig, dht_time
from peers.dht.protocol import STORE_PROTOCOL, StoreRequest, StoreResponse, WireRecord
from peers.host import Peer
from peers.serialization import pack
from peers.testing import Node

#: Seconds each RPC of the test may take.
RPC_SECONDS = 20.0
#: Records per store request (under the protocol's 1,024).
BATCH = 200


async def _store_at(dht: DHT, victim: str, count: int) -> int:
    _, victim_id = split_peer_id(parse_multiaddr(victim))
    assert victim_id is not None
    accepted = 0
    for start in range(0, count, BATCH):
        records = [
            WireRecord(os.urandom(16), None, pack(i), dht_time() + 600)
            for i in range(start, min(count, start + BATCH))
        ]
        response = await dht.peer.call_unary(
            victim_id,
            STORE_PROTOCOL,
            StoreRequest(dht._sender(), records),
            StoreResponse,
            timeout=RPC_SECONDS,
        )
        accepted += sum(response.accepted)
    return accepted


async def dht_node(node: Node) -> None:
    config = DHTConfig(initial_peers=tuple(node.options.get("initial_peers", ())))
    async with DHT(node.peer, config) as dht, contextlib.AsyncExitStack() as sybils:
        node.report({"event": "dht_ready"})
        while True:
            command = await node.receive()
            if command["cmd"] == "table":
                stats = dataclasses.asdict(dht.statistics())
                contacts = [str(c.peer_id) for c in dht.routing.contacts()]
                node.report({"event": "table", "contacts": contacts, **stats})
            elif command["cmd"] == "sybils":
                joined = DHTConfig(initial_peers=(command["victim"],))
                made: list[DHT] = []
                for _ in range(command["count"]):
                    peer = await sybils.enter_async_context(
                        Peer(PeerConfig(listen_addrs=("/ip4/0.0.0.0/tcp/0",)))
                    )
                    made.append(await sybils.enter_async_context(DHT(peer, joined)))
                accepted = await asyncio.gather(
                    *(_store_at(d, command["victim"], command["records"]) for d in made)
                )
                node.report(
                    {
                        "event": "sybils",
                        "peer_ids": [str(d.peer.peer_id) for d in made],
                        "accepted": sum(accepted),
                    }
                )
