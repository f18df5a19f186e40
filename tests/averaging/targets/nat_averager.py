"""A LocalSwarm target for the NAT lab: a DHT peer with an Averager, driven by commands.

Options: ``initial_peers``, ``rank``, ``elements``, ``group_size``, and the round's
``sender_timeout``, ``reducer_timeout``, ``round_timeout``. Commands, each answered by one
report:

- ``{"op": "wait_nat", "timeout": S}``: until we know our reachability and, if private,
  hold a relay reservation; reports ``nat`` (reachability, mapping, punchable).
- ``{"op": "step", "round_key": K, "timeout": S}``: one averaging step; reports
  ``stepped``: the result's fingerprint and first values (``head``), the elements each
  reducer reduced, how we are connected to each other member (direct or relayed), and
  the share of the vector averaged, the round's seconds, and the rate we measured in it
  (``announced`` in our next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Any

import torch

from averaging import AllReduceConfig, Averager, AveragerConfig, MatchmakingConfig
from peers.dht import DHT, DHTConfig
from peers.testing import Node


def member_tensor(rank: int, elements: int) -> torch.Tensor:
    return torch.randn(elements, generator=torch.Generator().manual_seed(rank))


async def _wait_nat(node: Node, timeout: float) -> None:
    nat = node.peer.nat

    def settled() -> bool:
        reachability = nat.reachability.value
        return reachability == "public" or (reachability == "private" and bool(nat.relays))

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while not settled():
                await nat.wait_changed()


async def nat_averager(node: Node) -> None:
    torch.set_num_threads(1)
    options = node.options
    elements = int(options.get("elements", 1 << 18))
    tensor = member_tensor(int(options["rank"]), elements)
    config = AveragerConfig(
        prefix="natlab",
        matchmaking=MatchmakingConfig(
            target_group_size=int(options.get("group_size", 4)),
            min_group_size=2,
            search_timeout=30.0,
            gather_timeout=5.0,
            request_timeout=10.0,
            poll_interval_seconds=0.25,
        ),
        allreduce=AllReduceConfig(
            sender_timeout=float(options.get("sender_timeout", 10.0)),
            reducer_timeout=float(options.get("reducer_timeout", 20.0)),
            round_timeout=float(options.get("round_timeout", 40.0)),
            chunk_elements=int(options.get("chunk_elements", AllReduceConfig.chunk_elements)),
            join_timeout=10.0,
            connections_per_member=int(options.get("connections_per_member", 2)),
        ),
    )
    dht_config = DHTConfig(initial_peers=tuple(options["initial_peers"]), rpc_timeout=5.0)
    async with DHT(node.peer, dht_config) as dht, Averager(dht, {"x": tensor}, config) as averager:
        node.report({"event": "joined"})
        while True:
            command = await node.receive()
            if command["op"] == "wait_nat":
                await _wait_nat(node, float(command["timeout"]))
                nat = node.peer.nat
                node.report(
                    {
                        "event": "nat",
                        "reachability": nat.reachability.value,
                        "mapping": nat.mapping().value,
                        "punchable": nat.punchable,
                    }
                )
            elif command["op"] == "step":
                node.report(await _step(node, averager, tensor, command))


async def _step(
    node: Node, averager: Averager, tensor: torch.Tensor, command: dict[str, Any]
) -> dict[str, Any]:
    step = await averager.step(command["round_key"], timeout=float(command["timeout"]))
    report = step.outcome.result.report
    reduced: dict[str, int] = {}
    for part in report.parts:
        if part.reducer is not None:
            reduced[str(part.reducer)] = reduced.get(str(part.reducer), 0) + part.end - part.start
    peer = node.peer
    connections = {}
    further_bytes = 0  # received on further connections to members (the round's lanes)
    for member in step.group.members:
        conn = peer.connection_to(member)
        if member != peer.peer_id and conn is not None:
            connections[str(member)] = "relayed" if conn.relayed else "direct"
            for further in peer.direct_connections(member)[1:]:
                further_bytes += further.session_statistics().num_data_bytes_received
    return {
        "event": "stepped",
        "fingerprint": hashlib.sha256(tensor.numpy().tobytes()).hexdigest(),
        "members": [str(m) for m in step.group.members],
        "reduced": reduced,
        "failed": {str(m): reason for m, reason in report.failed.items()},
        "agreed": step.outcome.transfer.agreed,
        "fraction": report.fraction_averaged,
        "seconds": step.allreduce_seconds,
        "connections": connections,
        "further_bytes": further_bytes,
        "head": tensor[:4].tolist(),
        "announced": averager.bandwidth,
    }
