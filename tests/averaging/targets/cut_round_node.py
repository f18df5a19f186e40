"""A LocalSwarm target for ``cut_rounds.py``: a peer that pings and runs butterfly
rounds the test describes, and reports what each round gave it.

Commands, each answered by one report:

- ``{"op": "ping", "peers": [[peer_id, maddr], ...], "timeout": s}`` -> ``pinged``:
  the peers that did not answer within ``timeout`` seconds, each with its error;
- ``{"op": "round", "round_id": hex, "members": [[peer_id, maddr], ...], "seed": s,
  "elements": n, "config": {...}}`` (``AllReduceConfig`` fields, codec none) averages
  ``member_vector(seed + my rank)`` -> ``done``: ``agreed``, the SHA-256 of the averaged
  tensor's bytes, the seconds ``run_round`` took on this peer's clock, and what it
  raised (``error``; P4 says it never does, so it is reported rather than fatal).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from averaging import AllReduceConfig, AllReduceService, RoundSpec
from peers.identity import PeerID
from peers.testing import Node


def member_vector(seed: int, elements: int) -> torch.Tensor:
    return torch.randn(elements, generator=torch.Generator().manual_seed(seed))


def _learn(node: Node, members: Sequence[Sequence[str]]) -> list[PeerID]:
    """The members' PeerIDs, in order; their addresses go to our address book."""
    ids = []
    for peer, maddr in members:
        peer_id = PeerID.from_base58(peer)
        if peer_id != node.peer.peer_id:
            node.peer.add_addresses(peer_id, [maddr])
        ids.append(peer_id)
    return ids


async def _unreachable(node: Node, peers: Sequence[PeerID], timeout: float) -> dict[str, str]:
    async def error(peer: PeerID) -> str | None:
        try:
            async with asyncio.timeout(timeout):
                await node.peer.ping(peer)
        except Exception as e:  # any failure to answer counts as not (yet) reachable
            return repr(e)
        return None

    errors = await asyncio.gather(*(error(p) for p in peers))
    return {str(p): e for p, e in zip(peers, errors, strict=True) if e is not None}


async def _round(node: Node, service: AllReduceService, command: dict[str, Any]) -> dict[str, Any]:
    ids = tuple(_learn(node, command["members"]))
    config = AllReduceConfig(**command["config"])
    spec = RoundSpec(
        round_id=bytes.fromhex(command["round_id"]),
        members=ids,
        weights=tuple(1.0 for _ in ids),
        total_elements=int(command["elements"]),
        chunk_elements=config.chunk_elements,
        me=node.peer.peer_id,
    )
    local = member_vector(int(command["seed"]) + ids.index(node.peer.peer_id), spec.total_elements)
    loop = asyncio.get_running_loop()
    started = loop.time()
    report: dict[str, Any] = {"event": "done", "error": None, "agreed": False, "sha256": ""}
    try:
        outcome = await service.run_round(spec, local, 1.0, config)
    except Exception as e:  # P4 broken: report it, and keep serving the next round
        report["error"] = repr(e)
    else:
        report["agreed"] = outcome.transfer.agreed
        averaged = outcome.result.averaged.contiguous().numpy().tobytes()
        report["sha256"] = hashlib.sha256(averaged).hexdigest()
    report["seconds"] = loop.time() - started
    return report


async def cut_round_node(node: Node) -> None:
    torch.set_num_threads(1)  # four peers and the test share two cores
    async with AllReduceService(node.peer) as service:
        node.report({"event": "serving"})
        while True:
            command = await node.receive()
            if command["op"] == "ping":
                peers = _learn(node, command["peers"])
                unreachable = await _unreachable(node, peers, float(command["timeout"]))
                node.report({"event": "pinged", "unreachable": unreachable})
            elif command["op"] == "round":
                node.report(await _round(node, service, command))
