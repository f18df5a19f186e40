"""A :mod:`peers.testing` target that runs a DHT node driven by commands from the test.

``LocalSwarm().start(n, target="peers.dht.testing:dht_node", options={...})`` starts n
DHT nodes; options: ``initial_peers`` (list of multiaddrs), ``client_mode``,
``rpc_timeout``, ``maintenance_interval``. Each reports ``joined``, then serves commands
sent with ``PeerProcess.send``, answering each with one report:

- ``{"op": "store", "items": [[key, value], ...], "ttl": s}`` -> ``stored`` with ``ok``
  (how many stores at least one replica accepted);
- ``{"op": "get", "keys": [...], "timeout": s}`` -> ``got`` with ``values`` (key ->
  value or null), ``max_seconds`` (slowest get) and ``timeouts``;
- ``{"op": "nearest", "targets": [hex ids], "count": k}`` -> ``nearest`` with the
  PeerIDs found for each target;
- ``{"op": "stats"}`` -> ``stats``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from peers.dht.node import DHT, DHTConfig, ValueWithExpiration, dht_time
from peers.testing import Node

#: Gets (and stores) run at once per command: enough to overlap lookups, few enough for
#: a 2-core machine running dozens of nodes. Unbounded, a writer's 125 stores at once
#: time out at slow replicas and a record lands on fewer of its replicas than it should.
CONCURRENT_GETS = 16


async def _timed_get(dht: DHT, key: str, timeout: float) -> tuple[str, Any, float, bool]:
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            found = await dht.get(key)
    except TimeoutError:
        return key, None, time.perf_counter() - started, True
    value = found.value if isinstance(found, ValueWithExpiration) else None
    return key, value, time.perf_counter() - started, False


async def _get_many(
    dht: DHT, keys: list[str], timeout: float
) -> list[tuple[str, Any, float, bool]]:
    semaphore = asyncio.Semaphore(CONCURRENT_GETS)

    async def one(key: str) -> tuple[str, Any, float, bool]:
        async with semaphore:
            return await _timed_get(dht, key, timeout)

    return list(await asyncio.gather(*(one(k) for k in keys)))


async def _store_many(dht: DHT, items: list[list[Any]], ttl: float) -> list[bool]:
    semaphore = asyncio.Semaphore(CONCURRENT_GETS)

    async def one(key: str, value: Any) -> bool:
        async with semaphore:
            return await dht.store(key, value, dht_time() + ttl)

    return list(await asyncio.gather(*(one(k, v) for k, v in items)))


async def dht_node(node: Node) -> None:
    options = node.options
    config = DHTConfig(
        initial_peers=tuple(options.get("initial_peers", ())),
        client_mode=options.get("client_mode"),
        rpc_timeout=float(options.get("rpc_timeout", 2.0)),
        maintenance_interval=float(options.get("maintenance_interval", 15.0)),
    )
    async with DHT(node.peer, config) as dht:
        node.report({"event": "joined", "contacts": len(dht.routing)})
        while True:
            command = await node.receive()
            op = command.get("op")
            if op == "store":
                ttl = float(command.get("ttl", 600))
                results = await _store_many(dht, command["items"], ttl)
                node.report({"event": "stored", "ok": sum(results)})
            elif op == "get":
                got = await _get_many(dht, command["keys"], float(command.get("timeout", 10)))
                node.report(
                    {
                        "event": "got",
                        "values": {key: value for key, value, _, _ in got},
                        "max_seconds": max((seconds for _, _, seconds, _ in got), default=0.0),
                        "timeouts": sum(1 for *_, timed_out in got if timed_out),
                    }
                )
            elif op == "nearest":
                count = int(command.get("count", config.k))
                found = []
                for target in command["targets"]:
                    contacts = await dht.find_nearest(int(target, 16))
                    found.append([str(c.peer_id) for c in contacts[:count]])
                node.report({"event": "nearest", "found": found})
            elif op == "stats":
                stats = dht.statistics()
                node.report(
                    {"event": "stats", "contacts": stats.num_contacts, "records": stats.num_records}
                )
