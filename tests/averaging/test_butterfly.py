"""Butterfly all-reduce rounds, simulated in-process (no network): n peers' state machines
with their messages delivered in random order, peers killed, stalled or sending garbage.

The exact properties (CONTRIBUTING.md, "Numerics are checked as exact properties"):
after a round every survivor holds the same tensor (``torch.equal``, and equal
fingerprints), every averaged part is averaged over a set that contains every survivor
and equals the weighted mean over that set within float32 rounding, and no result holds
NaN.

Randomised tests print their seed; set SWARMTRAIN_TEST_SEED to replay one.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from averaging import (
    ButterflyRound,
    ChunkDeferred,
    ChunksAveraged,
    Outgoing,
    OutgoingAveraged,
    PartAbandoned,
    PartReady,
    PartReassigned,
    PeerExcluded,
    RejectedChunk,
    RejectReason,
    RoundError,
    RoundEvent,
    RoundResult,
    RoundSpec,
    Withdrawn,
    plan_reassignment,
)
from averaging.allreduce.reduction import capped_sample_weights
from peers.identity import KeyPair, PeerID

ROUND_ID = b"round-0001"


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("SWARMTRAIN_TEST_SEED", random.randrange(2**32)))
    print(f"seed={value} (replay with SWARMTRAIN_TEST_SEED={value})")
    return value


_IDS = [KeyPair.from_seed(bytes([i + 1]) * 32).peer_id for i in range(16)]


@dataclass
class Message:
    kind: str  # "chunk", "averaged", "notice" (from the local wire layer) or "gossip"
    sender: PeerID
    to: PeerID
    chunk: Outgoing | OutgoingAveraged | None = None
    failed: PeerID | None = None


class Swarm:
    """n rounds whose messages are delivered one at a time in a seeded random order."""

    def __init__(
        self,
        n: int,
        seed: int,
        *,
        bandwidth: Sequence[float] | None = None,
        total_elements: int = 1000,
        chunk_elements: int = 17,
        lossy: bool = False,
        gossip: bool = False,
    ) -> None:
        self.rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.ids = _IDS[:n]
        weights = bandwidth or [self.rng.uniform(0.5, 2.0) for _ in range(n)]
        self.spec = RoundSpec(
            round_id=ROUND_ID,
            members=tuple(self.ids),
            weights=tuple(weights),
            total_elements=total_elements,
            chunk_elements=chunk_elements,
            me=self.ids[0],
        )
        self.local = {p: torch.randn(total_elements, generator=g) * 3 for p in self.ids}
        self.samples = {p: float(self.rng.randint(1, 100)) for p in self.ids}
        self.rounds = {
            p: ButterflyRound(dataclasses.replace(self.spec, me=p), self.local[p], self.samples[p])
            for p in self.ids
        }
        self.lossy = lossy
        self.gossip = gossip
        self.queue: list[Message] = []
        self.dead: set[PeerID] = set()
        self.log: dict[PeerID, list[RoundEvent]] = {p: [] for p in self.ids}
        for p in self.ids:
            for out in self.rounds[p].outgoing_chunks():
                self.queue.append(Message("chunk", p, out.to, out))

    def handle(self, peer: PeerID, events: list[RoundEvent]) -> None:
        self.log[peer] += events
        machine = self.rounds[peer]
        for event in events:
            if isinstance(event, (PartReady, ChunksAveraged)):
                for out in machine.publishable_chunks(event.part_index):
                    if self.lossy:  # what a float16 codec on the way back would deliver
                        out = dataclasses.replace(out, values=out.values.half().float())
                        machine.set_published_chunk(out.part_index, out.chunk_index, out.values)
                    self.queue.append(Message("averaged", peer, out.to, out))
            elif isinstance(event, PartReassigned):
                for chunk in event.outgoing:
                    self.queue.append(Message("chunk", peer, chunk.to, chunk))
            elif isinstance(event, PeerExcluded) and self.gossip:
                for to in self.ids:
                    if to != peer:
                        self.queue.append(Message("gossip", peer, to, failed=event.peer))

    def deliver(self, message: Message) -> None:
        if message.to in self.dead or message.sender in self.dead:
            return
        machine = self.rounds[message.to]
        if message.kind == "notice":
            assert message.failed is not None
            self.handle(message.to, machine.on_sender_failed(message.failed, "died"))
        elif message.kind == "gossip":
            assert message.failed is not None
            notice = frozenset({message.failed})
            self.handle(message.to, machine.on_exclusion_notice(message.sender, ROUND_ID, notice))
        elif isinstance(message.chunk, Outgoing):
            c = message.chunk
            events = machine.on_chunk(
                message.sender, ROUND_ID, c.part_index, c.chunk_index, c.values, c.weight
            )
            self.handle(message.to, events)
        else:
            assert isinstance(message.chunk, OutgoingAveraged)
            a = message.chunk
            events = machine.on_averaged_chunk(
                message.sender, ROUND_ID, a.part_index, a.chunk_index, a.values, a.contributors
            )
            self.handle(message.to, events)

    def run(self, steps: int | None = None) -> None:
        """Deliver ``steps`` random messages (all of them, and those they cause, if None)."""
        while self.queue and (steps is None or steps > 0):
            i = self.rng.randrange(len(self.queue))
            self.queue[i], self.queue[-1] = self.queue[-1], self.queue[i]
            self.deliver(self.queue.pop())
            steps = None if steps is None else steps - 1

    def kill(self, peer: PeerID, *, notify: bool = True) -> None:
        """``peer`` dies; with ``notify``, every live peer's wire layer notices (a reset
        connection), each at a random point of the remaining traffic."""
        self.dead.add(peer)
        if notify:
            for p in self.alive:  # a local notice: from p's own wire layer to p
                self.queue.append(Message("notice", p, p, failed=peer))

    def settle(self, max_deadlines: int = 8) -> None:
        """Deliver everything; then, while a live peer is not done, let the next deadline
        pass and deliver again. Reducers time out on senders before receivers time out
        on reducers (the receivers' timeout is longer, and restarts when a part moves),
        so a receiver's deadline passes only when no reducer is waiting for a sender."""
        for _ in range(max_deadlines):
            self.run()
            machines = [self.rounds[p] for p in self.alive]
            if all(m.is_done() for m in machines):
                return
            senders_late = any(m.missing_senders() for m in machines)
            for m, p in zip(machines, self.alive, strict=True):
                if senders_late:
                    for late in sorted(m.missing_senders()):
                        self.handle(p, m.on_sender_failed(late, "stalled"))
                else:
                    for late in sorted(m.missing_reducers()):
                        self.handle(p, m.on_reducer_failed(late, "stalled"))
        self.run()

    @property
    def alive(self) -> list[PeerID]:
        return [p for p in self.ids if p not in self.dead]

    def weighted_mean(self, contributors: frozenset[PeerID]) -> torch.Tensor:
        """The contributors' mean, each weight capped as the reducers cap it."""
        counted = capped_sample_weights(
            {p: self.samples[p] for p in contributors}, self.spec.max_weight_ratio
        )
        total = sum(counted.values())
        acc = sum(self.local[p].double() * counted[p] for p in contributors)
        assert isinstance(acc, torch.Tensor)
        return (acc / total).float()

    def check(self, survivors: Sequence[PeerID], *, full: bool = True) -> list[RoundResult]:
        """The exact properties, on ``survivors``; returns their results."""
        results = [self.rounds[p].result() for p in survivors]
        first = results[0]
        atol = 2e-2 if self.lossy else 1e-5
        for result in results:
            assert torch.isfinite(result.averaged).all()
            assert result.fingerprint() == first.fingerprint()
            if full:
                assert result.report.fraction_averaged == 1.0
                assert torch.equal(result.averaged, first.averaged)
            for part in result.report.parts:
                if part.end == part.start or not part.averaged:
                    continue
                assert part == first.report.parts[part.part_index]
                got = result.averaged[part.start : part.end]
                assert torch.equal(got, first.averaged[part.start : part.end])
                assert set(survivors) <= part.contributors
                expected = self.weighted_mean(part.contributors)[part.start : part.end]
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)
        return results


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_round_averages_and_survivors_agree(n: int, seed: int) -> None:
    swarm = Swarm(n, seed)
    swarm.run()
    assert all(swarm.rounds[p].is_done() for p in swarm.ids)
    swarm.check(swarm.ids)
    if n > 1:  # every peer received exactly its share of averaged chunks: no duplicates
        stats = swarm.rounds[swarm.ids[0]].statistics()
        assert stats.num_chunks_rejected == 0 and stats.num_peers_excluded == 0


def test_weights_are_respected(seed: int) -> None:
    swarm = Swarm(3, seed, total_elements=64)
    a, b, c = swarm.ids
    swarm.local = {a: torch.full((64,), 1.0), b: torch.full((64,), 2.0), c: torch.full((64,), 4.0)}
    swarm.samples = {a: 1.0, b: 3.0, c: 4.0}
    swarm.rounds = {
        p: ButterflyRound(dataclasses.replace(swarm.spec, me=p), swarm.local[p], swarm.samples[p])
        for p in swarm.ids
    }
    swarm.queue = [
        Message("chunk", p, out.to, out)
        for p in swarm.ids
        for out in swarm.rounds[p].outgoing_chunks()
    ]
    swarm.run()
    for result in swarm.check(swarm.ids):
        assert torch.equal(result.averaged, torch.full((64,), (1 + 6 + 16) / 8))


def test_client_mode_members_send_but_reduce_nothing(seed: int) -> None:
    swarm = Swarm(5, seed, bandwidth=[1.0, 0.0, 2.0, 0.0, 1.0])
    clients = [swarm.ids[1], swarm.ids[3]]
    for i in (1, 3):
        start, end = swarm.spec.parts()[i]
        assert start == end
    swarm.run()
    for client in clients:
        stats = swarm.rounds[client].statistics()
        assert stats.num_chunks_accepted == 0 and swarm.rounds[client].my_part_ready()
        assert not any(isinstance(e, PartReady) for e in swarm.log[client])
    for result in swarm.check(swarm.ids):  # their vectors are in every part
        assert all(set(clients) <= p.contributors for p in result.report.parts if p.end > p.start)


@pytest.mark.parametrize("n", [3, 8, 16])
def test_sender_dies_mid_round(n: int, seed: int) -> None:
    swarm = Swarm(n, seed)
    swarm.run(steps=len(swarm.queue) // 3)
    victim = swarm.ids[swarm.rng.randrange(n)]
    swarm.kill(victim)
    swarm.run()
    swarm.check(swarm.alive)  # its part was reassigned: every coordinate averaged


def test_sender_dead_from_the_start_is_averaged_out(seed: int) -> None:
    swarm = Swarm(6, seed)
    victim = swarm.ids[2]
    swarm.kill(victim)
    swarm.run()
    for result in swarm.check(swarm.alive):
        for part in result.report.parts:
            assert part.end == part.start or part.contributors == set(swarm.alive)


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_reducer_dies_and_its_part_is_reassigned(n: int, seed: int) -> None:
    swarm = Swarm(n, seed)
    swarm.run(steps=swarm.rng.randrange(len(swarm.queue)))
    victim = swarm.ids[swarm.rng.randrange(n)]
    swarm.kill(victim)
    swarm.run()
    plan = plan_reassignment(swarm.spec, {victim})
    for result in swarm.check(swarm.alive):
        part = result.report.parts[swarm.ids.index(victim)]
        assert part.reducer == plan[part.part_index]


def test_new_reducer_dies_too(seed: int) -> None:
    swarm = Swarm(8, seed)
    first = swarm.ids[3]
    swarm.kill(first)
    swarm.run(steps=len(swarm.queue) // 2)
    second = plan_reassignment(swarm.spec, {first})[3]
    swarm.kill(second)
    swarm.run()
    plan = plan_reassignment(swarm.spec, {first, second})
    for result in swarm.check(swarm.alive):
        assert result.report.parts[3].reducer == plan[3] not in (first, second)


def test_stalled_peers_found_by_deadline_without_notices(seed: int) -> None:
    """Peers die silently; each survivor's deadline reports whoever it still waits for;
    exclusions spread with the published parts. Never a hang: a few deadlines suffice."""
    swarm = Swarm(8, seed)
    swarm.run(steps=len(swarm.queue) // 4)
    for victim in swarm.rng.sample(swarm.ids, 2):
        swarm.kill(victim, notify=False)
    swarm.settle()
    swarm.check(swarm.alive)


def test_reducer_dies_after_serving_some_peers(seed: int) -> None:
    """Rule 3 with notices: a peer that already holds the dead reducer's whole part
    learns of the death from the others and re-reduces it with them."""
    swarm = Swarm(5, seed, gossip=True)
    reducer, served = swarm.ids[1], swarm.ids[3]
    while not swarm.rounds[reducer].my_part_ready():
        swarm.run(steps=1)
    for message in [m for m in swarm.queue if m.kind == "averaged" and m.to == served]:
        swarm.queue.remove(message)
        swarm.deliver(message)
    assert reducer not in swarm.rounds[served].missing_reducers()  # it holds part 1
    swarm.kill(reducer, notify=False)
    swarm.settle()
    heir = plan_reassignment(swarm.spec, {reducer})[1]
    for result in swarm.check(swarm.alive):
        assert result.report.parts[1].reducer == heir


def test_random_failures_with_notices(seed: int) -> None:
    """Chaos: random groups (some members client-mode), random deaths at random times
    (noticed or silent), sometimes a sender of NaN; notices flood. Every survivor ends
    with the same tensor, averaged everywhere some reducer survived."""
    rng = random.Random(seed)
    for _ in range(12):
        n = rng.randint(2, 10)
        bandwidth = [rng.choice([0.0, 1.0, rng.uniform(0.3, 3.0)]) for _ in range(n)]
        bandwidth[rng.randrange(n)] = 1.0
        swarm = Swarm(
            n,
            rng.randrange(2**32),
            bandwidth=bandwidth,
            gossip=True,
            total_elements=rng.choice([1, 5, 300]),
            chunk_elements=rng.choice([1, 7, 50]),
        )
        reducers = [p for p, w in zip(swarm.ids, bandwidth, strict=True) if w > 0]
        bad = None
        if n >= 3 and rng.random() < 0.5:
            parts = swarm.spec.parts()
            target = rng.choice([p for p, (s, e) in zip(swarm.ids, parts, strict=True) if e > s])
            bad = rng.choice([p for p in swarm.ids if p != target])
            start, end = swarm.spec.parts()[swarm.ids.index(target)]
            size = min(swarm.spec.chunk_elements, end - start)
            _inject(swarm, bad, target, values=torch.full((size,), float("nan")))
        for victim in rng.sample(
            [p for p in swarm.ids if p != bad], rng.randint(0, n - 1 - (bad is not None))
        ):
            swarm.run(steps=rng.randrange(len(swarm.queue) + 1))
            swarm.kill(victim, notify=rng.random() < 0.5)
        swarm.settle()
        honest = [p for p in swarm.alive if p != bad]
        # The NaN's only witness may have died before telling anyone (but perhaps the
        # sender of NaN, which then withdrew): else it is as much a survivor as any.
        knows_bad = {p for p in honest if bad in swarm.rounds[p].failed}
        assert knows_bad in (set(), set(honest))
        survivors = list(honest)
        if bad is not None and not knows_bad and not swarm.rounds[bad].excluded_by:
            survivors.append(bad)
        for p in survivors:  # no survivor is counted out (a dead peer that was never
            # waited for may go unnoticed: it was not needed)
            assert not set(swarm.rounds[p].failed) & set(survivors)
            assert not swarm.rounds[p].excluded_by
        any_reducer = any(p in reducers for p in survivors)
        swarm.check(survivors, full=any_reducer)


def test_lossy_published_parts_stay_identical(seed: int) -> None:
    swarm = Swarm(4, seed, lossy=True)
    swarm.run()
    swarm.check(swarm.ids)


def _inject(
    swarm: Swarm, source: PeerID, reducer: PeerID, /, **changes: object
) -> list[RoundEvent]:
    """Deliver a chunk from ``source`` to ``reducer`` (of the reducer's part) with the
    given fields changed; returns the reducer's events."""
    part = swarm.ids.index(reducer)
    chunk = next(o for o in swarm.rounds[source].outgoing_chunks() if o.part_index == part)
    fields: dict[str, object] = {
        "sender": source,
        "round_id": ROUND_ID,
        "part_index": part,
        "chunk_index": 0,
        "values": chunk.values,
        "weight": chunk.weight,
    }
    fields.update(changes)
    events = swarm.rounds[reducer].on_chunk(**fields)  # type: ignore[arg-type]
    swarm.handle(reducer, events)
    return events


GARBAGE: dict[str, tuple[dict[str, object], RejectReason]] = {
    "nan": ({"values": torch.full((17,), float("nan"))}, RejectReason.NON_FINITE),
    "inf": ({"values": torch.full((17,), float("inf"))}, RejectReason.NON_FINITE),
    "shape": ({"values": torch.zeros(16)}, RejectReason.BAD_VALUES),
    "dtype": ({"values": torch.zeros(17, dtype=torch.float64)}, RejectReason.BAD_VALUES),
    "weight": ({"weight": float("nan")}, RejectReason.BAD_WEIGHT),
    "zero-weight": ({"weight": 0.0}, RejectReason.BAD_WEIGHT),
    "chunk": ({"chunk_index": 10**6}, RejectReason.CHUNK_OUT_OF_RANGE),
    "part": ({"part_index": 99}, RejectReason.PART_OUT_OF_RANGE),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_garbage_sender_is_excluded_and_survivors_agree(kind: str, seed: int) -> None:
    swarm = Swarm(6, seed)
    bad, reducer = swarm.ids[1], swarm.ids[4]
    changes, reason = GARBAGE[kind]
    events = _inject(swarm, bad, reducer, **changes)
    assert isinstance(events[0], RejectedChunk) and events[0].reason is reason
    assert PeerExcluded(bad, str(reason)) in events
    swarm.run()  # the bad peer keeps sending valid chunks; no one is told of it but by parts
    survivors = [p for p in swarm.ids if p != bad]
    for result in swarm.check(survivors):
        assert bad in result.report.failed  # adopted from the reducer's contributor set


def test_inconsistent_weight_excludes_sender(seed: int) -> None:
    swarm = Swarm(3, seed)
    a, b, _ = swarm.ids
    chunks = [o for o in swarm.rounds[a].outgoing_chunks() if o.to == b]
    first, second = chunks[0], chunks[1]
    assert swarm.rounds[b].on_chunk(a, ROUND_ID, 1, 0, first.values, first.weight) == []
    events = swarm.rounds[b].on_chunk(a, ROUND_ID, 1, 1, second.values, first.weight + 1)
    assert events[0] == RejectedChunk(a, 1, 1, RejectReason.INCONSISTENT_WEIGHT)
    assert a in swarm.rounds[b].failed


BENIGN = {
    "stale round": ({"round_id": b"round-0000"}, RejectReason.STALE_ROUND),
    "non-member": ({"sender": _IDS[15]}, RejectReason.NOT_A_MEMBER),
    "from myself": ({"sender": _IDS[4]}, RejectReason.FROM_MYSELF),
}


@pytest.mark.parametrize("kind", sorted(BENIGN))
def test_benign_rejections_exclude_no_one(kind: str, seed: int) -> None:
    swarm = Swarm(6, seed)
    changes, reason = BENIGN[kind]
    events = _inject(swarm, swarm.ids[1], swarm.ids[4], **changes)
    assert len(events) == 1 and isinstance(events[0], RejectedChunk)
    assert events[0].reason is reason and not reason.excludes_peer
    swarm.run()
    swarm.check(swarm.ids)
    assert not swarm.rounds[swarm.ids[4]].failed


def test_duplicate_chunk_is_rejected_once_counted(seed: int) -> None:
    swarm = Swarm(3, seed)
    a, b, _ = swarm.ids
    assert _inject(swarm, a, b) == []
    events = _inject(swarm, a, b, values=torch.full((17,), 1e6))  # a different duplicate
    assert events == [RejectedChunk(a, 1, 0, RejectReason.DUPLICATE)]
    swarm.run()  # the real chunk 0 arrives too and is a duplicate: still averaged once
    swarm.check(swarm.ids)


def test_chunk_of_a_part_not_mine_is_deferred_not_averaged(seed: int) -> None:
    swarm = Swarm(4, seed, bandwidth=[1.0, 1.0, 1.0, 0.0])
    a, b, c, client = swarm.ids
    part_of_c = swarm.ids.index(c)
    chunk = next(o for o in swarm.rounds[a].outgoing_chunks() if o.part_index == part_of_c)
    events = swarm.rounds[b].on_chunk(a, ROUND_ID, part_of_c, 0, chunk.values + 1e6, chunk.weight)
    assert events == [ChunkDeferred(a, part_of_c, 0)]
    # A client-mode member can never be reassigned a part: it refuses to hold one.
    events = swarm.rounds[client].on_chunk(a, ROUND_ID, part_of_c, 0, chunk.values, chunk.weight)
    assert events == [RejectedChunk(a, part_of_c, 0, RejectReason.NOT_MY_PART)]
    swarm.run()
    swarm.check(swarm.ids)  # the deferred chunk never entered a mean
    assert swarm.rounds[b].statistics().num_chunks_deferred == 1


def test_deferred_chunks_feed_a_reassigned_part(seed: int) -> None:
    """A sender learns of a reducer's death before the new reducer does."""
    swarm = Swarm(5, seed)
    victim = swarm.ids[2]
    heir = plan_reassignment(swarm.spec, {victim})[2]
    swarm.dead.add(victim)
    early = next(p for p in swarm.ids if p not in (victim, heir))
    events = swarm.rounds[early].on_reducer_failed(victim)
    moved = next(e for e in events if isinstance(e, PartReassigned))
    assert moved.new_reducer == heir and len(moved.outgoing) > 0
    for chunk in moved.outgoing:  # they reach the heir before it learns of the death
        got = swarm.rounds[heir].on_chunk(
            early, ROUND_ID, 2, chunk.chunk_index, chunk.values, chunk.weight
        )
        assert got == [ChunkDeferred(early, 2, chunk.chunk_index)]
    swarm.run()
    for p in swarm.alive:
        if p != early:
            swarm.handle(p, swarm.rounds[p].on_reducer_failed(victim))
    swarm.run()
    swarm.check(swarm.alive)


def _averaged(swarm: Swarm, reducer: PeerID, to: PeerID) -> OutgoingAveraged:
    part = swarm.rounds[reducer].reduced_part()
    return next(o for o in swarm.rounds[reducer].published_chunks(part.part_index) if o.to == to)


def test_garbage_averaged_chunk_fails_the_reducer(seed: int) -> None:
    swarm = Swarm(4, seed)
    r, q = swarm.ids[1], swarm.ids[2]
    for _ in range(10_000):
        if swarm.rounds[r].my_part_ready():
            break
        swarm.run(steps=1)
    out = _averaged(swarm, r, q)
    events = swarm.rounds[q].on_averaged_chunk(
        r, ROUND_ID, out.part_index, 0, out.values * float("nan"), out.contributors
    )
    assert events[0] == RejectedChunk(r, out.part_index, 0, RejectReason.NON_FINITE)
    assert isinstance(events[1], PeerExcluded)
    assert any(isinstance(e, PartReassigned) and e.old_reducer == r for e in events)
    swarm.handle(q, events)
    swarm.kill(r)  # q's wire layer tells the others (here: r is dropped everywhere)
    swarm.run()
    swarm.check(swarm.alive)


def test_left_out_peer_withdraws_and_others_adopt_exclusions(seed: int) -> None:
    swarm = Swarm(4, seed)
    a, b, c, d = swarm.ids
    for _ in range(10_000):
        if swarm.rounds[a].my_part_ready():
            break
        swarm.run(steps=1)
    out = _averaged(swarm, a, b)
    # a's part leaves b out: the others count b as failed, so b withdraws (rule 5)
    # instead of excluding a, which would split the group.
    machine = swarm.rounds[b]
    events = machine.on_averaged_chunk(a, ROUND_ID, 0, 0, out.values, out.contributors - {b})
    assert events == [RejectedChunk(a, 0, 0, RejectReason.EXCLUDES_ME), Withdrawn(a)]
    assert not machine.failed and machine.excluded_by == {a} and machine.is_done()
    result = machine.result()
    assert torch.equal(result.averaged, swarm.local[b]) and result.report.fraction_averaged == 0
    assert list(machine.outgoing_chunks()) == [] and machine.waiting_for() == set()
    assert machine.on_averaged_chunk(a, ROUND_ID, 0, 0, out.values, out.contributors) == []
    assert machine.on_sender_failed(c) == []
    # c is told that d is out: it adopts that exclusion (rule 4).
    chunks = [o for o in swarm.rounds[a].published_chunks(0) if o.to == c]
    events = swarm.rounds[c].on_averaged_chunk(
        a, ROUND_ID, 0, 0, chunks[0].values, out.contributors - {d}
    )
    assert events[0] == PeerExcluded(d, f"excluded by reducer {a}")
    assert a not in swarm.rounds[c].failed and d in swarm.rounds[c].failed
    # A chunk over more members than an earlier one was sent before the reducer dropped
    # one (links reorder nothing, but a lost race must not cost the reducer): ignored.
    events = swarm.rounds[c].on_averaged_chunk(
        a, ROUND_ID, 0, 1, chunks[1].values, out.contributors
    )
    assert events == [RejectedChunk(a, 0, 1, RejectReason.SUPERSEDED)]
    assert a not in swarm.rounds[c].failed
    # Contributors may only shrink within one part: another set is a faulty reducer.
    events = swarm.rounds[c].on_averaged_chunk(
        a, ROUND_ID, 0, 1, chunks[1].values, out.contributors - {b}
    )
    assert events[0] == RejectedChunk(a, 0, 1, RejectReason.INCONSISTENT_CONTRIBUTORS)
    assert a in swarm.rounds[c].failed


def test_exclusion_notices(seed: int) -> None:
    swarm = Swarm(4, seed)
    a, b, c, d = swarm.ids
    machine = swarm.rounds[a]
    assert machine.on_exclusion_notice(b, b"old-round", frozenset({c})) == []
    assert machine.on_exclusion_notice(_IDS[15], ROUND_ID, frozenset({c})) == []
    events = machine.on_exclusion_notice(b, ROUND_ID, frozenset({c}))
    assert events[0] == PeerExcluded(c, f"reported by {b}")
    events = machine.on_exclusion_notice(b, ROUND_ID, frozenset({_IDS[15]}))
    assert events[0] == PeerExcluded(b, str(RejectReason.BAD_CONTRIBUTORS))
    assert machine.on_exclusion_notice(b, ROUND_ID, frozenset({d})) == []  # b is out
    assert machine.on_exclusion_notice(d, ROUND_ID, frozenset({a})) == [Withdrawn(d)]


def test_averaged_chunk_contributors_must_be_members(seed: int) -> None:
    swarm = Swarm(3, seed)
    a, b, _ = swarm.ids
    for _ in range(10_000):
        if swarm.rounds[a].my_part_ready():
            break
        swarm.run(steps=1)
    out = _averaged(swarm, a, b)
    strangers = out.contributors | {_IDS[15]}
    events = swarm.rounds[b].on_averaged_chunk(a, ROUND_ID, 0, 0, out.values, strangers)
    assert events[0] == RejectedChunk(a, 0, 0, RejectReason.BAD_CONTRIBUTORS)
    assert a in swarm.rounds[b].failed
    events = swarm.rounds[b].on_averaged_chunk(a, b"other", 0, 0, out.values, out.contributors)
    assert events == [RejectedChunk(a, 0, 0, RejectReason.STALE_ROUND)]
    events = swarm.rounds[b].on_averaged_chunk(a, ROUND_ID, 0, 0, out.values, out.contributors)
    assert events == [RejectedChunk(a, 0, 0, RejectReason.PEER_EXCLUDED)]


def test_abandoned_part_stays_at_own_value(seed: int) -> None:
    swarm = Swarm(3, seed)
    a, _, c = swarm.ids
    swarm.kill(c, notify=False)
    swarm.run()
    machine = swarm.rounds[a]
    assert not machine.is_done() and c in machine.waiting_for()
    with pytest.raises(RoundError):
        machine.result()
    assert machine.abandon_part(2, "deadline") == [PartAbandoned(2, "deadline")]
    handled = machine.on_sender_failed(c)  # my own part stops waiting for c
    swarm.handle(a, handled)
    swarm.run()
    assert machine.is_done()
    result = machine.result()
    start, end = result.report.parts[2].start, result.report.parts[2].end
    assert torch.equal(result.averaged[start:end], swarm.local[a][start:end])
    assert result.report.parts[2].averaged is False and result.report.parts[2].reducer is None
    assert result.report.fraction_averaged == pytest.approx(1 - (end - start) / 1000)


def test_giving_up_at_the_deadline_resolves_a_part_inherited_on_the_way() -> None:
    """b dies unnoticed; at a's deadline excluding b hands a b's part, whose chunks c and
    d never sent a (they do not know). Excluding b and abandoning the rest once left a
    not done, and the round raised RoundError from its end instead of returning."""
    swarm = Swarm(4, 0)
    # (a, b): a member and one whose part goes to it when it fails
    a, b = next(
        (plan_reassignment(swarm.spec, {b})[i], b)
        for i, b in enumerate(swarm.ids)
        if plan_reassignment(swarm.spec, {b})
    )
    swarm.kill(b, notify=False)
    swarm.run()
    machine = swarm.rounds[a]
    assert machine.missing_senders() == {b}  # what one pass would exclude
    events = machine.give_up("deadline")
    assert machine.is_done()
    assert any(isinstance(e, PartReassigned) and e.new_reducer == a for e in events), events
    result = machine.result()  # returns; the report says what was left out
    assert result.report.fraction_averaged < 1.0
    assert not torch.isnan(result.averaged).any()


def test_plan_reassignment_is_deterministic(seed: int) -> None:
    rng = random.Random(seed)
    spec = RoundSpec(
        round_id=ROUND_ID,
        members=tuple(_IDS[:8]),
        weights=(1.0, 0.0, 1.0, 2.0, 1.0, 0.0, 1.0, 1.0),
        total_elements=10_000,
        chunk_elements=100,
        me=_IDS[0],
    )
    failed = set(rng.sample(_IDS[:8], 3))
    plan = plan_reassignment(spec, failed)
    assert plan == plan_reassignment(spec, frozenset(reversed(sorted(failed))))
    assert set(plan) == {i for i, m in enumerate(spec.members) if m in failed and spec.weights[i]}
    for target in plan.values():
        assert target not in failed and spec.weights[spec.members.index(target)] > 0
    # Only client-mode members survive: nothing can be reassigned.
    reducers = {m for m, w in zip(spec.members, spec.weights, strict=True) if w > 0}
    assert plan_reassignment(spec, reducers) == {}


def test_round_spec_and_local_are_validated() -> None:
    good = {
        "round_id": ROUND_ID,
        "members": tuple(_IDS[:2]),
        "weights": (1.0, 1.0),
        "total_elements": 10,
        "chunk_elements": 4,
        "me": _IDS[0],
    }
    RoundSpec(**good)  # type: ignore[arg-type]
    for field, bad in [
        ("round_id", b""),
        ("round_id", b"x" * 65),
        ("members", (_IDS[0], _IDS[0])),
        ("weights", (1.0,)),
        ("me", _IDS[5]),
        ("chunk_elements", 0),
    ]:
        with pytest.raises(RoundError):
            RoundSpec(**{**good, field: bad})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RoundSpec(**{**good, "weights": (0.0, 0.0)})  # type: ignore[arg-type]
    spec = RoundSpec(**good)  # type: ignore[arg-type]
    for local, weight in [
        (torch.zeros(9), 1.0),
        (torch.zeros(10, dtype=torch.float64), 1.0),
        (torch.full((10,), float("nan")), 1.0),
        (torch.zeros(10), 0.0),
    ]:
        with pytest.raises(RoundError):
            ButterflyRound(spec, local, weight)
    machine = ButterflyRound(spec, torch.zeros(10), 1.0)
    with pytest.raises(RoundError):
        machine.on_sender_failed(_IDS[0])  # not myself
    with pytest.raises(RoundError):
        machine.reassign_part(1, _IDS[0])  # its reducer is alive


def _three_equal_members(total: int, chunk: int) -> RoundSpec:
    """A round of the first three ids, equal weights, seen by the first."""
    a, b, c = _IDS[:3]
    return RoundSpec(
        round_id=ROUND_ID,
        members=(a, b, c),
        weights=(1.0, 1.0, 1.0),
        total_elements=total,
        chunk_elements=chunk,
        me=a,
    )


def _deliver_in_order(rounds: dict[PeerID, ButterflyRound]) -> None:
    """Deliver every chunk and averaged chunk, first sent first, with no failures."""
    queue: list[tuple[PeerID, object]] = [
        (p, item) for p in rounds for item in rounds[p].outgoing_chunks()
    ]
    while queue:
        sender, item = queue.pop(0)
        if isinstance(item, Outgoing):
            events = rounds[item.to].on_chunk(
                sender, ROUND_ID, item.part_index, item.chunk_index, item.values, item.weight
            )
        else:
            assert isinstance(item, OutgoingAveraged)
            events = rounds[item.to].on_averaged_chunk(
                sender, ROUND_ID, item.part_index, item.chunk_index, item.values, item.contributors
            )
        for event in events:
            if isinstance(event, PartReady):
                queue += [(item.to, o) for o in rounds[item.to].published_chunks(event.part_index)]


def test_a_result_handed_out_never_changes_when_a_late_exclusion_reopens_the_round() -> None:
    """Done, result taken, then a notice excludes a reducer whose part I hold: the part
    is reassigned to a survivor, which sends it again. The result already handed out
    keeps its values and its fingerprint."""
    a, b, c = _IDS[:3]
    spec = _three_equal_members(30, 5)
    for excluded, reporter in ((b, c), (c, b)):
        rounds = {
            p: ButterflyRound(dataclasses.replace(spec, me=p), torch.full((30,), float(i)), 1.0)
            for i, p in enumerate((a, b, c))
        }
        _deliver_in_order(rounds)
        me = rounds[a]
        assert me.is_done()
        first = me.result()
        values, fingerprint = first.averaged.clone(), first.fingerprint()
        events = me.on_exclusion_notice(reporter, ROUND_ID, frozenset({excluded}))
        reassigned = [e for e in events if isinstance(e, PartReassigned)]
        assert reassigned and not me.is_done()
        part = reassigned[0].part_index
        assert reassigned[0].new_reducer == reporter  # it sends the part again
        start, end = spec.parts()[part]
        chunk = torch.full((min(5, end - start),), 123.0)
        accepted = me.statistics().num_averaged_chunks_accepted
        me.on_averaged_chunk(reporter, ROUND_ID, part, 0, chunk, frozenset({a, reporter}))
        assert me.statistics().num_averaged_chunks_accepted == accepted + 1  # written
        assert torch.equal(first.averaged, values)
        assert first.fingerprint() == fingerprint


def test_the_fingerprint_sees_any_changed_bit_of_an_averaged_part_only() -> None:
    """One flipped bit anywhere in an averaged part, or a different contributor set,
    changes the fingerprint; values of a part left at the peer's own value do not."""
    a, b, c = _IDS[:3]
    spec = _three_equal_members(3000, 500)
    rounds = {
        p: ButterflyRound(dataclasses.replace(spec, me=p), torch.randn(3000), 1.0)
        for p in (a, b, c)
    }
    _deliver_in_order(rounds)
    result = rounds[a].result()
    fingerprint = result.fingerprint()
    gen = random.Random(7)
    for _ in range(20):
        flipped = result.averaged.clone()
        bits = flipped.view(torch.int32)
        index, bit = gen.randrange(3000), gen.randrange(32)
        bits[index] ^= 1 << bit if bit < 31 else -(2**31)
        assert dataclasses.replace(result, averaged=flipped).fingerprint() != fingerprint
    first, *rest = result.report.parts
    fewer = dataclasses.replace(first, contributors=first.contributors - {c})
    report = dataclasses.replace(result.report, parts=(fewer, *rest))
    assert dataclasses.replace(result, report=report).fingerprint() != fingerprint
    own = dataclasses.replace(first, averaged=False, reducer=None, contributors=frozenset())
    report = dataclasses.replace(result.report, parts=(own, *rest))
    changed = result.averaged.clone()
    changed[first.start : first.end] += 1.0
    assert (
        dataclasses.replace(result, report=report).fingerprint()
        == dataclasses.replace(result, averaged=changed, report=report).fingerprint()
    )


def test_chunks_go_out_as_averaged_and_again_after_an_exclusion(seed: int) -> None:
    """A reducer publishes a chunk once every member's copy of it is in, before the rest
    of its part (averages flow back while contributions still arrive). A member that
    dies mid-part is dropped: the chunks published with it are averaged again and sent
    again with fewer contributors, and receivers replace them."""
    swarm = Swarm(3, seed, total_elements=300, chunk_elements=10)
    a, b, c = swarm.ids
    reducer = swarm.rounds[a]
    part = next(i for i in range(len(swarm.spec.parts())) if reducer.reducer_of(i) == a)
    to_a = {
        p: [o for o in swarm.rounds[p].outgoing_chunks() if o.to == a and o.part_index == part]
        for p in (b, c)
    }
    assert len(to_a[b]) > 2
    first = {p: to_a[p][0] for p in (b, c)}
    assert reducer.on_chunk(b, ROUND_ID, part, 0, first[b].values, swarm.samples[b]) == []
    events = reducer.on_chunk(c, ROUND_ID, part, 0, first[c].values, swarm.samples[c])
    assert events == [ChunksAveraged(part, (0,))]
    early = reducer.publishable_chunks(part)
    assert sorted(o.to for o in early) == sorted([b, c])
    assert all(o.chunk_index == 0 and o.contributors == {a, b, c} for o in early)
    start, end = early[0].start, early[0].end
    expected = swarm.weighted_mean(frozenset({a, b, c}))[start:end]
    torch.testing.assert_close(early[0].values, expected, rtol=1e-5, atol=1e-5)
    assert reducer.publishable_chunks(part) == []  # each goes out once
    receiver = swarm.rounds[b]
    to_b = next(o for o in early if o.to == b)
    assert receiver.on_averaged_chunk(a, ROUND_ID, part, 0, to_b.values, to_b.contributors) == []
    # b sends the rest; c dies having sent chunk 0 only.
    for o in to_a[b][1:]:
        reducer.on_chunk(b, ROUND_ID, part, o.chunk_index, o.values, swarm.samples[b])
    events = reducer.on_sender_failed(c, "died")
    assert PartReady(part) in events
    again = reducer.publishable_chunks(part)
    stats = reducer.statistics()
    assert stats.num_chunks_published_early == 1 and stats.num_chunks_republished == 1
    assert {o.to for o in again} == {b} and len(again) == len(to_a[b])
    assert all(o.contributors == {a, b} for o in again)
    for o in again:
        got = receiver.on_averaged_chunk(a, ROUND_ID, part, o.chunk_index, o.values, o.contributors)
        assert all(not isinstance(e, RejectedChunk) for e in got)
    held = receiver.held_part(part)
    assert held is not None and held[1] == {a, b}
    mean = swarm.weighted_mean(frozenset({a, b}))
    part_start, part_end = swarm.spec.parts()[part]
    assert torch.equal(held[2], reducer.reduced_part(part).values)
    torch.testing.assert_close(held[2], mean[part_start:part_end], rtol=1e-5, atol=1e-5)
    # The first chunk over all three, arriving late, is ignored and costs no one.
    late = receiver.on_averaged_chunk(a, ROUND_ID, part, 0, to_b.values, to_b.contributors)
    assert late == [RejectedChunk(a, part, 0, RejectReason.SUPERSEDED)]
    assert a not in receiver.failed


def test_a_part_left_with_no_receivers_is_held_exact_not_as_first_published(seed: int) -> None:
    """Through a lossy codec a reducer holds what it published (what receivers decode);
    when the member it was published to dies before the part is final, the part ends
    over the reducer alone, and it holds its own exact values, not the stale decoded
    chunk it sent nor an unwritten buffer."""
    swarm = Swarm(2, seed, total_elements=200, chunk_elements=10, lossy=True)
    a, b = swarm.ids
    reducer = swarm.rounds[a]
    part = next(i for i in range(len(swarm.spec.parts())) if reducer.reducer_of(i) == a)
    first = next(
        o for o in swarm.rounds[b].outgoing_chunks() if o.part_index == part and o.chunk_index == 0
    )
    events = reducer.on_chunk(b, ROUND_ID, part, 0, first.values, swarm.samples[b])
    assert events == [ChunksAveraged(part, (0,))]
    (early,) = reducer.publishable_chunks(part)
    reducer.set_published_chunk(part, 0, early.values.half().float())
    events = reducer.on_sender_failed(b, "died")
    assert PartReady(part) in events and reducer.publishable_chunks(part) == []
    held = reducer.held_part(part)
    assert held is not None and held[1] == {a}
    start, end = swarm.spec.parts()[part]
    # (w * x / w: float32 rounding only)
    torch.testing.assert_close(held[2], swarm.local[a][start:end], rtol=1e-6, atol=1e-6)
