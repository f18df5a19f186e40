"""The swarm as its peers describe it: status records summarised into peers, runs,
experts and pipelines (pure: records and ``now`` in, a :class:`SwarmView` out).

``swarm status`` prints a view as text or JSON (:meth:`SwarmView.to_json`);
``swarm dashboard`` serves the same JSON to its page. Every figure is a peer's claim
(:mod:`peers.dht.status`): a run's throughput is the sum of its peers' claims, its epoch
and loss the medians, so one peer's extreme claim moves the shown epoch and loss of a
run of three or more no further than an honest peer's. Strings are the peers' own:
printers escape them (:func:`peers.printable.printable`), the dashboard sets them as
text, never as markup.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from peers.dht.status import PeerStatus, RunStatus
from peers.identity import PeerID
from peers.printable import printable

#: How the text view names a reachability (the JSON keeps the record's word), as the
#: dashboard does.
REACHABILITY_WORDS = {"private": "behind NAT"}


@dataclass(frozen=True, slots=True)
class PeerRow:
    peer_id: str
    reachability: str
    """``public``, ``private``, ``relayed`` or ``unknown``; ``unknown`` too for a peer
    that publishes no status (found in the routing table or presence records only)."""
    agent: str
    seconds_ago: float | None
    """Since its latest status record or announcement (None: answered us, no record)."""
    runs: tuple[str, ...]
    num_served: int
    addrs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RunRow:
    run_id: str
    num_peers: int
    """Peers publishing this run in their status."""
    epoch: int
    """The median of its peers' epochs."""
    loss: float | None
    """The median of its peers' latest losses."""
    samples_per_second: float
    """The sum of its peers' throughputs."""
    samples: int
    """The sum of the samples its peers processed."""
    num_rounds: int
    """The most rounds one of its peers took part in."""
    num_rounds_failed: int
    """Rounds that failed, summed over its peers (a failed round counts once per peer
    that saw it fail)."""


@dataclass(frozen=True, slots=True)
class ExpertRow:
    uid: str
    num_servers: int
    queued: int
    num_batches: int


@dataclass(frozen=True, slots=True)
class PipelineRow:
    uid_prefix: str
    num_stages: int
    servers: tuple[int, ...]
    """Servers of each stage."""
    queued: tuple[int, ...]
    """Samples queued at each stage, over its servers."""

    @property
    def coverage(self) -> float:
        """The fraction of stages that have at least one server."""
        return sum(1 for n in self.servers if n) / self.num_stages

    @property
    def missing(self) -> tuple[int, ...]:
        """Stages nobody serves: the pipeline cannot run until someone does."""
        return tuple(i for i, n in enumerate(self.servers) if n == 0)


@dataclass(frozen=True, slots=True)
class SwarmView:
    time: float
    peers: tuple[PeerRow, ...]
    runs: tuple[RunRow, ...]
    experts: tuple[ExpertRow, ...]
    pipelines: tuple[PipelineRow, ...]

    def to_json(self) -> dict[str, object]:
        """Plain JSON types (what ``swarm status --json`` prints, one object)."""
        out = asdict(self)
        out["pipelines"] = [
            {**asdict(p), "coverage": p.coverage, "missing": list(p.missing)}
            for p in self.pipelines
        ]
        return out

    def lines(self) -> list[str]:
        """The view as text for a terminal; peers' strings escaped."""
        p = printable
        out = [
            f"{len(self.peers)} peers, {len(self.runs)} runs, {len(self.experts)} experts, "
            f"{len(self.pipelines)} pipelines"
        ]
        out += ["", f"{'PEER ID':54}  {'REACH':10}  {'SEEN':>8}  {'AGENT':20}  ROLES"]
        for peer in self.peers:
            seen = "now" if peer.seconds_ago is None else f"{peer.seconds_ago:.0f} s ago"
            roles = [f"run {p(r, 64)}" for r in peer.runs]
            if peer.num_served:
                roles.append(f"serves {peer.num_served}")
            addrs = " ".join(p(a, 200) for a in peer.addrs)
            reach = REACHABILITY_WORDS.get(peer.reachability, peer.reachability)
            line = f"{peer.peer_id:54}  {reach:10}  {seen:>8}  {p(peer.agent, 20):20}"
            out.append(f"{line}  {', '.join(roles) or '-'}  {addrs}".rstrip())
        if self.runs:
            out += [
                "",
                f"{'RUN':24} {'PEERS':>5} {'EPOCH':>6} {'LOSS':>8} "
                f"{'SAMPLES/S':>10} {'SAMPLES':>10} {'ROUNDS':>6} {'FAILED':>6}",
            ]
            for run in self.runs:
                loss = "-" if run.loss is None else f"{run.loss:.4f}"
                out.append(
                    f"{p(run.run_id, 24):24} {run.num_peers:5d} {run.epoch:6d} {loss:>8} "
                    f"{run.samples_per_second:10.1f} {run.samples:10d} {run.num_rounds:6d} "
                    f"{run.num_rounds_failed:6d}"
                )
        if self.experts:
            out += ["", f"{'EXPERT':32} {'SERVERS':>7} {'QUEUED':>7} {'BATCHES':>8}"]
            for e in self.experts:
                out.append(f"{p(e.uid, 32):32} {e.num_servers:7d} {e.queued:7d} {e.num_batches:8d}")
        if self.pipelines:
            out += ["", f"{'PIPELINE':24} {'STAGES':>6} {'COVERAGE':>8}  SERVERS PER STAGE"]
            for pipe in self.pipelines:
                missing = f"  (no server for stage {', '.join(map(str, pipe.missing))})"
                out.append(
                    f"{p(pipe.uid_prefix, 24):24} {pipe.num_stages:6d} {pipe.coverage:8.0%}  "
                    f"{' '.join(map(str, pipe.servers))}{missing if pipe.missing else ''}"
                )
        return out


@dataclass(frozen=True, slots=True)
class Contact:
    """A peer known without a status record: announced (presence) or in our routing table."""

    peer_id: PeerID
    addrs: tuple[str, ...]
    seconds_ago: float | None
    agent: str = ""


def summarize(
    statuses: Mapping[PeerID, PeerStatus], contacts: Iterable[Contact], now: float
) -> SwarmView:
    """The view from every status record and every other peer we know of."""
    known: dict[PeerID, Contact] = {}
    for contact in contacts:
        known.setdefault(contact.peer_id, contact)
    rows: list[PeerRow] = []
    for peer_id, status in statuses.items():
        found = known.get(peer_id)
        rows.append(
            PeerRow(
                peer_id=str(peer_id),
                reachability=status.reachability,
                agent=status.agent,
                seconds_ago=max(0.0, now - status.time),
                runs=tuple(r.run_id for r in status.runs),
                num_served=status.num_served,
                addrs=() if found is None else found.addrs,
            )
        )
    for peer_id, contact in known.items():
        if peer_id not in statuses:
            rows.append(
                PeerRow(
                    str(peer_id),
                    "unknown",
                    contact.agent,
                    contact.seconds_ago,
                    (),
                    0,
                    contact.addrs,
                )
            )
    rows.sort(key=lambda r: (r.seconds_ago is None, r.seconds_ago or 0.0, r.peer_id))
    return SwarmView(
        time=now,
        peers=tuple(rows),
        runs=_runs(statuses.values()),
        experts=_experts(statuses.values()),
        pipelines=_pipelines(statuses.values()),
    )


def _runs(statuses: Iterable[PeerStatus]) -> tuple[RunRow, ...]:
    by_run: dict[str, list[RunStatus]] = {}
    for status in statuses:
        for run in status.runs:
            by_run.setdefault(run.run_id, []).append(run)
    rows = []
    for run_id, runs in sorted(by_run.items()):
        losses = [r.loss for r in runs if r.loss is not None]
        rows.append(
            RunRow(
                run_id=run_id,
                num_peers=len(runs),
                epoch=int(statistics.median_low([r.epoch for r in runs])),
                loss=statistics.median(losses) if losses else None,
                samples_per_second=sum(r.samples_per_second for r in runs),
                samples=sum(r.samples for r in runs),
                num_rounds=max(r.num_rounds for r in runs),
                num_rounds_failed=sum(r.num_rounds_failed for r in runs),
            )
        )
    return tuple(rows)


def _experts(statuses: Iterable[PeerStatus]) -> tuple[ExpertRow, ...]:
    found: dict[str, list[int]] = {}  # uid -> [servers, queued, batches]
    for status in statuses:
        for served in status.served:
            if served.kind == "expert":
                row = found.setdefault(served.name, [0, 0, 0])
                row[0] += 1
                row[1] += served.queued
                row[2] += served.num_batches
    return tuple(ExpertRow(uid, *counts) for uid, counts in sorted(found.items()))


def _pipelines(statuses: Iterable[PeerStatus]) -> tuple[PipelineRow, ...]:
    stages: dict[str, int] = {}
    seen: list[tuple[str, int, int, int]] = []  # prefix, stage, num_stages, queued
    for status in statuses:
        for served in status.served:
            if served.kind == "stage":
                # Peers may disagree on the number of stages; the largest claim shows
                # every stage someone serves.
                stages[served.name] = max(stages.get(served.name, 0), served.num_stages)
                seen.append((served.name, served.stage, served.num_stages, served.queued))
    rows = []
    for prefix, num_stages in sorted(stages.items()):
        servers, queued = [0] * num_stages, [0] * num_stages
        for name, stage, _, waiting in seen:
            if name == prefix:
                servers[stage] += 1
                queued[stage] += waiting
        rows.append(PipelineRow(prefix, num_stages, tuple(servers), tuple(queued)))
    return tuple(rows)
