"""PartReduction: a reducer's float32 weighted sums, the exact float64 redo of a chunk
whose float32 sum overflows, and rebuilding sums when a sender is dropped."""

from __future__ import annotations

import torch

from averaging import MAX_SAMPLE_WEIGHT, PartReduction
from peers.identity import KeyPair, PeerID

CPU = torch.device("cpu")
RANGES = [(100, 164), (164, 228), (228, 250)]  # a part of 150 elements in three chunks


def _peers(n: int) -> list[PeerID]:
    return [KeyPair.generate().peer_id for _ in range(n)]


def _chunks(values: torch.Tensor) -> list[torch.Tensor]:
    return [values[s - RANGES[0][0] : e - RANGES[0][0]] for s, e in RANGES]


def _reduce(
    senders: list[PeerID],
    values: list[torch.Tensor],
    weights: list[float],
    max_weight_ratio: float | None = None,
) -> torch.Tensor:
    reduction = PartReduction(RANGES, CPU, max_weight_ratio=max_weight_ratio)
    for sender, v, w in zip(senders, values, weights, strict=True):
        for c, chunk in enumerate(_chunks(v)):
            reduction.add(sender, c, chunk, w)
    assert all(reduction.complete(s) for s in senders)
    return reduction.finalize()


def _exact(values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    total = sum(v.double() * w for v, w in zip(values, weights, strict=True))
    assert isinstance(total, torch.Tensor)
    return (total / sum(weights)).float()


def test_weighted_mean_is_within_float32_rounding_of_the_exact_one() -> None:
    gen = torch.Generator().manual_seed(1)
    senders = _peers(5)
    values = [torch.randn(150, generator=gen) * 10 for _ in senders]
    weights = [1.0, 3.0, 0.5, 1000.0, 7.0]
    got = _reduce(senders, values, weights)
    assert got.dtype == torch.float32 and got.shape == (150,)
    exact = _exact(values, weights)
    # n float32 roundings of terms up to max|w x|, then one division
    scale = max(w * float(v.abs().max()) for v, w in zip(values, weights, strict=True))
    assert float((got - exact).abs().max()) <= 8 * 2**-24 * scale / sum(weights)


def test_a_float32_overflow_is_redone_exactly_in_float64() -> None:
    big = torch.finfo(torch.float32).max
    senders = _peers(3)
    # Both sums overflow float32 (two values near the maximum; a weight of 2**64 times
    # 1e30), while every mean is finite.
    values = [torch.full((150,), big), torch.full((150,), big * 0.5), torch.full((150,), -1e30)]
    weights = [1.0, 1.0, 1.0]
    got = _reduce(senders, values, weights)
    assert torch.isfinite(got).all()
    assert torch.equal(got, _exact(values, weights))

    values = [torch.full((150,), 1e30), torch.full((150,), 2e30), torch.full((150,), 3.0)]
    weights = [MAX_SAMPLE_WEIGHT, MAX_SAMPLE_WEIGHT, 1.0]
    got = _reduce(senders, values, weights)
    assert torch.isfinite(got).all()
    assert torch.equal(got, _exact(values, weights))


def test_only_the_overflowing_chunk_is_redone() -> None:
    big = torch.finfo(torch.float32).max
    senders = _peers(2)
    a, b = torch.ones(150), torch.ones(150) * 3
    a[70], b[70] = big, big  # in the second chunk only
    got = _reduce(senders, [a, b], [1.0, 1.0])
    assert float(got[70]) == big
    assert torch.equal(got[:70], torch.full((70,), 2.0))
    assert torch.equal(got[71:], torch.full((79,), 2.0))


def test_dropping_a_sender_rebuilds_its_chunks_from_the_others() -> None:
    gen = torch.Generator().manual_seed(2)
    senders = _peers(4)
    values = [torch.randn(150, generator=gen) for _ in senders]
    weights = {s: float(i + 1) for i, s in enumerate(senders)}
    reduction = PartReduction(RANGES, CPU)
    for s, v in zip(senders, values, strict=True):
        for c, chunk in enumerate(_chunks(v)):
            reduction.add(s, c, chunk, weights[s])
    reduction.drop(senders[1], senders, weights)
    assert not reduction.complete(senders[1])
    got = reduction.finalize()
    kept = [0, 2, 3]
    # Rebuilt in member order, exactly as if the dropped sender had never sent.
    assert torch.equal(
        got,
        _reduce(
            [senders[i] for i in kept],
            [values[i] for i in kept],
            [weights[senders[i]] for i in kept],
        ),
    )
    assert float((got - _exact([values[i] for i in kept], [1.0, 3.0, 4.0])).abs().max()) < 1e-6


def test_the_result_is_its_own_buffer_and_the_inputs_are_untouched() -> None:
    senders = _peers(2)
    a, b = torch.arange(150.0), torch.arange(150.0) * 2
    a_before, b_before = a.clone(), b.clone()
    got = _reduce(senders, [a, b], [1.0, 1.0])
    assert torch.equal(got, torch.arange(150.0) * 1.5)
    assert torch.equal(a, a_before) and torch.equal(b, b_before)
    assert got.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_a_claimed_weight_counts_at_most_the_ratio_times_the_median() -> None:
    """Sample weights are the senders' claims: one of 1e9 among weights of 1 and 2 would
    be the whole mean. Capped at 4x the median (2), it counts as 8, and the result is
    the weighted mean with that weight, the overflow redo included."""
    senders = _peers(4)
    values = [torch.full((150,), v) for v in (0.0, 1.0, 2.0, 100.0)]
    weights = [1.0, 2.0, 2.0, 1e9]
    capped = _reduce(senders, values, weights, max_weight_ratio=4.0)
    assert torch.allclose(capped, _exact(values, [1.0, 2.0, 2.0, 8.0]))
    uncapped = _reduce(senders, values, weights)
    assert torch.allclose(uncapped, _exact(values, weights))
    assert float(uncapped[0]) > 99.0
    # weights within the ratio are untouched
    fair = [1.0, 2.0, 3.0, 4.0]
    assert torch.equal(_reduce(senders, values, fair, 4.0), _reduce(senders, values, fair))
    # a claim near the float32 limit with huge values: the exact redo uses capped weights
    huge = [torch.full((150,), 3e38), *values[1:]]
    big = _reduce(senders, huge, [MAX_SAMPLE_WEIGHT, 1.0, 1.0, 1.0], max_weight_ratio=4.0)
    assert torch.allclose(big, _exact(huge, [4.0, 1.0, 1.0, 1.0]))


def test_a_chunk_averaged_early_is_averaged_again_without_a_dropped_sender() -> None:
    """A chunk every sender has sent is averaged at once (it is published before the
    part is whole); dropping a sender later rebuilds it from the others' kept chunks,
    and the part ends exactly as if that sender had never sent."""
    gen = torch.Generator().manual_seed(3)
    senders = _peers(3)
    values = [torch.randn(150, generator=gen) for _ in senders]
    weights = {s: float(i + 1) for i, s in enumerate(senders)}
    reduction = PartReduction(RANGES, CPU, max_weight_ratio=4.0)
    for s, v in zip(senders, values, strict=True):
        reduction.add(s, 0, _chunks(v)[0], weights[s])
    assert reduction.chunk_complete(0, senders) and not reduction.chunk_complete(1, senders)
    early = reduction.average_chunk(0).clone()
    assert reduction.averaged(0) and not reduction.averaged(1)
    assert torch.equal(early, _reduce(senders, values, list(weights.values()))[:64])
    reduction.drop(senders[2], senders, weights)  # it sent chunk 0 only, then died
    assert not reduction.averaged(0)
    for s, v in zip(senders[:2], values[:2], strict=True):
        for c in (1, 2):
            reduction.add(s, c, _chunks(v)[c], weights[s])
    got = reduction.finalize()
    assert torch.equal(got, _reduce(senders[:2], values[:2], [1.0, 2.0]))


def test_capped_weights_hold_for_chunks_averaged_early() -> None:
    senders = _peers(4)
    values = [torch.full((150,), v) for v in (0.0, 1.0, 2.0, 100.0)]
    weights = [1.0, 2.0, 2.0, 1e9]
    reduction = PartReduction(RANGES, CPU, max_weight_ratio=4.0)
    for s, v, w in zip(senders, values, weights, strict=True):
        reduction.add(s, 1, _chunks(v)[1], w)
    early = reduction.average_chunk(1).clone()
    whole = _reduce(senders, values, weights, max_weight_ratio=4.0)
    assert torch.equal(early, whole[64:128])
