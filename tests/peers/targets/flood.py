"""A LocalSwarm target for handshake floods: a victim that reports its statistics, and
a flooder that opens connections and runs whole connection upgrades as fast as it can.

Commands (JSON from the test, each answered by one report):
- ``{"cmd": "statistics"}``: our peer's statistics;
- ``{"cmd": "flood", "addr": A, "count": N, "concurrency": C}``: N upgrades to A's
  TCP address, C at a time; report how many completed, how many were refused, and
  the seconds the flood took; with ``"seconds": S`` instead of a count, upgrades go on
  (C at a time) until S seconds have passed;
- ``{"cmd": "ping", "addr": A}``: connect to A (a full multiaddr) and ping it; report
  whether it worked and the seconds it took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

from peers.addresses import parse_multiaddr, tcp_target
from peers.errors import PeersError
from peers.identity import KeyPair
from peers.testing import Node
from peers.upgrade import upgrade

#: Seconds one flooding upgrade may take before it counts as refused.
UPGRADE_SECONDS = 5.0


async def _one_upgrade(host: str, port: int) -> bool:
    try:
        async with asyncio.timeout(UPGRADE_SECONDS):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                # a fresh identity each time: a flooder has as many as it likes
                await upgrade(reader, writer, identity=KeyPair.generate(), outbound=True)
                return True
            finally:
                writer.close()
    except (PeersError, OSError, TimeoutError, asyncio.IncompleteReadError):
        return False


async def flood(
    addr: str, concurrency: int, count: int | None = None, seconds: float | None = None
) -> dict[str, Any]:
    target = tcp_target(parse_multiaddr(addr))
    started = time.monotonic()
    deadline = started + seconds if seconds is not None else math.inf
    todo = count if count is not None else math.inf
    results: list[bool] = []

    async def worker() -> None:
        nonlocal todo
        while todo > 0 and time.monotonic() < deadline:
            todo -= 1
            results.append(await _one_upgrade(target.host, target.port))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    completed = sum(results)
    took = time.monotonic() - started
    return {"completed": completed, "refused": len(results) - completed, "seconds": took}


async def flood_peer(node: Node) -> None:
    peer = node.peer
    node.report({"event": "ready"})
    while True:
        command = await node.receive()
        if command["cmd"] == "statistics":
            node.report({"event": "statistics", **dataclasses.asdict(peer.statistics())})
        elif command["cmd"] == "flood":
            result = await flood(
                command["addr"],
                command["concurrency"],
                count=command.get("count"),
                seconds=command.get("seconds"),
            )
            node.report({"event": "flooded", **result})
        elif command["cmd"] == "ping":
            started = time.monotonic()
            try:
                remote = await peer.connect(command["addr"])
                await peer.ping(remote)
                took = time.monotonic() - started
                node.report({"event": "pinged", "ok": True, "seconds": took})
            except PeersError as e:
                node.report({"event": "pinged", "ok": False, "error": repr(e)})
