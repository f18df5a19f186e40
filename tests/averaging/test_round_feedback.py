"""Error feedback inside butterfly rounds (issue: averaging agreement, item 4): a lossy
codec's rounding errors cancel over rounds instead of adding up, a resent chunk is
counted once, and members still hold identical results."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch

from averaging import AllReduceConfig, AllReduceService, RoundSpec
from averaging.allreduce.feedback import RoundFeedback
from averaging.allreduce.records import PartReport, RoundReport
from averaging.averager import AveragerConfig, AveragerError
from averaging.compression import Uniform8BitCodec
from peers import KeyPair, Peer

Run = Callable[[Coroutine[Any, Any, Any]], Any]

CODEC = Uniform8BitCodec()
CONFIG = AllReduceConfig(
    sender_timeout=2.0, reducer_timeout=4.0, round_timeout=8.0, chunk_elements=2048, codec=CODEC
)
ROUNDS = 12


async def _rounds(tensors: list[torch.Tensor], feedback: bool) -> list[torch.Tensor]:
    """``ROUNDS`` rounds of three peers averaging the same vectors each time (as
    gradients of one direction); the sum of each peer's results."""
    async with contextlib.AsyncExitStack() as stack:
        peers = [await stack.enter_async_context(Peer()) for _ in tensors]
        services = [await stack.enter_async_context(AllReduceService(p, CONFIG)) for p in peers]
        for p in peers:
            for q in peers:
                if p is not q:
                    p.add_addresses(q.peer_id, q.listen_addrs)
        members = tuple(p.peer_id for p in peers)
        states = [RoundFeedback(tensors[0].numel()) for _ in tensors]
        sums = [torch.zeros_like(tensors[0], dtype=torch.float64) for _ in tensors]
        for _ in range(ROUNDS):
            round_id = os.urandom(16)
            runs = []
            for peer, service, tensor, state in zip(peers, services, tensors, states, strict=True):
                spec = RoundSpec(
                    round_id=round_id,
                    members=members,
                    weights=(1.0,) * len(members),
                    total_elements=tensor.numel(),
                    chunk_elements=CONFIG.chunk_elements,
                    me=peer.peer_id,
                )
                if feedback:
                    runs.append(
                        service.run_round(spec, state.compensate(tensor), 1.0, errors=state.round())
                    )
                else:
                    runs.append(service.run_round(spec, tensor, 1.0))
            results = await asyncio.gather(*runs)
            for r in results:
                assert r.transfer.agreed and r.result.report.fraction_averaged == 1.0
                assert torch.equal(r.result.averaged, results[0].result.averaged)
            for total, r in zip(sums, results, strict=True):
                total += r.result.averaged.double()
        return sums


def test_rounding_errors_cancel_over_rounds_instead_of_adding_up(arun: Run) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(6_000, generator=gen) for _ in range(3)]
    exact = torch.stack(tensors).double().mean(0) * ROUNDS
    # One rounding step of the codec on these values (both encodings are 8-bit).
    step = max(CODEC.error_bound(t) for t in tensors)

    with_feedback = arun(_rounds(tensors, feedback=True))
    without = arun(_rounds(tensors, feedback=False))
    error_with = float((with_feedback[0] - exact).abs().max())
    error_without = float((without[0] - exact).abs().max())
    print(f"after {ROUNDS} rounds: max error {error_with:.4f} with, {error_without:.4f} without")
    # The same rounding each round: without feedback the error grows with the rounds...
    assert error_without > 4 * step
    # ...with it, the sum stays within a few rounding steps of the exact sum.
    assert error_with <= 4 * step
    assert all(torch.equal(s, with_feedback[0]) for s in with_feedback)


def _report(me: Any, parts: list[tuple[int, int, Any, frozenset[Any], bool]]) -> RoundReport:
    return RoundReport(
        round_id=b"r" * 16,
        me=me,
        members=(),
        failed={},
        excluded_by=frozenset(),
        parts=tuple(
            PartReport(i, start, end, reducer, contributors, averaged)
            for i, (start, end, reducer, contributors, averaged) in enumerate(parts)
        ),
        fraction_averaged=1.0,
    )


def test_a_resent_chunk_counts_once_and_each_part_settles_by_how_it_ended() -> None:
    me, other = KeyPair.generate().peer_id, KeyPair.generate().peer_id
    feedback = RoundFeedback(40)
    feedback.sent[:] = 5.0
    feedback.published[:] = 7.0
    errors = feedback.round()
    values = torch.linspace(-1, 1, 10)
    # [0, 10) went to `other`, then again to its heir: the second encoding must not count.
    errors.on_sent(0, values, CODEC.encode(values))
    errors.on_sent(0, values + 100.0, CODEC.encode(values + 100.0))
    expected_sent = values - CODEC.decode(CODEC.encode(values))
    # I reduced [10, 20) and published it (twice: the last counts).
    compensated = errors.to_publish(10, 20, values)
    assert torch.equal(compensated, values + 7.0)
    errors.on_published(10, compensated + 1.0, CODEC.encode(compensated))
    errors.on_published(10, compensated, CODEC.encode(compensated))
    expected_published = compensated - CODEC.decode(CODEC.encode(compensated))
    errors.on_sent(20, values, CODEC.encode(values))  # a part averaged without me
    errors.on_sent(30, values, CODEC.encode(values))  # a part left at my own value
    errors.settle(
        _report(
            me,
            [
                (0, 10, other, frozenset({me, other}), True),
                (10, 20, me, frozenset({me, other}), True),
                (20, 30, other, frozenset({other}), True),
                (30, 40, None, frozenset(), False),
            ],
        )
    )
    assert torch.equal(feedback.sent[0:10], expected_sent)
    assert torch.equal(feedback.sent[10:20], torch.zeros(10))  # my exact values went in
    assert torch.equal(feedback.sent[20:30], torch.full((10,), 5.0))  # still owed
    assert torch.equal(feedback.sent[30:40], torch.zeros(10))  # my own value is my result
    assert torch.equal(feedback.published[10:20], expected_published)
    assert torch.equal(feedback.published[0:10], torch.full((10,), 7.0))  # not mine


def test_feedback_needs_a_lossy_codec_and_a_vector_of_its_size() -> None:
    with pytest.raises(AveragerError, match="lossy codec"):
        AveragerConfig(prefix="run", error_feedback=True)
    AveragerConfig(prefix="run", error_feedback=True, allreduce=CONFIG)
    with pytest.raises(ValueError, match="elements"):
        RoundFeedback(4).compensate(torch.zeros(5))
