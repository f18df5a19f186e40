"""Several reducers per coordinate (``reducers_per_part``): the split gives each member
at most one copy's length, a dead reducer's part goes to a member free of its
coordinates where there is one, the fold is the median, and a member that publishes
a wrong average of its part moves nothing with three reducers per part; in the fault
checker's schedules and over real connections between Averagers."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from fractions import Fraction
from typing import Any

import pytest
import torch

from averaging import (
    AveragerConfig,
    AveragerError,
    ButterflyRound,
    MatchmakingError,
    OutgoingAveraged,
    PartitionError,
    RoundError,
    RoundSpec,
    fold,
    plan_reassignment,
    replicate,
    split_parts,
)
from averaging.allreduce.fault_checker import Fault, Schedule, check, random_schedule, run_schedule
from averaging.allreduce.records import copies_overlap
from peers.identity import KeyPair, PeerID
from tests.averaging.test_averager import CONFIG, Run, averagers


def _ids(n: int) -> tuple[PeerID, ...]:
    return tuple(KeyPair.from_seed(bytes([i + 1]) * 32).peer_id for i in range(n))


def test_no_part_exceeds_one_copy_and_the_rest_keep_their_proportions() -> None:
    rng = random.Random(5)
    for _ in range(500):
        n = rng.randint(3, 12)
        weights = [rng.choice([0.0, rng.uniform(0.1, 1e3), 1e15]) for _ in range(n)]
        if sum(1 for w in weights if w > 0) < 3:
            weights[:3] = [1.0, 2.0, 3.0]
        copy = rng.randint(0, 500)
        parts = split_parts(3 * copy, weights, max_share=Fraction(1, 3))
        assert parts[0][0] == 0 and parts[-1][1] == 3 * copy
        assert all(end - start <= copy for start, end in parts)
        assert all(end == start for (start, end), w in zip(parts, weights, strict=True) if w == 0)
    # below the cap, shares are untouched: [1, 1, 4] -> 4 is lowered to the others' sum
    assert split_parts(30, [1, 1, 4], max_share=Fraction(1, 3)) == [(0, 10), (10, 20), (20, 30)]
    assert split_parts(30, [1, 2, 4, 0, 8], max_share=Fraction(1, 3)) == [
        (0, 3),
        (3, 10),
        (10, 20),
        (20, 20),
        (20, 30),
    ]
    with pytest.raises(PartitionError, match="cannot each hold"):
        split_parts(30, [1, 1, 0], max_share=Fraction(1, 3))


def test_the_copies_of_every_coordinate_fall_to_distinct_reducers() -> None:
    rng = random.Random(6)
    for _ in range(200):
        n = rng.randint(3, 9)
        copy = rng.randint(1, 200)
        spec = RoundSpec(
            round_id=b"r",
            members=_ids(n),
            weights=tuple(rng.choice([0.0, 1.0, 5.0, 1e9]) for _ in range(n - 3)) + (1.0,) * 3,
            total_elements=3 * copy,
            chunk_elements=16,
            me=_ids(n)[0],
            reducers_per_part=3,
        )
        parts = spec.parts()
        assert parts[0][0] == 0 and parts[-1][1] == 3 * copy
        assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
        owner = torch.full((3 * copy,), -1)
        for (start, end), member in zip(parts, spec.owners, strict=True):
            owner[start:end] = member
        copies = owner.view(3, copy)
        assert all(len(set(copies[:, j].tolist())) == 3 for j in range(copy))
        # a cell's coordinates have the same three owners throughout
        for start, end in parts:
            coordinates = torch.arange(start, end) % copy
            assert len({tuple(copies[:, j].tolist()) for j in coordinates.tolist()}) <= 1


def _heirs_are_free(spec: RoundSpec, victim: int) -> bool:
    """Whether every cell of ``victim``'s goes to a member holding no other copy of it."""
    parts, owners = spec.parts(), spec.owners
    plan = plan_reassignment(spec, {spec.members[victim]})
    assert set(plan) == {
        i for i, o in enumerate(owners) if o == victim and parts[i][1] > parts[i][0]
    }
    for i, heir in plan.items():
        held = [p for p, o in zip(parts, owners, strict=True) if spec.members[o] == heir]
        held += [parts[j] for j, h in plan.items() if h == heir and j != i]
        if any(copies_overlap(parts[i], other, spec.copy_elements) for other in held):
            return False
    return True


def test_a_dead_reducers_cells_go_to_members_free_of_their_coordinates() -> None:
    """From four members able to reduce, whoever dies: each of its cells has two other
    owners, so a third member is free of it. Three members share every coordinate, so
    a death there gives one of the two others a second copy (liveness first)."""
    rng = random.Random(7)
    for n in range(4, 9):
        for trial in range(5):
            weights = tuple(1.0 if trial == 0 else rng.uniform(0.5, 3.0) for _ in range(n))
            spec = RoundSpec(
                round_id=b"heirs %d" % trial,
                members=_ids(n),
                weights=weights,
                total_elements=3 * 97,
                chunk_elements=8,
                me=_ids(n)[0],
                reducers_per_part=3,
            )
            for victim in range(n):
                assert _heirs_are_free(spec, victim), (n, weights, victim)
    three = RoundSpec(
        round_id=b"three",
        members=_ids(3),
        weights=(1.0,) * 3,
        total_elements=3 * 40,
        chunk_elements=8,
        me=_ids(3)[0],
        reducers_per_part=3,
    )
    assert not _heirs_are_free(three, 1)


def test_a_spec_that_cannot_hold_its_copies_is_refused() -> None:
    members = _ids(3)
    base: dict[str, Any] = dict(
        round_id=b"r", members=members, chunk_elements=8, me=members[0], reducers_per_part=3
    )
    with pytest.raises(RoundError, match="3 equal copies"):
        RoundSpec(weights=(1.0, 1.0, 1.0), total_elements=10, **base)
    with pytest.raises(RoundError, match="positive weight"):
        RoundSpec(weights=(1.0, 1.0, 0.0), total_elements=9, **base)
    with pytest.raises(RoundError, match="reducers_per_part"):
        RoundSpec(weights=(1.0,) * 3, total_elements=8, **{**base, "reducers_per_part": 2})
    one = RoundSpec(weights=(1.0,) * 3, total_elements=9, **base)
    assert one.digest() != dataclasses.replace(one, reducers_per_part=1).digest()
    with pytest.raises(AveragerError, match="reducers_per_part"):
        AveragerConfig(prefix="p", reducers_per_part=4)


def test_the_fold_is_the_median_of_the_copies() -> None:
    flat = torch.tensor([1.0, -2.0, 3.0])
    copies = replicate(flat, 3).clone()
    copies[1] += 1e6  # one copy of coordinate 1 lies
    copies[3 + 2] = float("-1e30")  # another copy of coordinate 2 lies
    folded = fold(copies, 3)
    assert torch.equal(folded.values, flat)
    assert folded.spread == pytest.approx(1e30)
    assert fold(flat, 1).values is flat and fold(flat, 1).spread == 0.0
    with pytest.raises(ValueError, match="not 3 copies"):
        fold(torch.zeros(4), 3)


# --- a lying reducer in the fault checker's rounds (in-memory network) ----------------


def _lie(liar: int, copies: int, *faults: Fault) -> Schedule:
    return Schedule(
        seed=11,
        num_members=4,
        clients=(),
        total_elements=60,
        chunk_elements=8,
        latency=0.01,
        faults=(Fault("lie", liar, at_frame=1), *faults),
        reducers_per_part=copies,
    )


def test_one_reducer_per_part_lets_a_liar_move_its_part_three_do_not() -> None:
    for liar in range(4):
        alone = _lie(liar, 1)
        outcomes = run_schedule(alone)
        violations = check(alone, outcomes)
        assert [v.prop for v in violations] == ["P5"], violations  # the attack works
        honest = [o for i, o in enumerate(outcomes) if i != liar]
        assert all(o.agreed for o in honest)  # and nobody notices

        checked = _lie(liar, 3)
        outcomes = run_schedule(checked)
        assert not check(checked, outcomes)
        assert all(o.agreed for o in outcomes)
        spreads = {fold(o.averaged, 3).spread for o in outcomes if o.averaged is not None}
        assert min(spreads) >= 999.0  # the liar's copies stand out


def test_a_liars_vote_that_arrives_first_does_not_split_the_honest_members() -> None:
    """Link latencies (found by a search over random ones) under which member 3, the
    liar, votes before member 1 has heard any honest vote. Member 1 used to copy the
    leading vote, as it should when results differ through faults, and the round split
    two against two: nobody agreed. The liar's vote holds its parts with other values
    than it sent member 1 (from the same reducer over the same members), so member 1 now
    votes for what it holds."""
    latency = (
        (0, 1, 0.3), (0, 2, 0.1), (1, 0, 0.2), (1, 2, 0.05), (2, 0, 0.2),
        (2, 1, 0.1), (2, 3, 0.2), (3, 0, 0.05), (3, 1, 0.1), (3, 2, 0.3),
    )  # fmt: skip
    schedule = dataclasses.replace(_lie(3, 3), latency=0.001, link_latency=latency)
    outcomes = run_schedule(schedule)
    assert not check(schedule, outcomes)
    assert all(o.agreed for o in outcomes)
    assert all(fold(o.averaged, 3).spread >= 999.0 for o in outcomes if o.averaged is not None)


def test_a_liar_with_a_dead_reducer_beside_it() -> None:
    """Six members: the dead one's part goes to a member free of its coordinates, so
    the liar still holds one copy of each, whoever dies."""
    for victim in range(1, 6):
        schedule = dataclasses.replace(
            _lie(0, 3, Fault("kill", victim, at_frame=20)), num_members=6
        )
        outcomes = run_schedule(schedule)
        assert not check(schedule, outcomes), victim
        assert sum(o.agreed for o in outcomes) >= 4


def test_the_random_byzantine_schedules_include_liars_with_three_reducers() -> None:
    liars = [
        s
        for s in (random_schedule(seed, byzantine=True) for seed in range(200))
        if s.faults[0].kind == "lie"
    ]
    assert len(liars) > 30
    assert all(s.reducers_per_part == 3 for s in liars)
    assert all(s.num_members - len(s.clients) >= 3 for s in liars)


# --- over real connections -----------------------------------------------------------


@pytest.fixture
def lying_member(monkeypatch: pytest.MonkeyPatch) -> list[PeerID]:
    """Whoever is put in the list publishes every part it reduces plus 1000."""
    liars: list[PeerID] = []
    honest = ButterflyRound.publishable_chunks

    def publishable_chunks(self: ButterflyRound, part_index: int) -> list[OutgoingAveraged]:
        chunks = honest(self, part_index)
        if self.spec.me not in liars:
            return chunks
        return [dataclasses.replace(o, values=o.values + 1000.0) for o in chunks]

    monkeypatch.setattr(ButterflyRound, "publishable_chunks", publishable_chunks)
    return liars


@pytest.mark.parametrize("copies", [1, 3])
def test_averagers_outvote_a_lying_reducer_with_three_per_part(
    arun: Run, lying_member: list[PeerID], copies: int
) -> None:
    config = dataclasses.replace(CONFIG, reducers_per_part=copies)

    async def main() -> None:
        async with averagers(4, config) as avgs:
            lying_member.append(avgs[3].peer.peer_id)
            originals = [{k: v.clone() for k, v in a.tensors.items()} for a in avgs]
            steps = await asyncio.gather(*(a.step(0) for a in avgs))
            assert all(s.outcome.transfer.agreed for s in steps)
            assert {s.reducers_per_part for s in steps} == {copies}
            expected = {name: sum(o[name].double() for o in originals) / 4 for name in originals[0]}
            moved = 0.0
            for a in avgs[:3]:
                for name, value in expected.items():
                    moved = max(moved, float((a.tensors[name].double() - value).abs().max()))
            if copies == 1:
                assert moved > 500  # the liar's part is 1000 off at every honest peer
            else:
                assert moved < 1e-2  # (float16 and float64 tensors: rounding only)
                assert all(s.spread > 999 for s in steps)

    arun(main())


def test_two_peers_asked_for_three_reducers_per_part_do_not_average(arun: Run) -> None:
    """Falling back to one reducer per part would give a liar in a pair its whole part:
    the step raises instead, and the tensors stay what they were, even when a caller
    asks for a group of two."""
    config = dataclasses.replace(CONFIG, reducers_per_part=3)

    async def main() -> None:
        async with averagers(2, config) as avgs:
            before = [{k: v.clone() for k, v in a.tensors.items()} for a in avgs]
            steps = await asyncio.gather(
                *(a.step(0, timeout=3.0, target_group_size=2) for a in avgs),
                return_exceptions=True,
            )
            assert all(isinstance(s, MatchmakingError) for s in steps), steps
            for a, b in zip(avgs, before, strict=True):
                assert all(torch.equal(a.tensors[k], v) for k, v in b.items())

    arun(main())
