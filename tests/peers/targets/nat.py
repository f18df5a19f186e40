"""A LocalSwarm target for the NAT lab: join the given peers, then answer commands.

Commands (JSON from the test, each answered by one report):
- ``{"cmd": "wait", "reachability": R, "min_relays": N, "timeout": S}``: wait until our
  reachability is R and we hold at least N relay reservations; report our status.
- ``{"cmd": "status"}``: report our status.
- ``{"cmd": "dial", "addr": A, "direct_within": S}``: connect to A, wait up to S seconds
  for the connection to become direct (hole punching), ping, report how we are connected.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np

from peers.addresses import parse_multiaddr, split_peer_id
from peers.echo import ECHO_STREAM_PROTOCOL_ID, install_echo
from peers.errors import PeersError
from peers.testing import Node


def status(node: Node) -> dict[str, Any]:
    peer = node.peer
    nat = peer.nat.statistics()
    conns = {}
    for pid in peer.connected_peers():
        conn = peer.connection_to(pid)
        if conn is not None:
            conns[str(pid)] = "relayed" if conn.relayed else "direct"
    return {
        "event": "status",
        "reachability": nat.reachability.value,
        "mapping": nat.mapping.value,
        "listen_addrs": [str(a) for a in peer.listen_addrs],
        "circuit_addrs": [str(a) for a in peer.circuit_addrs],
        "observed_addrs": [str(a) for a in nat.observed_addrs],
        "relays": [str(r) for r in nat.relays],
        "connections": conns,
        "hole_punches": [
            {"remote": str(r.remote), "success": r.success, "attempts": r.attempts}
            for r in peer.nat.hole_punch_results
        ],
        "relayed_bytes": (
            peer.nat.relay_service.statistics().num_relayed_bytes
            if peer.nat.relay_service is not None
            else 0
        ),
    }


async def nat_peer(node: Node) -> None:
    peer = node.peer
    install_echo(peer)
    for addr in node.options.get("bootstrap", []):
        await peer.connect(addr)
    node.report({"event": "joined"})
    while True:
        command = await node.receive()
        if command["cmd"] == "status":
            node.report(status(node))
        elif command["cmd"] == "wait":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(command["timeout"]):
                    while not (
                        peer.nat.reachability.value == command["reachability"]
                        and command.get("min_relays", 0)
                        <= len(peer.nat.relays)
                        <= command.get("max_relays", 1 << 30)
                    ):
                        await peer.nat.wait_changed()
            node.report(status(node))
        elif command["cmd"] == "dial":
            node.report(await dial(node, command["addr"], command.get("direct_within", 0.0)))


async def dial(node: Node, addr: str, direct_within: float) -> dict[str, Any]:
    peer = node.peer
    _, remote = split_peer_id(parse_multiaddr(addr))
    assert remote is not None, addr
    try:
        await peer.connect(addr)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(direct_within):
                while (conn := peer.connection_to(remote)) is None or conn.relayed:
                    await peer.nat.wait_changed()
        conn = peer.connection_to(remote)
        rtt = await peer.ping(remote)
        payload = [np.arange(250_000, dtype=np.float32)]  # 1 MB each way
        echoed = [
            x
            async for x in peer.call_stream(
                remote, ECHO_STREAM_PROTOCOL_ID, payload, np.ndarray, timeout=30
            )
        ]
        return {
            "event": "dialed",
            "ok": len(echoed) == 1 and bool(np.array_equal(echoed[0], payload[0])),
            "relayed": conn is not None and conn.relayed,
            "rtt": rtt,
        }
    except PeersError as e:
        return {"event": "dialed", "ok": False, "error": repr(e)}
