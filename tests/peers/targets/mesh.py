"""A LocalSwarm target: serve echo, join the bootstrap peer, then call every other peer."""

from __future__ import annotations

import asyncio

import numpy as np

from peers.echo import ECHO_PROTOCOL_ID, ECHO_STREAM_PROTOCOL_ID, install_echo
from peers.testing import Node


def expected_arrays(sender: str, receiver: str) -> list[np.ndarray]:
    # Seeded by both ids, so the arrays differ per pair and are reproducible.
    rng = np.random.default_rng(
        [int.from_bytes(s.encode()[-8:], "big") for s in (sender, receiver)]
    )
    return [rng.random(rng.integers(1, 200_000)).astype(np.float32) for _ in range(3)]


async def mesh(node: Node) -> None:
    peer = node.peer
    install_echo(peer)
    for addr in node.options["bootstrap"]:
        await peer.connect(addr)
    node.report({"event": "joined"})
    others: list[str] = (await node.receive())["peers"]
    me = str(peer.peer_id)

    async def check(addr: str) -> tuple[str, bool]:
        text = f"from {me} to {addr}"
        reply = await peer.call_unary(addr, ECHO_PROTOCOL_ID, text, str, timeout=60)
        arrays = expected_arrays(me, addr)
        echoed = [
            a
            async for a in peer.call_stream(
                addr, ECHO_STREAM_PROTOCOL_ID, arrays, np.ndarray, timeout=60
            )
        ]
        ok = (
            reply == text
            and len(echoed) == len(arrays)
            and all(np.array_equal(x, y) for x, y in zip(arrays, echoed, strict=True))
        )
        return addr, ok

    results = await asyncio.gather(*(check(a) for a in others), return_exceptions=True)
    node.report(
        {
            "event": "results",
            "ok": sum(1 for r in results if isinstance(r, tuple) and r[1]),
            "failed": [repr(r) for r in results if not (isinstance(r, tuple) and r[1])],
            "connections": peer.statistics().num_connections,
        }
    )
