"""The peer processes of bench_nat.py: a ``peers.testing`` target answering commands.

Commands (one JSON object each, answered by one report):
- ``{"cmd": "wait_relays", "n": N, "timeout": S}``: until we hold N relay reservations.
- ``{"cmd": "dial", "addr": A, "direct_within": S, "fresh": F}``: connect (first closing
  any connection to that peer if F), wait up to S seconds for a direct connection (hole
  punching); report whether it became direct and when.
- ``{"cmd": "bulk", "peer": ID, "num_bytes": N}``: send N bytes on one stream to the
  peer's sink, which answers with the count it received; report the seconds.
- ``{"cmd": "ping", "peer": ID, "n": K}``: K pings; report the round trips.
- ``{"cmd": "cpu"}``: this process's CPU seconds so far.
- ``{"cmd": "punches"}``: the hole punches this peer ran (it accepted relayed connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

from peers.addresses import parse_multiaddr, split_peer_id
from peers.connection import Stream
from peers.identity import PeerID
from peers.testing import Node

SINK_PROTOCOL_ID = "/swarmtrain/bench-sink/1.0.0"
#: Bytes written per call: one /noise frame's worth, many in flight.
WRITE_BYTES = 1 << 20


async def _sink(stream: Stream) -> None:
    total = 0
    while data := await stream.read():
        total += len(data)
    await stream.write(str(total).encode())
    await stream.close()


async def bench_peer(node: Node) -> None:
    peer = node.peer
    peer.set_stream_handler(SINK_PROTOCOL_ID, _sink)
    for addr in node.options.get("bootstrap", []):
        await peer.connect(addr)
    node.report(
        {"event": "joined", "bound": [str(a) for a in peer.bound_addrs()], "pid": os.getpid()}
    )
    while True:
        command = await node.receive()
        node.report(await _handle(node, command))


async def _until(node: Node, condition: Any, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while not condition():
                await node.peer.nat.wait_changed()


async def _handle(node: Node, command: dict[str, Any]) -> dict[str, Any]:
    peer = node.peer
    name = command["cmd"]
    if name == "wait_relays":
        await _until(node, lambda: len(peer.nat.relays) >= command["n"], command["timeout"])
        return {"event": name, "circuit_addrs": [str(a) for a in peer.circuit_addrs]}
    if name == "dial":
        if command.get("fresh"):  # a new circuit: the relay's data limit is per circuit
            _, named = split_peer_id(parse_multiaddr(command["addr"]))
            if named is not None:
                peer.disconnect(named)
        started = time.perf_counter()
        remote = await peer.connect(command["addr"])
        connected = time.perf_counter() - started

        def direct() -> bool:
            conn = peer.connection_to(remote)
            return conn is not None and not conn.relayed

        await _until(node, direct, command.get("direct_within", 0.0))
        return {
            "event": name,
            "connect_seconds": connected,
            "direct": direct(),
            "direct_after_seconds": time.perf_counter() - started,
        }
    if name == "bulk":
        target = PeerID.from_base58(command["peer"])
        chunk = b"\x00" * WRITE_BYTES
        started = time.perf_counter()
        stream = await peer.new_stream(target, SINK_PROTOCOL_ID)
        left = command["num_bytes"]
        while left > 0:
            piece = chunk if left >= WRITE_BYTES else chunk[:left]
            await stream.write(piece)
            left -= len(piece)
        await stream.close()
        reply = b""
        while data := await stream.read():
            reply += data
        seconds = time.perf_counter() - started
        conn = peer.connection_to(target)
        return {
            "event": name,
            "seconds": seconds,
            "received": int(reply),
            "relayed": conn is not None and conn.relayed,
        }
    if name == "ping":
        target = PeerID.from_base58(command["peer"])
        return {"event": name, "rtts": [await peer.ping(target) for _ in range(command["n"])]}
    if name == "cpu":
        times = os.times()
        return {"event": name, "seconds": times.user + times.system}
    if name == "punches":
        return {
            "event": name,
            "punches": [
                {"success": r.success, "attempts": r.attempts, "seconds": r.seconds}
                for r in peer.nat.hole_punch_results
            ],
        }
    return {"event": "error", "error": f"unknown command {name!r}"}
