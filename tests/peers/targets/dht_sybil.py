"""A LocalSwarm target for the DHT Sybil test: a DHT node that reports where its
routing table's contacts come from, and can start many more identities of its own (on
this process's one address) that join a victim and store records at it.

Options: ``"initial_peers"``: where its DHT joins (none: it is the first).

Commands (JSON from the test, each answered by one report):
- ``{"cmd": "table"}``: this node's DHT statistics, and its contacts' PeerIDs;
- ``{"cmd": "sybils", "count": N, "victim": ADDR, "records": R}``: start N identities,
  each a DHT node joined through ADDR, then each stores R records of its own straight
  at the victim; report the PeerIDs and how many records the victim accepted.
- ``{"cmd": "eclipse", "count": N, "key": KEY, "via": ADDR}``: start N identities whose
  node ids are ground near KEY's, joined through ADDR, that swallow stores (accepted,
  dropped), hold no value, and name only each other as the nodes nearest any target;
  report their PeerIDs.
- ``{"cmd": "store", "key": KEY, "value": V}`` and ``{"cmd": "get", "key": KEY}``: this
  node's store (reporting whether it was accepted and the PeerIDs of the key's nearest
  nodes its lookup found) and get (reporting the value, or None).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

from peers.addresses import parse_multiaddr, split_peer_id
from peers.config import PeerConfig
from peers.dht.ids import ID_BITS, Contact, distance, key_id, node_id_of
from peers.dht.node import DHT, DHTConfig, dht_time
from peers.dht.protocol import (
    STORE_PROTOCOL,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    StoreRequest,
    StoreResponse,
    WireRecord,
    contact_to_wire,
)
from peers.host import Peer
from peers.identity import KeyPair
from peers.rpc import CallContext
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


#: Leading bits an eclipsing id shares with the key's id: nearer than the honest nodes
#: of a small swarm (a random id shares 8 with probability 1/256), at ~256 key pairs
#: (~11 ms) per id.
GROUND_BITS = 8


class _Eclipser(DHT):
    """A hostile node near a key: it swallows stores, holds no value, and names only
    its fellows (``fellows``, filled once all exist) as the nodes nearest any target."""

    fellows: list[Contact]

    def _fellows_near(self, target: int) -> list[Contact]:
        return sorted(self.fellows, key=lambda c: distance(c.node_id, target))[: self.config.k]

    async def rpc_find_node(
        self, request: FindNodeRequest, context: CallContext
    ) -> FindNodeResponse:
        target = int.from_bytes(request.target, "big")
        return FindNodeResponse([contact_to_wire(c) for c in self._fellows_near(target)])

    async def rpc_find_value(
        self, request: FindValueRequest, context: CallContext
    ) -> FindValueResponse:
        nearest = self._fellows_near(key_id(request.key))
        return FindValueResponse([], [contact_to_wire(c) for c in nearest], False)

    async def rpc_store(self, request: StoreRequest, context: CallContext) -> StoreResponse:
        return StoreResponse([True] * len(request.records))


def _ground_identity(key: str) -> KeyPair:
    target = key_id(key.encode())
    while True:
        identity = KeyPair.generate()
        if distance(node_id_of(identity.peer_id), target) >> (ID_BITS - GROUND_BITS) == 0:
            return identity


async def _eclipse(stack: contextlib.AsyncExitStack, command: dict[str, object]) -> list[str]:
    joined = DHTConfig(initial_peers=(str(command["via"]),))
    made: list[_Eclipser] = []
    fellows: list[Contact] = []
    for _ in range(int(str(command["count"]))):
        config = PeerConfig(
            identity=_ground_identity(str(command["key"])), listen_addrs=("/ip4/0.0.0.0/tcp/0",)
        )
        peer = await stack.enter_async_context(Peer(config))
        eclipser = _Eclipser(peer, joined)
        eclipser.fellows = fellows
        fellows.append(Contact(peer.peer_id, tuple(str(a) for a in peer.listen_addrs)))
        made.append(await stack.enter_async_context(eclipser))
    return [str(d.peer.peer_id) for d in made]


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
            elif command["cmd"] == "eclipse":
                node.report({"event": "eclipse", "peer_ids": await _eclipse(sybils, command)})
            elif command["cmd"] == "store":
                key = str(command["key"])
                stored = await dht.store(key, command["value"], dht_time() + 600)
                nearest = await dht.find_nearest(key_id(key.encode()), dht.config.num_replicas)
                near = [str(c.peer_id) for c in nearest]
                node.report({"event": "store", "accepted": stored, "nearest": near})
            elif command["cmd"] == "get":
                found = await dht.get(str(command["key"]))
                value = getattr(found, "value", None)
                node.report({"event": "get", "value": value})
