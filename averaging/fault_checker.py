"""A randomized fault-schedule checker for butterfly rounds, Jepsen-style: real rounds
(:class:`~averaging.allreduce_service.AllReduceService`) on the in-memory network of
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
  costs at most one other member.

``python -m averaging.fault_checker --schedules 1000`` runs seeds 0..999 and prints a
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

from averaging.accusations import sign_accusation
from averaging.allreduce_config import AllReduceConfig, AllReduceResult
from averaging.allreduce_service import AllReduceService
from averaging.allreduce_wire import notice_of
from averaging.butterfly_records import DEFAULT_MAX_WEIGHT_RATIO, RoundSpec
from averaging.reduction import capped_sample_weights
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
#: it sends a different "first" accusation, of the member at the other end.
BYZANTINE_KINDS = ("accuse", "equivocate")
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
    if not byzantine:
        return schedule
    rng = random.Random(f"{seed}/byzantine")
    n = schedule.num_members
    # At a frame of the round's first half: while the round runs and its links are up.
    fault = Fault(rng.choice(BYZANTINE_KINDS), rng.randrange(n), -1, at_frame=rng.randint(1, n * n))
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
    members = tuple(p.peer_id for p in peers)
    bandwidth = tuple(0.0 if i in schedule.clients else 1.0 for i in range(len(peers)))
    vectors, weights = _vectors(schedule)
    services = [AllReduceService(p, CONFIG) for p in peers]
    for service in services:
        await service.__aenter__()
    start = loop.time()
    killed: set[int] = set()
    _arm(schedule, network, peers, services, killed, start)
    returned: dict[int, float] = {}

    async def member(i: int) -> AllReduceResult:
        spec = RoundSpec(
            round_id=ROUND_ID,
            members=members,
            weights=bandwidth,
            total_elements=schedule.total_elements,
            chunk_elements=schedule.chunk_elements,
            me=members[i],
        )
        try:
            return await services[i].run_round(spec, vectors[i], weights[i])
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
    vectors, weights = _vectors(schedule)
    index = {m: k for k, m in enumerate(first.result.result.report.members)}
    for part in first.result.result.report.parts:
        if part.end == part.start or not part.contributors:
            continue
        who = [index[m] for m in part.contributors]
        members = first.result.result.report.members
        counted = capped_sample_weights(
            {members[k]: weights[k] for k in who}, DEFAULT_MAX_WEIGHT_RATIO
        )
        total = sum(counted.values())
        mean = sum(
            (vectors[k][part.start : part.end].double() * counted[members[k]] for k in who),
            torch.zeros(part.end - part.start, dtype=torch.float64),
        )
        expected = (mean / total).float()
        if not torch.allclose(first.averaged[part.start : part.end], expected, atol=1e-5):
            return [Violation("P1", f"part {part.part_index} is not its contributors' mean")]
    return []


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

    def add(self, schedule: Schedule, outcomes: Sequence[MemberOutcome], failed: bool) -> None:
        self.schedules += 1
        self.failing += failed
        if schedule.faults:
            self.return_seconds += [
                o.returned_after for o in outcomes if o.alive and o.returned_after is not None
            ]
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
