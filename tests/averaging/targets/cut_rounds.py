"""Butterfly rounds among four peer processes behind one router, in each round one
link cut at a random moment: what a single cut costs (the promises P1, P3 and P4 of
``averaging.allreduce.network``'s vote, checked on a virtual clock by
``averaging.allreduce.fault_checker``; here with real processes, TCP, Noise and yamux).

Topology: the namespace lab (docs/netlab.md), one home router and four LAN hosts on its
LAN bridge, one peer process each. A cut is an nftables drop rule in the router's
bridge, both directions between two peers' addresses: a black hole, not a reset (ARP
passes, as in ``Lab.cut``). It is removed once every member has returned, and the next
round starts only when every member pings every other again, so one round's cut never
stalls the next.

The members are ``cut_round_node.py`` processes: real ``peers.host.Peer`` objects over
TCP, Noise and yamux, each round an ``AllReduceService.run_round``.
:func:`run_cut_rounds` runs the experiment and :func:`violations` checks a round;
``tests/averaging/test_agreement_netns.py`` asserts on them and
``benchmarks/measure_cut_cost.py`` tabulates them.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from averaging import AllReduceConfig
from peers.netlab import Lab, LanHost, Router
from peers.testing import LocalSwarm, PeerProcess

TARGET = f"{Path(__file__).resolve().parent / 'cut_round_node.py'}:cut_round_node"
NUM_PEERS = 4
PORT = 4001
#: The issue's timeouts: a short round, so a round a cut stalls ends in seconds.
CONFIG = AllReduceConfig(
    sender_timeout=1.0,
    reducer_timeout=2.0,
    round_timeout=6.0,
    join_timeout=1.0,
    chunk_elements=1 << 16,
)
#: The timeouts a round command carries (the codec is the default: none).
CONFIG_FIELDS = ("sender_timeout", "reducer_timeout", "round_timeout", "join_timeout")
#: 4 MiB per member, over links capped at ``RATE_MBIT``: a fault-free round takes
#: about half a second, long enough that a cut at a random moment lands in every phase
#: (links opening, chunks, averaged parts, votes, copies), and spent on the wire rather
#: than on two shared cores.
ELEMENTS = 1 << 20
RATE_MBIT = 100.0
#: Fault-free rounds before the cut ones: they open the connections, and the longest
#: of them is the window a cut's moment is drawn from.
WARMUP_ROUNDS = 2
#: Seconds past ``return_bound`` the test waits for a report: process scheduling and
#: the pipe, not the round (whose own clock is what P4 checks).
REPORT_SLACK_SECONDS = 20.0
#: Pings of every pair after a cut is removed: a connection that sat in the black hole
#: resumes at the sender's next TCP retransmission, at most a few seconds later.
HEAL_ATTEMPTS = 20
PING_TIMEOUT_SECONDS = 1.0
STARTUP_TIMEOUT_SECONDS = 60.0
CUT_TABLE = "cut_round"


@dataclass(frozen=True, slots=True)
class PeerOutcome:
    """One member's view of one round."""

    agreed: bool
    sha256: str
    """Of the averaged tensor's bytes ("" when ``run_round`` raised)."""
    seconds: float
    """``run_round``'s duration on the member's own clock."""
    error: str | None
    """What ``run_round`` raised, if it did (a P4 violation)."""


@dataclass(frozen=True, slots=True)
class CutRound:
    """One round with one cut, as every member saw it."""

    index: int
    """Its place among the cut rounds (0 first)."""
    cut: tuple[int, int]
    """The members (ranks) whose link was cut."""
    cut_after_seconds: float
    """When the drop rule was in place, after the round's command went out."""
    dropped_packets: int
    """Packets the rule dropped: 0 when the cut came after the pair's last exchange."""
    outcomes: tuple[PeerOutcome, ...]
    heal_seconds: float
    """From removing the rule until every member pinged every other."""

    @property
    def lost(self) -> frozenset[int]:
        """Members alive and not agreed (every member stays alive here)."""
        return frozenset(i for i, o in enumerate(self.outcomes) if not o.agreed)


@dataclass(frozen=True, slots=True)
class CutExperiment:
    """Every cut round of one run of :func:`run_cut_rounds`."""

    seed: int
    """Drew each round's pair, moment and vectors."""
    return_bound: float
    """``AllReduceConfig.return_bound`` of the rounds (P4)."""
    window_seconds: float
    """Cut moments were drawn from ``[0, window_seconds)``: the longest warm-up round."""
    rounds: tuple[CutRound, ...]


def violations(record: CutRound, return_bound: float) -> list[str]:
    """The promises ``record`` breaks: P1 (agreed members hold one tensor), P3 (a cut
    costs at most one of its two ends, and nobody else), P4 (every member returned
    within ``return_bound`` without raising). Empty when it keeps them all."""
    found = []
    hashes = {o.sha256 for o in record.outcomes if o.agreed}
    if len(hashes) > 1:
        found.append(f"P1: agreed members hold {len(hashes)} different tensors")
    if len(record.lost) > 1 or not record.lost <= set(record.cut):
        found.append(f"P3: the cut {record.cut} lost members {sorted(record.lost)}")
    for i, o in enumerate(record.outcomes):
        if o.error is not None:
            found.append(f"P4: member {i} raised {o.error}")
        elif o.seconds > return_bound:
            found.append(f"P4: member {i} returned after {o.seconds:.3f} s > {return_bound} s")
    return found


def cut_ruleset(a: str, b: str) -> str:
    """Drop every IPv4 packet between addresses ``a`` and ``b`` that the router's LAN
    bridge forwards, both ways (ARP is not IPv4, so it passes)."""
    return f"""\
table bridge {CUT_TABLE} {{
    chain forward {{
        type filter hook forward priority filter; policy accept;
        ip saddr {a} ip daddr {b} counter drop
        ip saddr {b} ip daddr {a} counter drop
    }}
}}
"""


def _dropped_packets(router: Router) -> int:
    listing = router.run(["nft", "-j", "list", "table", "bridge", CUT_TABLE]).stdout
    total = 0
    for item in json.loads(listing)["nftables"]:
        for expr in item.get("rule", {}).get("expr", []):
            total += int(expr.get("counter", {}).get("packets", 0))
    return total


class _Group:
    """The four members, their router, and the rounds' numbering."""

    def __init__(
        self,
        router: Router,
        hosts: Sequence[LanHost],
        procs: Sequence[PeerProcess],
        *,
        elements: int,
        config: AllReduceConfig,
    ) -> None:
        self.router = router
        self.hosts = list(hosts)
        self.procs = list(procs)
        self.elements = elements
        self.config = config
        self.next_round = 0

    def wait_connected(self) -> float:
        """Seconds until every member pings every other (bounded: ``HEAL_ATTEMPTS``)."""
        start = time.monotonic()
        for _ in range(HEAL_ATTEMPTS):
            for proc in self.procs:
                others = [[p.peer_id, p.maddr] for p in self.procs if p is not proc]
                proc.send({"op": "ping", "peers": others, "timeout": PING_TIMEOUT_SECONDS})
            replies = [p.wait_report("pinged", 10 * PING_TIMEOUT_SECONDS) for p in self.procs]
            if not any(r["unreachable"] for r in replies):
                return time.monotonic() - start
        raise AssertionError(f"members still unreachable after {HEAL_ATTEMPTS} pings: {replies}")

    def start_round(self, seed: int) -> float:
        """Send the next round to every member; returns when it went out."""
        config: dict[str, float] = {f: getattr(self.config, f) for f in CONFIG_FIELDS}
        config["chunk_elements"] = self.config.chunk_elements
        command = {
            "op": "round",
            "round_id": self.next_round.to_bytes(8, "big").hex(),
            "members": [[p.peer_id, p.maddr] for p in self.procs],
            "seed": seed,
            "elements": self.elements,
            "config": config,
        }
        self.next_round += 1
        for proc in self.procs:
            proc.send(command)
        return time.monotonic()

    def outcomes(self) -> tuple[PeerOutcome, ...]:
        timeout = self.config.return_bound + REPORT_SLACK_SECONDS
        reports = [p.wait_report("done", timeout) for p in self.procs]
        return tuple(
            PeerOutcome(r["agreed"], r["sha256"], float(r["seconds"]), r["error"]) for r in reports
        )

    def cut_round(self, index: int, seed: int, cut: tuple[int, int], at: float) -> CutRound:
        a, b = (self.hosts[i].address for i in cut)
        sent = self.start_round(seed)
        time.sleep(max(0.0, sent + at - time.monotonic()))  # the fault's moment, not a sync
        try:
            self.router.run(["nft", "-f", "-"], input=cut_ruleset(a, b))
            cut_after = time.monotonic() - sent
            outcomes = self.outcomes()
            dropped = _dropped_packets(self.router)
        finally:
            with contextlib.suppress(Exception):  # the lab's teardown removes it too
                self.router.run(["nft", "delete", "table", "bridge", CUT_TABLE])
        heal = self.wait_connected()
        return CutRound(index, cut, cut_after, dropped, outcomes, heal)


def run_cut_rounds(
    *,
    num_rounds: int,
    seed: int,
    elements: int = ELEMENTS,
    config: AllReduceConfig = CONFIG,
    log: Callable[[str], None] = print,
) -> CutExperiment:
    """Build the lab, start the four members, run ``WARMUP_ROUNDS`` fault-free rounds
    and then ``num_rounds`` rounds with one cut each (pair and moment drawn from
    ``seed``), and tear everything down. Raises ``AssertionError`` if a warm-up round
    does not agree everywhere or the members do not reconnect after a cut, and
    :class:`~peers.testing.SwarmError` if a member does not report in time."""
    rng = random.Random(seed)
    with Lab() as lab, LocalSwarm() as swarm:
        router = lab.add_home_router("router")
        hosts = [
            lab.add_lan_host(router, f"peer{i}", rate_mbit=RATE_MBIT) for i in range(NUM_PEERS)
        ]
        options = {"peer_config": {"reachability": "public", "relay_service": False}}
        procs = swarm.start(
            NUM_PEERS,
            target=TARGET,
            options=options,
            per_peer_options=[{"listen": [f"/ip4/{h.address}/tcp/{PORT}"]} for h in hosts],
            namespaces=[h.namespace for h in hosts],
        )
        for proc in procs:
            proc.wait_report("serving", STARTUP_TIMEOUT_SECONDS)
        group = _Group(router, hosts, procs, elements=elements, config=config)
        group.wait_connected()
        window = 0.0
        for _ in range(WARMUP_ROUNDS):
            group.start_round(rng.randrange(1 << 62))
            warmup = group.outcomes()
            assert all(o.agreed for o in warmup) and len({o.sha256 for o in warmup}) == 1, warmup
            window = max(window, *(o.seconds for o in warmup))
        log(f"seed {seed}: cut moments drawn from [0, {window:.3f}) s")
        rounds = []
        for index in range(num_rounds):
            a, b = sorted(rng.sample(range(NUM_PEERS), 2))
            record = group.cut_round(index, rng.randrange(1 << 62), (a, b), rng.uniform(0, window))
            seconds = " ".join(f"{o.seconds:.2f}" for o in record.outcomes)
            log(
                f"round {index}: cut {record.cut} at {record.cut_after_seconds:.3f} s,"
                f" {record.dropped_packets} packets dropped, lost {sorted(record.lost)},"
                f" seconds {seconds}, healed in {record.heal_seconds:.2f} s"
                + "".join(f"; {v}" for v in violations(record, config.return_bound))
            )
            rounds.append(record)
    return CutExperiment(seed, config.return_bound, window, tuple(rounds))
