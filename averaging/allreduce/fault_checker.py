"""A randomized fault-schedule checker for butterfly rounds, Jepsen-style: real rounds
(:class:`~averaging.allreduce.service.AllReduceService`) on the in-memory network of
:mod:`peers.memory_network`, on a virtual clock, under a seeded schedule of kills,
pauses, one-way and two-way cuts, slow links and partitions, each fired at a moment or
at the k-th frame the group sends. Every schedule is then checked against the round's
promises (docs/design/agreement.md):

- P1: peers that report agreement hold bitwise identical tensors, and each part of it
  is the weighted mean of the vectors of the contributors it names;
- P2: of the two sides of a partition, at most one reports agreement;
- P3: in a schedule with one fault, a dead or paused peer costs only itself and a cut
  link at most one of its ends (a peer is *lost* when it is alive at the end and does
  not report agreement);
- P4: every round returns, within ``AllReduceConfig.return_bound``, without raising;
- P5 (exclusions): in a schedule whose one fault is a Byzantine member that accuses
  the others falsely or equivocates (``random_schedule(seed, byzantine=True)``), it
  costs at most one other member;
- P5 (a lying reducer): in every schedule with a member that publishes its parts plus
  1000, each coordinate of an agreed result lies between the honest means of its copies
  (their contributors' weighted means), which holds with three reducers per part
  (:mod:`averaging.allreduce.replicated`) and not with one.

``python -m averaging.allreduce.fault_checker --schedules 1000`` runs seeds 0..999 and prints a
line per violation with its seed; ``--seed S`` runs one and, if it fails, shrinks it to
the fewest faults that still fail and prints that schedule (the regression tests hold
such schedules). A schedule is a pure function of its seed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from averaging.allreduce.accusations import sign_accusation
from averaging.allreduce.config import AllReduceConfig, AllReduceResult
from averaging.allreduce.records import DEFAULT_MAX_WEIGHT_RATIO, OutgoingAveraged, RoundSpec
from averaging.allreduce.reduction import capped_sample_weights
from averaging.allreduce.replicated import fold, replicate
from averaging.allreduce.service import AllReduceService
from averaging.allreduce.wire import notice_of
from peers.identity import PeerID
from peers.memory_network import MemoryNetwork, MemoryPeer
from peers.virtual_clock import VirtualClockError, run_virtual

#: Timeouts of the checked rounds, in virtual seconds (the ratios of the defaults).
CONFIG = AllReduceConfig(
    sender_timeout=1.0, reducer_timeout=2.0, round_timeout=6.0, join_timeout=1.0
)
#: Kinds of fault a schedule may hold.
KINDS = ("kill", "cut", "cut_one_way", "pause", "partition", "slow", "reset")
#: Byzantine members, in the schedules of ``random_schedule(seed, byzantine=True)``:
#: ``accuse``: member ``a`` accuses every other member, in its own name (signed, as a
#: false observation), and goes on with the round; ``equivocate``: on each of its links
#: it sends a different "first" accusation, of the member at the other end; ``lie``:
#: every part it reduces, it publishes plus :data:`LIE`.
BYZANTINE_KINDS = ("accuse", "equivocate", "lie")
#: What a lying reducer adds to the parts it publishes.
LIE = 1000.0
#: The round id every checked round runs under.
ROUND_ID = b"checked round"


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` applied to members ``a`` (and ``b``), either ``at`` virtual
    seconds into the round or, when ``at_frame`` is set, as the group writes its
    ``at_frame``-th frame. A cut or a pause lasts ``seconds`` (0: to the end)."""

    kind: str
    a: int
    b: int = -1
    at: float = 0.0
    at_frame: int = 0
    seconds: float = 0.0
    side: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    seed: int
    num_members: int
    clients: tuple[int, ...]
    total_elements: int
    chunk_elements: int
    latency: float
    faults: tuple[Fault, ...]
    reducers_per_part: int = 1
    """Copies of the vector (``total_elements`` each), each coordinate's copies reduced
    by distinct members (:mod:`averaging.allreduce.replicated`)."""
    link_latency: tuple[tuple[int, int, float], ...] = ()
    """``(a, b, seconds)``: the one-way latency from member ``a`` to member ``b`` where it
    is not ``latency``, set before the round starts (for orders of arrival that one
    latency for every link never produces)."""


@dataclass(frozen=True)
class MemberOutcome:
    alive: bool
    agreed: bool
    returned_after: float | None
    error: str | None
    averaged: torch.Tensor | None
    result: AllReduceResult | None


@dataclass(frozen=True)
class Violation:
    prop: str
    detail: str


def random_schedule(seed: int, *, byzantine: bool = False) -> Schedule:
    """The schedule of ``seed``: 3-6 members (some client-mode), 0-3 faults. With
    ``byzantine``: the same members, and one Byzantine member (:data:`BYZANTINE_KINDS`)
    acting at a random moment, alone or (3 times in 10) with one of the seed's faults."""
    schedule = _random_schedule(seed)
    reducers = schedule.num_members - len(schedule.clients)
    # A quarter of the schedules with three members able to reduce average three copies.
    if reducers >= 3 and random.Random(f"{seed}/copies").random() < 0.25:
        schedule = dataclasses.replace(schedule, reducers_per_part=3)
    if not byzantine:
        return schedule
    rng = random.Random(f"{seed}/byzantine")
    n = schedule.num_members
    kind = rng.choice(BYZANTINE_KINDS)
    if kind == "lie" and reducers < 3:  # nothing to outvote it with: P5 needs three
        kind = rng.choice(BYZANTINE_KINDS[:2])
    if kind == "lie":  # from the start, with three reducers per part
        fault = Fault(kind, rng.randrange(n), -1, at_frame=1)
        schedule = dataclasses.replace(schedule, reducers_per_part=3)
    else:  # at a frame of the round's first half: while the round runs and links are up
        fault = Fault(kind, rng.randrange(n), -1, at_frame=rng.randint(1, n * n))
    others = schedule.faults[:1] if rng.random() < 0.3 else ()
    return dataclasses.replace(schedule, faults=(fault, *others))


def _random_schedule(seed: int) -> Schedule:
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    clients = tuple(sorted(rng.sample(range(n), rng.choice([0, 0, 0, 1]))))
    chunk = rng.choice([8, 16, 32])
    total = rng.randint(n, 12 * chunk)
    num_faults = rng.choice([0, 1, 1, 1, 2, 3])
    faults = []
    kinds = [rng.choice(KINDS) for _ in range(num_faults)]
    latency = rng.choice([0.001, 0.01, 0.05])
    for kind in kinds:
        a, b = rng.sample(range(n), 2)
        # A round without faults takes a few latencies: faults land inside it.
        at = round(rng.uniform(0.0, 8 * latency), 5) if rng.random() < 0.4 else 0.0
        at_frame = 0 if at else rng.randint(1, 6 * n * n)
        if kind == "partition" and rng.random() < 0.5:
            at, at_frame = 0.0, 0  # from the start: the sides never meet
        seconds = rng.choice([0.0, 0.0, 0.5, 1.5, 3.0])
        side: tuple[int, ...] = ()
        if kind == "partition":
            side = tuple(sorted(rng.sample(range(n), rng.randint(1, n - 1))))
        faults.append(Fault(kind, a, b, at, at_frame, seconds, side))
    return Schedule(seed, n, clients, total, chunk, latency, tuple(faults))


def run_schedule(schedule: Schedule) -> list[MemberOutcome]:
    """Run the schedule's round; one outcome per member, in member order."""
    return run_virtual(_run(schedule), max_virtual_seconds=120.0)


def _vectors(schedule: Schedule) -> tuple[list[torch.Tensor], list[float]]:
    generator = torch.Generator().manual_seed(schedule.seed)
    vectors = [
        torch.randn(schedule.total_elements, generator=generator)
        for _ in range(schedule.num_members)
    ]
    rng = random.Random(f"{schedule.seed}/weights")
    return vectors, [float(rng.randint(1, 8)) for _ in range(schedule.num_members)]


async def _run(schedule: Schedule) -> list[MemberOutcome]:
    loop = asyncio.get_running_loop()
    network = MemoryNetwork(schedule.seed, latency_seconds=schedule.latency)
    peers = [network.add_peer() for _ in range(schedule.num_members)]
    for a, b, seconds in schedule.link_latency:
        network.set_latency(peers[a], peers[b], seconds, one_way=True)
    members = tuple(p.peer_id for p in peers)
    vectors, weights = _vectors(schedule)
    services = [AllReduceService(p, CONFIG) for p in peers]
    for service in services:
        await service.__aenter__()
    if schedule.seed % 2:  # as after a round together: reverse lanes send at once
        for service in services:
            for m in members:
                service.remember_reverse_lane(m)
    start = loop.time()
    killed: set[int] = set()
    _arm(schedule, network, peers, services, killed, start)
    returned: dict[int, float] = {}

    async def member(i: int) -> AllReduceResult:
        spec = _spec(schedule, members, members[i])
        local = replicate(vectors[i], schedule.reducers_per_part)
        try:
            return await services[i].run_round(spec, local, weights[i])
        finally:
            returned[i] = loop.time() - start

    tasks = [peers[i].create_task(member(i)) for i in range(len(peers))]
    await asyncio.wait(tasks)
    outcomes = []
    for i, task in enumerate(tasks):
        alive = i not in killed
        if task.cancelled():
            outcomes.append(MemberOutcome(alive, False, None, "cancelled", None, None))
            continue
        error = task.exception()
        if error is not None:
            outcomes.append(MemberOutcome(alive, False, returned.get(i), repr(error), None, None))
            continue
        result = task.result()
        outcomes.append(
            MemberOutcome(
                alive,
                result.transfer.agreed,
                returned.get(i),
                None,
                result.result.averaged.clone(),
                result,
            )
        )
    await network.aclose()
    return outcomes


def _spec(schedule: Schedule, members: tuple[PeerID, ...], me: PeerID) -> RoundSpec:
    return RoundSpec(
        round_id=ROUND_ID,
        members=members,
        weights=tuple(0.0 if i in schedule.clients else 1.0 for i in range(len(members))),
        total_elements=schedule.total_elements * schedule.reducers_per_part,
        chunk_elements=schedule.chunk_elements,
        me=me,
        reducers_per_part=schedule.reducers_per_part,
    )


def _arm(
    schedule: Schedule,
    network: MemoryNetwork,
    peers: Sequence[MemoryPeer],
    services: Sequence[AllReduceService],
    killed: set[int],
    start: float,
) -> None:
    """Set every fault to fire at its time or frame."""
    loop = asyncio.get_running_loop()
    by_frame: dict[int, list[Fault]] = {}
    for fault in schedule.faults:
        if fault.at_frame:
            by_frame.setdefault(fault.at_frame, []).append(fault)
        else:
            loop.call_at(start + fault.at, _fire, fault, network, peers, services, killed)
    if by_frame:
        count = 0

        def on_frame(src: PeerID, dst: PeerID, protocol: str, num_bytes: int) -> None:
            nonlocal count
            count += 1
            for fault in by_frame.pop(count, []):
                _fire(fault, network, peers, services, killed)

        network.on_frame = on_frame


def _fire(
    fault: Fault,
    network: MemoryNetwork,
    peers: Sequence[MemoryPeer],
    services: Sequence[AllReduceService],
    killed: set[int],
) -> None:
    loop = asyncio.get_running_loop()
    if fault.kind in BYZANTINE_KINDS:
        _byzantine(fault, peers, services)
        return
    a, b = peers[fault.a], peers[fault.b]
    if fault.kind == "kill":
        if fault.a not in killed:
            killed.add(fault.a)
            network.kill(a)
        return
    if fault.kind == "pause":
        network.pause(a, fault.seconds or 2.5)
        return
    if fault.kind == "reset":
        network.reset_link(a, b)
        return
    if fault.kind == "slow":  # a 2 kB/s uplink: a chunk every few seconds
        network.set_bandwidth(a, b, 2000.0, one_way=True)
        return
    pairs: list[tuple[MemoryPeer, MemoryPeer]]
    one_way = fault.kind == "cut_one_way"
    if fault.kind == "partition":
        left = set(fault.side)
        pairs = [
            (peers[i], peers[j]) for i in sorted(left) for j in range(len(peers)) if j not in left
        ]
    else:
        pairs = [(a, b)]
    for x, y in pairs:
        network.cut(x, y, one_way=one_way)
    if fault.seconds:

        def heal() -> None:
            for x, y in pairs:
                network.heal(x, y, one_way=one_way)

        loop.call_later(fault.seconds, heal)


def _byzantine(
    fault: Fault, peers: Sequence[MemoryPeer], services: Sequence[AllReduceService]
) -> None:
    runner = services[fault.a].running(ROUND_ID)
    if runner is None:  # it returned already, or has not started
        return
    others = [p.peer_id for i, p in enumerate(peers) if i != fault.a]
    if fault.kind == "lie":
        honest = runner.round.publishable_chunks

        def lying(part_index: int) -> list[OutgoingAveraged]:
            return [dataclasses.replace(o, values=o.values + LIE) for o in honest(part_index)]

        setattr(runner.round, "publishable_chunks", lying)  # noqa: B010 (a method, replaced)
        return
    if fault.kind == "accuse":
        for member in others:
            runner.accuse(member)
        return
    for member, link in runner.links.items():  # equivocate: a different first on each
        link.send(notice_of([sign_accusation(peers[fault.a].identity, ROUND_ID, member, 0)]))


def check(schedule: Schedule, outcomes: Sequence[MemberOutcome]) -> list[Violation]:
    """The promises ``outcomes`` break (empty: none)."""
    violations = []
    bound = CONFIG.return_bound
    for i, outcome in enumerate(outcomes):
        if not outcome.alive:
            continue
        if outcome.error is not None:
            violations.append(Violation("P4", f"member {i} raised {outcome.error}"))
        elif outcome.returned_after is None or outcome.returned_after > bound + 1e-6:
            violations.append(
                Violation("P4", f"member {i} returned after {outcome.returned_after} s > {bound}")
            )
    agreed = [i for i, o in enumerate(outcomes) if o.alive and o.agreed]
    violations += _check_same_mean(schedule, outcomes, agreed)
    liars = [f.a for f in schedule.faults if f.kind == "lie"]
    if liars and agreed:
        violations += _check_lie(schedule, outcomes[agreed[0]], liars[0])
    # A partition from the round's start, never healed: its sides never exchange a vote,
    # so at most one can hold a majority. (One that falls later may fall after the
    # decision: then both sides hold the decided tensor, which P1 checks.)
    partitions = [
        f
        for f in schedule.faults
        if f.kind == "partition" and not f.seconds and not f.at and not f.at_frame
    ]
    if any(f.seconds and f.kind in ("cut", "cut_one_way", "partition") for f in schedule.faults):
        partitions = []  # a heal of another cut may heal part of the partition too
    for fault in partitions:
        sides = {i in fault.side for i in agreed}
        if len(sides) > 1:
            violations.append(Violation("P2", f"both sides of {fault.side} agreed: {agreed}"))
    if len(schedule.faults) == 1:
        violations += _check_cost(schedule.faults[0], outcomes)
    return violations


def _check_byzantine(fault: Fault, outcomes: Sequence[MemberOutcome]) -> list[Violation]:
    """P5, for forged exclusions: a Byzantine member alone costs at most one other."""
    lost = {i for i, o in enumerate(outcomes) if o.alive and not o.agreed and i != fault.a}
    if len(lost) > 1:
        return [Violation("P5", f"member {fault.a} ({fault.kind}) lost members {sorted(lost)}")]
    return []


def _check_same_mean(
    schedule: Schedule, outcomes: Sequence[MemberOutcome], agreed: Sequence[int]
) -> list[Violation]:
    if not agreed:
        return []
    first = outcomes[agreed[0]]
    assert first.averaged is not None and first.result is not None
    for i in agreed[1:]:
        other = outcomes[i].averaged
        if other is None or not torch.equal(other, first.averaged):
            return [Violation("P1", f"members {agreed[0]} and {i} agreed on different tensors")]
    report = first.result.result.report
    liars = {report.members[f.a] for f in schedule.faults if f.kind == "lie"}
    expected = _honest_means(schedule, first)
    for part in report.parts:
        if part.end == part.start or not part.contributors or part.reducer in liars:
            continue  # (a liar's parts: P5)
        got = first.averaged[part.start : part.end]
        if not torch.allclose(got, expected[part.start : part.end], atol=1e-5):
            return [Violation("P1", f"part {part.part_index} is not its contributors' mean")]
    return []


def _honest_means(schedule: Schedule, outcome: MemberOutcome) -> torch.Tensor:
    """Each part of ``outcome``'s round as honest reducers would have averaged it: the
    weighted mean of the contributors its report names (its own values where none)."""
    assert outcome.averaged is not None and outcome.result is not None
    vectors, weights = _vectors(schedule)
    copies = [replicate(v, schedule.reducers_per_part) for v in vectors]
    report = outcome.result.result.report
    index = {m: k for k, m in enumerate(report.members)}
    expected = outcome.averaged.clone()
    for part in report.parts:
        if part.end == part.start or not part.contributors:
            continue
        who = [index[m] for m in part.contributors]
        counted = capped_sample_weights(
            {report.members[k]: weights[k] for k in who}, DEFAULT_MAX_WEIGHT_RATIO
        )
        total = sum(counted.values())
        mean = sum(
            (copies[k][part.start : part.end].double() * counted[report.members[k]] for k in who),
            torch.zeros(part.end - part.start, dtype=torch.float64),
        )
        expected[part.start : part.end] = (mean / total).float()
    return expected


def _check_lie(schedule: Schedule, outcome: MemberOutcome, liar: int) -> list[Violation]:
    """P5 for a lying reducer: every coordinate of the agreed result, folded over its
    copies, lies between the honest means of those copies; except where the liar
    inherited a dead reducer's part holding a copy of coordinates it reduced already
    (no other member was free of them: :func:`unguarded`)."""
    assert outcome.averaged is not None
    copies = schedule.reducers_per_part
    got = fold(outcome.averaged, copies).values
    honest = _honest_means(schedule, outcome).view(copies, -1)
    low, high = honest.min(dim=0).values - 1e-5, honest.max(dim=0).values + 1e-5
    outside = (got < low) | (got > high)
    outside &= ~unguarded(schedule, outcome, liar)
    moved = outside.nonzero()
    if len(moved):
        return [
            Violation(
                "P5",
                f"lying reducer {liar} moved {len(moved)} of {got.numel()} coordinates "
                f"({copies} reducers per part)",
            )
        ]
    return []


def unguarded(schedule: Schedule, outcome: MemberOutcome, liar: int) -> torch.Tensor:
    """Per coordinate of one copy: whether ``liar`` reduced a majority of its copies,
    one of them inherited (a dead reducer's part that no other member could take)."""
    assert outcome.result is not None
    report = outcome.result.result.report
    owners = _spec(schedule, report.members, report.members[liar]).owners
    size = schedule.total_elements
    held = torch.zeros(size, dtype=torch.int64)
    inherited = torch.zeros(size, dtype=torch.bool)
    for part in report.parts:
        if part.reducer != report.members[liar] or part.end == part.start:
            continue
        positions = torch.arange(part.start, part.end) % size
        held[positions] += 1
        if owners[part.part_index] != liar:
            inherited[positions] = True
    return (held > (schedule.reducers_per_part - 1) // 2) & inherited


def _check_cost(fault: Fault, outcomes: Sequence[MemberOutcome]) -> list[Violation]:
    if fault.kind in BYZANTINE_KINDS:
        return _check_byzantine(fault, outcomes)
    lost = {i for i, o in enumerate(outcomes) if o.alive and not o.agreed}
    if fault.kind in ("kill", "pause"):
        allowed, most = {fault.a}, 1
    elif fault.kind in ("cut", "cut_one_way", "reset", "slow"):
        allowed, most = {fault.a, fault.b}, 1
    else:
        return []  # a partition may cost a whole side
    if len(lost) > most or not lost <= allowed:
        return [
            Violation("P3", f"one {fault.kind} of {sorted(allowed)} lost members {sorted(lost)}")
        ]
    return []


def check_seed(seed: int, *, byzantine: bool = False) -> list[Violation]:
    return _run_and_check(random_schedule(seed, byzantine=byzantine))[1]


def _run_and_check(schedule: Schedule) -> tuple[list[MemberOutcome], list[Violation]]:
    """The outcomes and violations of ``schedule``; a run the virtual clock stopped (a
    livelock, a deadlock, time past its limit) is a P4 violation with no outcomes."""
    try:
        outcomes = run_schedule(schedule)
    except VirtualClockError as e:
        return [], [Violation("P4", f"the run did not end: {type(e).__name__}: {e}"[:500])]
    return outcomes, check(schedule, outcomes)


@dataclass
class Summary:
    """What a run of many schedules showed: the figures docs/benchmarks.md quotes."""

    schedules: int = 0
    failing: int = 0
    return_seconds: list[float] = dataclasses.field(default_factory=list)
    """Each live member's return time, in every schedule with at least one fault."""
    single_fault_cost: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per kind of fault, schedules holding only it by live members lost: [0, 1, 2+]."""
    lies: int = 0
    """Schedules with a lying reducer whose round some member agreed on."""
    lies_unguarded: int = 0
    """Of those, the ones where the liar inherited a second copy of some coordinates
    (:func:`unguarded`: three members able to reduce, one of them dead)."""

    def add(self, schedule: Schedule, outcomes: Sequence[MemberOutcome], failed: bool) -> None:
        self.schedules += 1
        self.failing += failed
        if schedule.faults:
            self.return_seconds += [
                o.returned_after for o in outcomes if o.alive and o.returned_after is not None
            ]
        liars = [f.a for f in schedule.faults if f.kind == "lie"]
        agreed = [o for o in outcomes if o.agreed and o.result is not None]
        if liars and agreed:
            self.lies += 1
            self.lies_unguarded += bool(unguarded(schedule, agreed[0], liars[0]).any())
        if len(schedule.faults) == 1:
            lost = sum(o.alive and not o.agreed for o in outcomes)
            counts = self.single_fault_cost.setdefault(schedule.faults[0].kind, [0, 0, 0])
            counts[min(lost, 2)] += 1

    def as_json(self) -> dict[str, object]:
        times = sorted(self.return_seconds)

        def quantile(q: float) -> float:
            return round(times[min(len(times) - 1, int(q * len(times)))], 3) if times else 0.0

        return {
            "schedules": self.schedules,
            "failing": self.failing,
            "return_seconds_median": quantile(0.5),
            "return_seconds_p90": quantile(0.9),
            "return_seconds_p99": quantile(0.99),
            "return_seconds_max": times[-1] if times else 0.0,
            "return_bound_seconds": CONFIG.return_bound,
            "single_fault_lost_0_1_2plus": self.single_fault_cost,
            "lying_reducer_schedules": self.lies,
            "lying_reducer_unguarded_schedules": self.lies_unguarded,
        }


def shrink(schedule: Schedule, fails: Callable[[Schedule], bool]) -> Schedule:
    """A smaller schedule that still ``fails``: faults removed one at a time, then the
    vector halved, while the failure holds (bounded: each step makes it smaller)."""
    current = schedule
    for _ in range(64):
        smaller = None
        for k in range(len(current.faults)):
            faults = current.faults[:k] + current.faults[k + 1 :]
            candidate = dataclasses.replace(current, faults=faults)
            if fails(candidate):
                smaller = candidate
                break
        if smaller is None and current.total_elements > current.num_members:
            half = max(current.num_members, current.total_elements // 2)
            candidate = dataclasses.replace(current, total_elements=half)
            if fails(candidate):
                smaller = candidate
        if smaller is None:
            return current
        current = smaller
    return current


def _fails(schedule: Schedule) -> bool:
    return bool(_run_and_check(schedule)[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=200, help="run seeds 0..N-1")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--seed", type=int, help="run (and shrink) this seed only")
    parser.add_argument(
        "--byzantine", action="store_true", help="each schedule has one Byzantine member"
    )
    args = parser.parse_args(argv)
    seeds = [args.seed] if args.seed is not None else range(args.first, args.first + args.schedules)
    summary = Summary()
    for seed in seeds:
        schedule = random_schedule(seed, byzantine=args.byzantine)
        outcomes, violations = _run_and_check(schedule)
        summary.add(schedule, outcomes, bool(violations))
        for violation in violations:
            print(f"seed {seed}: {violation.prop}: {violation.detail}", flush=True)
        if violations and args.seed is not None:
            small = shrink(schedule, _fails)
            print(json.dumps(dataclasses.asdict(small)), flush=True)
    print(json.dumps(summary.as_json()), flush=True)
    return 1 if summary.failing else 0


if __name__ == "__main__":
    sys.exit(main())
