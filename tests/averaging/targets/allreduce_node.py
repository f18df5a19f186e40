"""A LocalSwarm target: a peer that runs butterfly rounds the test describes.

Command ``{"op": "round", "round_id": hex, "members": [[peer_id, maddr, rank], ...],
"elements": n, "config": {...}, "seed": s}`` averages ``tensor(seed, rank)`` (every
process can rebuild every member's tensor) and reports ``done`` with the result's
fingerprint, failures, agreement, seconds, and the largest error against the mean over
each part's contributors, recomputed here from the seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from averaging import AllReduceConfig, AllReduceService, RoundSpec
from averaging.compression import (
    Blockwise8BitCodec,
    Codec,
    Float16Codec,
    NoneCodec,
    Uniform8BitCodec,
)
from peers.identity import PeerID
from peers.testing import Node


def member_tensor(seed: int, rank: int, elements: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(elements, generator=gen)


def _max_error(result: Any, ranks: dict[PeerID, int], seed: int, elements: int) -> float:
    tensors = {m: member_tensor(seed, r, elements) for m, r in ranks.items()}
    worst = 0.0
    for part in result.report.parts:
        if not part.averaged or part.end == part.start:
            continue
        expected = torch.stack(
            [tensors[m][part.start : part.end].double() for m in part.contributors]
        ).mean(0)
        got = result.averaged[part.start : part.end].double()
        worst = max(worst, float((got - expected).abs().max()))
    return worst


CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "float16": Float16Codec,
    "uint8": Uniform8BitCodec,
    "blockwise8": Blockwise8BitCodec,
}


def _bound(codec: Codec, ranks: dict[PeerID, int], seed: int, elements: int, result: Any) -> float:
    """A value's error: its sender's encoding (weights sum to one, so the mean moves by at
    most the largest sender bound) plus the reducer's encoding of the mean."""
    tensors = [member_tensor(seed, r, elements) for r in ranks.values()]
    senders = max(codec.error_bound(t) for t in tensors)
    return senders + codec.error_bound(result.averaged) + 1e-6


async def allreduce_node(node: Node) -> None:
    torch.set_num_threads(1)  # 8 processes share 2 cores: no intra-op thread pools
    async with AllReduceService(node.peer) as service:
        node.report({"event": "serving"})
        while True:
            command = await node.receive()
            members = [(PeerID.from_base58(p), maddr, int(r)) for p, maddr, r in command["members"]]
            for peer_id, maddr, _ in members:
                if peer_id != node.peer.peer_id:
                    node.peer.add_addresses(peer_id, [maddr])
            ranks = {peer_id: rank for peer_id, _, rank in members}
            me = ranks[node.peer.peer_id]
            elements = int(command["elements"])
            spec = RoundSpec(
                round_id=bytes.fromhex(command["round_id"]),
                members=tuple(peer_id for peer_id, _, _ in members),
                weights=tuple(1.0 for _ in members),
                total_elements=elements,
                chunk_elements=int(command["config"].get("chunk_elements", 1 << 16)),
                me=node.peer.peer_id,
            )
            settings = dict(command["config"])
            codec = CODECS[settings.pop("codec", "none")]()
            config = AllReduceConfig(**settings, codec=codec)
            local = member_tensor(int(command["seed"]), me, elements)
            node.report({"event": "started"})
            outcome = await service.run_round(spec, local, 1.0, config)
            result = outcome.result
            parts_ok = all(
                part.averaged
                and {m for m in ranks if m not in result.report.failed} <= part.contributors
                for part in result.report.parts
                if part.end > part.start
            )
            node.report(
                {
                    "event": "done",
                    "fingerprint": result.fingerprint().hex(),
                    "failed": sorted(str(m) for m in result.report.failed),
                    "excluded_by": sorted(str(m) for m in result.report.excluded_by),
                    "fraction": result.report.fraction_averaged,
                    "agreed": outcome.transfer.agreed,
                    "seconds": outcome.transfer.seconds,
                    "all_parts_cover_survivors": parts_ok,
                    "max_error": _max_error(result, ranks, int(command["seed"]), elements),
                    "bytes_sent": outcome.transfer.bytes_sent,
                    "bound": _bound(codec, ranks, int(command["seed"]), elements, result),
                }
            )
