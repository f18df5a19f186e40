"""A LocalSwarm target: a peer that runs butterfly rounds the test describes.

Command ``{"op": "round", "round_id": hex, "members": [[peer_id, maddr, rank], ...],
"elements": n, "config": {...}, "seed": s}`` averages ``tensor(seed, rank)`` (every
process can rebuild every member's tensor) and reports ``done`` with the result's
fingerprint, failures, agreement, seconds, and the largest error against the mean over
each part's contributors, recomputed here from the seeds.
"""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)
def _base_tensor(seed: int, elements: int) -> torch.Tensor:
    return torch.randn(elements, generator=torch.Generator().manual_seed(seed))


def member_tensor(seed: int, rank: int, elements: int) -> torch.Tensor:
    """A distinct tensor per member, cheap to rebuild: one shared normal draw per round,
    rolled and offset by the rank (each process rebuilds all eight to check the result;
    eight draws of 16M normals took seconds of the two cores a round)."""
    return torch.roll(_base_tensor(seed, elements), shifts=rank * 7919) + 0.5 * rank


#: The result is checked at every 8th coordinate (every chunk and part is covered): in
#: full, six processes checking 16M elements each held the two cores for seconds a round.
CHECK_STRIDE = 8


def _max_error(result: Any, tensors: dict[PeerID, torch.Tensor]) -> float:
    worst = 0.0
    for part in result.report.parts:
        if not part.averaged or part.end == part.start:
            continue
        expected = torch.zeros(
            (part.end - part.start + CHECK_STRIDE - 1) // CHECK_STRIDE, dtype=torch.float64
        )
        for m in part.contributors:
            expected += tensors[m][part.start : part.end : CHECK_STRIDE]
        expected /= len(part.contributors)
        expected -= result.averaged[part.start : part.end : CHECK_STRIDE]
        worst = max(worst, float(expected.abs().max()))
    return worst


CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "float16": Float16Codec,
    "uint8": Uniform8BitCodec,
    "blockwise8": Blockwise8BitCodec,
}


def _bound(codec: Codec, tensors: dict[PeerID, torch.Tensor], result: Any) -> float:
    """A value's error: its sender's encoding (weights sum to one, so the mean moves by at
    most the largest sender bound) plus the reducer's encoding of the mean."""
    senders = max(codec.error_bound(t) for t in tensors.values())
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
            # Every member's tensor, rebuilt once from the seeds, to check the result.
            tensors = {
                m: local if r == me else member_tensor(int(command["seed"]), r, elements)
                for m, r in ranks.items()
            }
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
                    "max_error": _max_error(result, tensors),
                    "bytes_sent": outcome.transfer.bytes_sent,
                    "bound": _bound(codec, tensors, result),
                }
            )
