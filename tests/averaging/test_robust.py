"""CenteredClip: the pure function, its config, and butterfly rounds that use it (16
peers' state machines in-process, messages delivered in a seeded random order).

The bound checked (docs/averaging-robust.md): at CenteredClip's fixed point, with every
honest input within ``tau`` of it, one outlier of weight share ``w_o / W_honest`` moves the
result exactly ``tau * w_o / W_honest`` from the honest mean: the bound is tight, so checks
allow it the stopping tolerance and float32 rounding of the result, no more.

Randomised tests print their seed; set SWARMTRAIN_TEST_SEED to replay one.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from collections.abc import Sequence

import pytest
import torch

import averaging.allreduce.robust
from averaging import (
    MAX_SAMPLE_WEIGHT,
    ButterflyRound,
    CenteredClipConfig,
    ChunksAveraged,
    Outgoing,
    OutgoingAveraged,
    PartReady,
    PartReassigned,
    RoundError,
    RoundEvent,
    RoundResult,
    RoundSpec,
    centered_clip,
    spread_radius,
)
from averaging.allreduce.records import DEFAULT_MAX_WEIGHT_RATIO
from averaging.allreduce.reduction import capped_sample_weights
from peers.identity import KeyPair, PeerID

ROUND_ID = b"robust-round"
EPS32 = torch.finfo(torch.float32).eps
_IDS = [KeyPair.from_seed(bytes([i + 101]) * 32).peer_id for i in range(16)]


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("SWARMTRAIN_TEST_SEED", random.randrange(2**32)))
    print(f"seed={value} (replay with SWARMTRAIN_TEST_SEED={value})")
    return value


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm())


# --- the pure function ----------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_huge_tau_gives_the_weighted_mean(n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 300, generator=g, dtype=torch.float64) * 5 + 2
    w = torch.rand(n, generator=g, dtype=torch.float64) * 10 + 0.1
    expected = (w[:, None] * x).sum(0) / w.sum()
    # No input is clipped: the first step lands on the mean, whatever the start.
    got = centered_clip(x, w, tau=1e9, num_iterations=1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(centered_clip(x, w, tau=1e9, num_iterations=20), expected)


@pytest.mark.parametrize("magnitude", [-1000.0, 1e6, -3e30])
def test_one_outlier_moves_the_result_at_most_tau_times_its_share(
    magnitude: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(500, generator=g) * 3
    x = base + torch.randn(16, 500, generator=g)
    honest_mean = x[1:].double().mean(0)
    spread = float((x[1:].double() - honest_mean).norm(dim=1).max())
    tau = 2 * spread
    x[0] *= magnitude
    got = centered_clip(x, torch.ones(16), tau=tau, num_iterations=20, tolerance=1e-9)
    assert torch.isfinite(got).all()
    slack = 1e-8 * tau + EPS32 * float(got.norm())
    assert _distance(got, honest_mean) <= tau / 15 + slack
    # The bound is tight: the outlier is clipped, not ignored.
    assert _distance(got, honest_mean) >= tau / 15 - slack
    assert _distance(x.double().mean(0), honest_mean) > 100 * tau / 15


def test_weights_are_respected() -> None:
    x = torch.tensor([[0.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 3.0], dtype=torch.float64)
    mean = torch.tensor([0.75, 1.5], dtype=torch.float64)
    torch.testing.assert_close(centered_clip(x, w, tau=100.0, num_iterations=3), mean)
    torch.testing.assert_close(centered_clip(x, w * 2.0**60, tau=100.0, num_iterations=3), mean)
    # The weighted median starts at the heavier input; with a small tau the lighter one
    # pulls it by at most tau times its share.
    assert torch.equal(centered_clip(x, w, tau=1.0, num_iterations=0), x[1])
    got = centered_clip(x, w, tau=0.1, num_iterations=1)
    assert _distance(got, x[1]) == pytest.approx(0.1 * 1 / 4)


def test_zero_equal_and_degenerate_inputs() -> None:
    zeros = torch.zeros(4, 10)
    assert torch.equal(centered_clip(zeros, torch.ones(4), tau=1.0, num_iterations=5), zeros[0])
    row = torch.randn(1, 10)
    assert torch.equal(centered_clip(row, torch.ones(1), tau=1e-3, num_iterations=5), row[0])
    same = row.repeat(5, 1)
    assert torch.equal(centered_clip(same, torch.rand(5) + 1, tau=1.0, num_iterations=5), row[0])
    empty = centered_clip(torch.zeros(3, 0), torch.ones(3), tau=1.0, num_iterations=5)
    assert empty.shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_and_in_range_for_extreme_inputs(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    cases = [
        torch.full((8, 6), info.max, dtype=dtype) * torch.tensor([1, -1] * 4, dtype=dtype)[:, None],
        (torch.rand(8, 6, generator=g, dtype=dtype) * 2 - 1) * info.max,
        torch.full((8, 6), info.smallest_normal / 4, dtype=dtype),  # subnormal
        torch.randn(8, 6, generator=g, dtype=dtype) * info.smallest_normal,
    ]
    for x in cases:
        for tau in (info.smallest_normal, 1.0, info.max):
            got = centered_clip(x, torch.rand(8, generator=g) + 0.5, tau=tau, num_iterations=7)
            assert got.dtype == dtype and torch.isfinite(got).all()
            assert (got >= x.amin(0)).all() and (got <= x.amax(0)).all()


def test_column_blocks_do_not_change_the_result(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 1000, generator=g, dtype=torch.float64)
    x[3] *= -50
    w = torch.rand(7, generator=g, dtype=torch.float64) + 0.5
    whole = centered_clip(x, w, tau=5.0, num_iterations=10)
    monkeypatch.setattr(averaging.allreduce.robust, "BLOCK_ELEMENTS", 7 * 13)
    torch.testing.assert_close(
        centered_clip(x, w, tau=5.0, num_iterations=10), whole, rtol=0, atol=1e-12
    )


def test_invalid_arguments_raise() -> None:
    x, w = torch.zeros(3, 4), torch.ones(3)
    bad_arguments: list[dict[str, object]] = [
        {"vectors": torch.zeros(4)},
        {"vectors": torch.zeros(0, 4), "weights": torch.ones(0)},
        {"vectors": torch.zeros(3, 4, dtype=torch.int64)},
        {"vectors": torch.tensor([[float("nan")] * 4] * 3)},
        {"weights": torch.ones(2)},
        {"weights": torch.tensor([1.0, 0.0, 1.0])},
        {"weights": torch.tensor([1.0, float("inf"), 1.0])},
        {"tau": 0.0},
        {"tau": float("nan")},
        {"num_iterations": -1},
        {"tolerance": -1.0},
    ]
    for bad in bad_arguments:
        args = {"vectors": x, "weights": w, "tau": 1.0, "num_iterations": 3, **bad}
        with pytest.raises(ValueError):
            centered_clip(
                args["vectors"],  # type: ignore[arg-type]
                args["weights"],  # type: ignore[arg-type]
                tau=args["tau"],  # type: ignore[arg-type]
                num_iterations=args["num_iterations"],  # type: ignore[arg-type]
                tolerance=args.get("tolerance", 0.0),  # type: ignore[arg-type]
            )


def test_config_is_validated() -> None:
    config = CenteredClipConfig(tau=4.0)
    assert config.part_tau(25, 100) == pytest.approx(2.0)
    bad_fields: list[dict[str, object]] = [
        {"tau": 0.0},
        {"tau": float("inf")},
        {"tau": True},
        {"num_iterations": 0},
        {"num_iterations": 2.0},
        {"tolerance": -1.0},
        {"weigh_by_samples": 1},
        {"spread_factor": 0.0},
        {"spread_factor": float("nan")},
        {"spread_factor": "2"},
    ]
    for bad in bad_fields:
        with pytest.raises(ValueError):
            CenteredClipConfig(**{"tau": 1.0, **bad})  # type: ignore[arg-type]
    with pytest.raises(RoundError):
        RoundSpec(
            round_id=ROUND_ID,
            members=(_IDS[0],),
            weights=(1.0,),
            total_elements=4,
            chunk_elements=4,
            me=_IDS[0],
            aggregation=1.0,  # type: ignore[arg-type]
        )


# --- the spread rule (tau=None) ---------------------------------------------------------


def _gradients(seed: int, n: int, d: int) -> torch.Tensor:
    """``n`` honest "gradients": a shared signal plus per-peer noise of the same size."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d, generator=g) + torch.randn(n, d, generator=g)).double()


def test_spread_rule_honest_rounds_are_the_mean(seed: int) -> None:
    x = _gradients(seed, 8, 2000)
    got = centered_clip(x, torch.ones(8), tau=None, num_iterations=20)
    torch.testing.assert_close(got, x.mean(0), rtol=0, atol=1e-12)


@pytest.mark.parametrize("hostile", [1, 3, 7])
def test_a_minority_cannot_inflate_the_spread_radius(hostile: int, seed: int) -> None:
    """Up to 7 of 16 senders send anything (huge, or all alike, far away): the radius
    stays at most the farthest honest sender's distance from the median, and the
    result within spread_factor times it, times the hostile share, of the honest mean."""
    x = _gradients(seed, 16, 1000)
    honest = x[hostile:]
    x[:hostile] = x[:hostile] * -1e6
    weights = torch.ones(16, dtype=torch.float64)
    radius = spread_radius(x, weights)
    median = averaging.allreduce.robust._weighted_median(x, weights / 16)
    farthest_honest = float((honest - median).norm(dim=1).max())
    assert 0 < radius <= farthest_honest * (1 + 1e-12)  # equal at 7 of 16: the 9th distance
    tau = 2.0 * radius
    got = centered_clip(x, weights, tau=None, num_iterations=1000, tolerance=1e-9)
    share = hostile / (16 - hostile)
    assert _distance(got, honest.mean(0)) <= tau * share * (1 + 1e-6)
    plain = _distance(x.mean(0), honest.mean(0))
    assert plain > 1000 * _distance(got, honest.mean(0))


def test_spread_rule_with_most_senders_identical_gives_their_value() -> None:
    x = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [50.0, -7.0], [9.0, 9.0]])
    assert spread_radius(x, torch.ones(5)) == 0.0
    got = centered_clip(x, torch.ones(5), tau=None, num_iterations=20)
    assert torch.equal(got, x[0])


def test_spread_rule_is_scale_free(seed: int) -> None:
    """Scaling every input scales the result alike (a fixed tau would not): the rule
    follows gradients as they shrink over training, down to denormal-adjacent scales."""
    x = _gradients(seed, 6, 500)
    x[0] *= -1000
    reference = centered_clip(x, torch.ones(6), tau=None, num_iterations=50)
    for scale in (1e-30, 1e-3, 1e20):
        scaled = centered_clip(x * scale, torch.ones(6), tau=None, num_iterations=50)
        torch.testing.assert_close(scaled / scale, reference, rtol=1e-9, atol=0)


def test_sixteen_peers_one_poisoned_under_the_spread_rule(seed: int) -> None:
    """A butterfly round with ``tau=None``: each reducer measures its part's radius from
    its inputs, and every part's result stays within that radius / 15 of the honest
    mean, with no tau to choose."""
    rng = random.Random(seed)
    local, honest_mean, _ = _poisoned_vectors(seed)
    config = CenteredClipConfig()
    spec = _spec(16, 4096, 64, rng, config)
    group = Group(spec, local, dict.fromkeys(_IDS, 1.0), seed)
    group.run()
    result = group.results()[0].averaged
    ones = torch.ones(16, dtype=torch.float64)
    for start, end in spec.parts():
        inputs = torch.stack([local[p][start:end] for p in sorted(_IDS)]).double()
        part_tau = config.spread_factor * spread_radius(inputs, ones)
        slack = config.tolerance * part_tau + EPS32 * float(result[start:end].norm())
        got = _distance(result[start:end], honest_mean[start:end])
        assert got <= part_tau / 15 + slack, (start, got, part_tau)


# --- butterfly rounds -----------------------------------------------------------------


class Group:
    """n rounds of one spec, with messages delivered one at a time in a seeded random
    order, and peers that can be killed (everyone else's wire layer notices)."""

    def __init__(
        self,
        spec: RoundSpec,
        local: dict[PeerID, torch.Tensor],
        samples: dict[PeerID, float],
        seed: int,
    ) -> None:
        self.rng = random.Random(seed)
        self.rounds = {
            p: ButterflyRound(dataclasses.replace(spec, me=p), local[p], samples[p])
            for p in spec.members
        }
        self.dead: set[PeerID] = set()
        self.queue: list[tuple[PeerID, PeerID, Outgoing | OutgoingAveraged | PeerID]] = []
        for p, machine in self.rounds.items():
            self.queue += [(p, out.to, out) for out in machine.outgoing_chunks()]

    def handle(self, peer: PeerID, events: list[RoundEvent]) -> None:
        for event in events:
            if isinstance(event, (PartReady, ChunksAveraged)):
                published = self.rounds[peer].publishable_chunks(event.part_index)
                self.queue += [(peer, out.to, out) for out in published]
            elif isinstance(event, PartReassigned):
                self.queue += [(peer, out.to, out) for out in event.outgoing]

    def run(self, steps: int | None = None) -> None:
        """Deliver ``steps`` random messages (all, and those they cause, if None)."""
        while self.queue and (steps is None or steps > 0):
            steps = None if steps is None else steps - 1
            i = self.rng.randrange(len(self.queue))
            self.queue[i], self.queue[-1] = self.queue[-1], self.queue[i]
            sender, to, message = self.queue.pop()
            if sender in self.dead or to in self.dead:
                continue
            machine = self.rounds[to]
            if isinstance(message, PeerID):  # a local notice: `message` died
                self.handle(to, machine.on_sender_failed(message, "died"))
            elif isinstance(message, Outgoing):
                m = message
                events = machine.on_chunk(
                    sender, ROUND_ID, m.part_index, m.chunk_index, m.values, m.weight
                )
                self.handle(to, events)
            else:
                a = message
                events = machine.on_averaged_chunk(
                    sender, ROUND_ID, a.part_index, a.chunk_index, a.values, a.contributors
                )
                self.handle(to, events)

    def kill(self, peer: PeerID) -> None:
        self.dead.add(peer)
        self.queue += [(p, p, peer) for p in self.rounds if p not in self.dead]

    def results(self) -> list[RoundResult]:
        alive = [p for p in self.rounds if p not in self.dead]
        assert all(self.rounds[p].is_done() for p in alive)
        results = [self.rounds[p].result() for p in alive]
        for result in results:  # every survivor holds the same, fully averaged tensor
            assert result.report.fraction_averaged == 1.0
            assert torch.isfinite(result.averaged).all()
            assert torch.equal(result.averaged, results[0].averaged)
            assert result.fingerprint() == results[0].fingerprint()
        return results


def _spec(
    n: int, total: int, chunk: int, rng: random.Random, config: CenteredClipConfig | None
) -> RoundSpec:
    return RoundSpec(
        round_id=ROUND_ID,
        members=tuple(_IDS[:n]),
        weights=tuple(rng.uniform(0.5, 2.0) for _ in range(n)),
        total_elements=total,
        chunk_elements=chunk,
        me=_IDS[0],
        aggregation=config,
    )


def _poisoned_vectors(
    seed: int, total: int = 4096
) -> tuple[dict[PeerID, torch.Tensor], torch.Tensor, float]:
    """16 vectors: 15 honest ones (a shared base plus unit noise per coordinate), and
    member 5's honest vector multiplied by -1000. Returns them, the honest mean and the
    honest spread (the largest honest distance from the honest mean)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(total, generator=g) * 3
    local = {p: base + torch.randn(total, generator=g) for p in _IDS}
    honest = torch.stack([local[p] for p in _IDS if p != _IDS[5]]).double()
    honest_mean = honest.mean(0)
    spread = float((honest - honest_mean).norm(dim=1).max())
    local[_IDS[5]] = local[_IDS[5]] * -1000
    return local, honest_mean, spread


def test_sixteen_peers_one_poisoned_stay_within_tau_over_15(seed: int) -> None:
    """The issue's check: 16 peers, one sends its vector times -1000. With CenteredClip
    every member holds a result within tau/15 of the honest mean, in every part (norm
    over the part, against that part's tau) and over the whole vector; the plain mean
    fails both."""
    rng = random.Random(seed)
    local, honest_mean, spread = _poisoned_vectors(seed)
    tau = 2 * spread  # twice the honest spread: no honest input is clipped
    config = CenteredClipConfig(tau=tau)
    samples = dict.fromkeys(_IDS, 1.0)
    distances: dict[str, float] = {}
    for label, aggregation in [("clip", config), ("mean", None)]:
        spec = _spec(16, 4096, 64, rng, aggregation)
        group = Group(spec, local, samples, seed)
        group.run()
        result = group.results()[0].averaged
        distances[label] = _distance(result, honest_mean)
        slack = config.tolerance * tau + EPS32 * float(result.norm())
        within = [distances[label] <= tau / 15 + slack]
        for start, end in spec.parts():
            part_tau = config.part_tau(end - start, spec.total_elements)
            part_slack = config.tolerance * part_tau + EPS32 * float(result[start:end].norm())
            got = _distance(result[start:end], honest_mean[start:end])
            within.append(got <= part_tau / 15 + part_slack)
        assert all(within) if label == "clip" else not any(within)
    print(
        f"tau={tau:.4f} tau/15={tau / 15:.6f} distance to the honest mean: "
        f"centered clip {distances['clip']:.6f}, plain mean {distances['mean']:.2f}"
    )


def test_claimed_sample_counts_buy_no_influence(seed: int) -> None:
    """By default every sender counts once: the poisoned member claiming the largest
    sample count allowed changes nothing."""
    rng = random.Random(seed)
    local, honest_mean, spread = _poisoned_vectors(seed, total=1024)
    config = CenteredClipConfig(tau=2 * spread)
    samples = {p: float(rng.randint(1, 100)) for p in _IDS}
    samples[_IDS[5]] = MAX_SAMPLE_WEIGHT
    group = Group(_spec(16, 1024, 50, rng, config), local, samples, seed)
    group.run()
    result = group.results()[0].averaged
    slack = config.tolerance * config.tau + EPS32 * float(result.norm())
    assert _distance(result, honest_mean) <= config.tau / 15 + slack


def test_weigh_by_samples_without_outliers_is_the_weighted_mean(seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    local = {p: torch.randn(999, generator=g) * 2 for p in _IDS[:8]}
    samples = {p: float(rng.randint(1, 100)) for p in _IDS[:8]}
    config = CenteredClipConfig(tau=1e6, weigh_by_samples=True)
    group = Group(_spec(8, 999, 40, rng, config), local, samples, seed)
    group.run()
    counted = capped_sample_weights(samples, DEFAULT_MAX_WEIGHT_RATIO)  # as reducers count
    total = sum(counted.values())
    expected = sum(local[p].double() * counted[p] for p in local) / total
    assert isinstance(expected, torch.Tensor)
    torch.testing.assert_close(group.results()[0].averaged, expected.float())


def test_clipping_is_over_whole_parts_whatever_the_chunks(seed: int) -> None:
    """The chunk size changes how parts stream, never what a part's clip sees."""
    local, _, spread = _poisoned_vectors(seed, total=1024)
    samples = dict.fromkeys(_IDS, 1.0)
    config = CenteredClipConfig(tau=spread / 2)  # clips honest inputs too
    results = []
    for chunk in (7, 1024):
        group = Group(_spec(16, 1024, chunk, random.Random(seed), config), local, samples, seed)
        group.run()
        results.append(group.results()[0].averaged)
    assert torch.equal(results[0], results[1])


def test_a_peer_dying_mid_round_leaves_survivors_with_the_clip_of_the_rest(
    seed: int,
) -> None:
    rng = random.Random(seed)
    local, _, spread = _poisoned_vectors(seed, total=1024)
    config = CenteredClipConfig(tau=2 * spread)
    spec = _spec(16, 1024, 32, rng, config)
    group = Group(spec, local, dict.fromkeys(_IDS, 1.0), seed)
    victim = rng.choice([p for p in _IDS if p != _IDS[5]])
    group.run(rng.randrange(len(group.queue)))  # part of the traffic, then a death
    group.kill(victim)
    group.run()
    results = group.results()
    for part in results[0].report.parts:
        assert set(_IDS) - {victim} <= part.contributors  # the victim's too if it was in
        order: Sequence[PeerID] = sorted(part.contributors)
        expected = centered_clip(
            torch.stack([local[p][part.start : part.end] for p in order]).double(),
            torch.ones(len(order), dtype=torch.float64),
            tau=config.part_tau(part.end - part.start, spec.total_elements),
            num_iterations=config.num_iterations,
            tolerance=config.tolerance,
        ).float()
        assert torch.equal(results[0].averaged[part.start : part.end], expected)
    assert math.isfinite(float(results[0].averaged.norm()))
