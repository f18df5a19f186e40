"""DHT benchmark: ours (``peers.dht``) against hivemind's DHT, N local peer processes each.

Everything runs on 127.0.0.1; every peer is its own OS process (hivemind's is a Python
process that forks its DHT process, which starts a Go ``p2pd``). Per repetition and per
system, a fresh swarm:

1. bring-up: from just before the first process starts to every one of the N peers
   having joined. One bootstrap peer first; once it has joined, the other N-1 start at
   once with it as their initial peer. Ours: ``LocalSwarm`` peers running
   ``_dht_peers.py:ours_node`` (a ``DHT`` with the default config, joined the way
   ``peers.dht.testing:dht_node`` joins); hivemind: ``hivemind.DHT(initial_peers=...)``,
   ready with its visible maddrs. Interpreter start and imports (torch, for hivemind)
   are inside the span: a user waits for them too. ``join`` is the per-peer median of
   creating the DHT object to joined, imports excluded.
2. latency, timed inside the peer processes: a few peers in turn (one at a time, so
   each op meets an otherwise idle swarm) each store about a hundred keys one after
   another, after a short untimed warm-up; then as many other peers, in turn, get
   those keys one after another, each key one that another peer stored, taking the
   first live value found (hivemind's default ``get(key)``, ours ``get(key,
   latest=False)``); then the same peers get another writer's keys asking for the
   freshest value among the replicas (``latest=True`` on both). p50/p95 pool the
   repetition's timed ops.
3. throughput: several peers at once, each with a few ops in flight, store fresh keys,
   then get the keys a neighbour stored. ops/s = successful ops / (last end - first start).
4. memory per peer, after the above: RSS summed over the peer's process and all its
   descendants (/proc); hivemind's Go daemon share separately; PSS too (RSS counts the
   pages a forked child shares with its parent twice, PSS splits them).

Systems alternate in order across repetitions; figures are medians over repetitions.
The run ends with one JSON line; ratios are oriented so that > 1 means ours is better.

    .venv/bin/python benchmarks/bench_dht.py --quick   # 16 peers, 1 rep, under a minute
    .venv/bin/python benchmarks/bench_dht.py           # 32 peers, 3 reps, a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import (
    LOOPBACK,
    BenchError,
    JsonChild,
    Placement,
    descendants,
    emit_result,
    installed_hivemind,
    median,
    memory_bytes,
    percentile,
    pid_command,
    print_table,
    stop_pids,
)

PEERS_FILE = Path(__file__).resolve().parent / "_dht_peers.py"
OURS_TARGET = f"{PEERS_FILE}:ours_node"
#: Memory and throughput unit: 10^6 bytes.
MB = 1_000_000

#: Seconds for a whole swarm to come up (32 hivemind peers import torch on 2 cores).
BRING_UP_TIMEOUT = 240.0
#: Seconds one DHT operation may take before it counts as timed out.
OP_TIMEOUT = 10.0
#: Seconds one batch of ops may run in a peer; no op starts later than this.
BATCH_DEADLINE = 90.0
#: Seconds the parent waits for a batch's report beyond the batch deadline.
REPORT_GRACE = OP_TIMEOUT + 20.0
#: Seconds a stored value lives (longer than any run).
TTL = 600.0
VALUE_PADDING = "x" * 32


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How much to measure."""

    num_peers: int
    """Peers per swarm, the bootstrap peer included."""
    num_reps: int
    """Fresh swarms per system; figures are medians over them."""
    num_latency_peers: int
    """Peers that store (and as many others that get) one op at a time, in turn."""
    num_latency_ops: int
    """Timed ops per latency peer per kind."""
    num_warmup_ops: int
    """Untimed ops per latency peer before its timed ones."""
    num_load_peers: int
    """Peers issuing ops at the same time in the throughput phase."""
    load_concurrency: int
    """Ops in flight per peer in the throughput phase."""
    num_load_ops: int
    """Ops per peer per kind in the throughput phase."""
    disjoint_paths: int = 1
    """Our lookups' disjoint paths (``DHTConfig.disjoint_paths``; the default is 1)."""
    alpha: int | None = None
    """Our lookups' queries in flight (``DHTConfig.alpha``; ``None``: the default)."""

    def __post_init__(self) -> None:
        if self.num_peers < 1 + max(2 * self.num_latency_peers, self.num_load_peers):
            raise ValueError("too few peers for the latency and throughput phases")
        if self.num_load_peers < 2:
            raise ValueError("the throughput phase needs 2 peers (one gets what another stored)")


QUICK = Plan(
    num_peers=16,
    num_reps=1,
    num_latency_peers=2,
    num_latency_ops=30,
    num_warmup_ops=5,
    num_load_peers=4,
    load_concurrency=4,
    num_load_ops=25,
)
FULL = Plan(
    num_peers=32,
    num_reps=3,
    num_latency_peers=2,
    num_latency_ops=90,
    num_warmup_ops=10,
    num_load_peers=8,
    load_concurrency=4,
    num_load_ops=25,
)


# --- peers ----------------------------------------------------------------------------


class Member(Protocol):
    """One peer process, as the phases see it (``peers.testing.PeerProcess`` is one)."""

    @property
    def pid(self) -> int: ...

    def send(self, message: dict[str, Any]) -> None: ...

    def wait_report(self, event: str, timeout: float) -> dict[str, Any]: ...


class HivemindPeer(JsonChild):
    """A ``_dht_peers.py hivemind`` process, its output, and the processes it started."""

    def __init__(self, options: dict[str, Any], namespace: str | None = None) -> None:
        super().__init__(
            PEERS_FILE, ["hivemind", json.dumps(options)], name="hivemind peer", namespace=namespace
        )


class Swarm(Protocol):
    members: list[Any]

    def start(self, num: int, initial_peers: list[str]) -> list[Any]: ...

    def close(self) -> None: ...


class OursSwarm:
    def __init__(
        self, disjoint_paths: int = 1, placement: Placement = LOOPBACK, alpha: int | None = None
    ) -> None:
        from peers.testing import LocalSwarm

        self.local = LocalSwarm(startup_timeout=BRING_UP_TIMEOUT)
        self.members: list[Any] = []
        self.disjoint_paths = disjoint_paths
        self.placement = placement
        self.alpha = alpha

    def start(self, num: int, initial_peers: list[str]) -> list[Any]:
        from peers.testing import SwarmError

        options: dict[str, Any] = {"disjoint_paths": self.disjoint_paths}
        if self.alpha is not None:
            options["alpha"] = self.alpha
        if initial_peers:
            options["initial_peers"] = initial_peers
        ranks = range(len(self.members), len(self.members) + num)
        try:
            started = self.local.start(
                num,
                target=OURS_TARGET,
                options=options,
                per_peer_options=[
                    {"listen": [f"/ip4/{self.placement.host(r)}/tcp/0"]} for r in ranks
                ],
                namespaces=[self.placement.namespace(r) for r in ranks],
            )
        except SwarmError as e:
            raise BenchError(str(e)) from e
        self.members += started
        return started

    def close(self) -> None:
        self.local.close()


class HivemindSwarm:
    def __init__(self, placement: Placement = LOOPBACK) -> None:
        self.members: list[HivemindPeer] = []
        self.placement = placement

    def start(self, num: int, initial_peers: list[str]) -> list[Any]:
        ranks = range(len(self.members), len(self.members) + num)
        started = [
            HivemindPeer(
                {"initial_peers": initial_peers, "host": self.placement.host(r)},
                self.placement.namespace(r),
            )
            for r in ranks
        ]
        self.members += started
        return started

    def close(self) -> None:
        """SIGTERM (then SIGKILL) every peer and every process it started, by PID, all at
        once. Each of them leaves cleanly on SIGTERM (``p2pd`` removes its socket); asked
        one by one through stdin instead, 16 peers took 14 s to leave."""
        for member in self.members:
            member.remember_tree()
        stop_pids([m.pid for m in self.members] + sorted({p for m in self.members for p in m.tree}))
        for member in self.members:
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.popen.wait(1.0)  # reap it
            for pipe in (member.popen.stdin, member.popen.stdout, member.popen.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            for socket_path in member.sockets:  # ours: its p2pd is dead by now
                path = Path(socket_path)
                if path.is_socket():
                    path.unlink(missing_ok=True)
        self.members = []


# --- phases ---------------------------------------------------------------------------


@dataclass
class RepResult:
    bring_up_s: float
    join_s: list[float]
    latencies_s: dict[str, list[float]] = field(default_factory=dict)
    """``store`` / ``get`` / ``get_latest`` -> every timed op of the latency phase."""
    ops_per_s: dict[str, float] = field(default_factory=dict)
    """``store`` / ``get`` / ``mixed`` -> aggregate rate in the throughput phase."""
    memory_mb: dict[str, list[float]] = field(default_factory=dict)
    """``rss`` / ``pss`` / ``daemon_rss`` -> one figure per peer."""
    bad_ops: Counter[str] = field(default_factory=Counter)
    """Timed ops that did not succeed, by phase and outcome."""
    phase_s: dict[str, float] = field(default_factory=dict)
    """Seconds the ops phases and the teardown took (to see where a run's time goes)."""
    errors: list[str] = field(default_factory=list)
    """The first exception each batch met, if any."""


def bring_up(swarm: Swarm, num_peers: int) -> tuple[float, list[float]]:
    """Seconds from the first process's start to every peer joined; per-peer join_s."""
    began = time.perf_counter()
    deadline = time.monotonic() + BRING_UP_TIMEOUT

    def joined(member: Member) -> dict[str, Any]:
        return member.wait_report("joined", max(0.1, deadline - time.monotonic()))

    (first,) = swarm.start(1, [])
    reports = [joined(first)]
    rest = swarm.start(num_peers - 1, [reports[0]["addrs"][0]])
    reports += [joined(member) for member in rest]
    return time.perf_counter() - began, [float(r["join_s"]) for r in reports]


def run_batches(
    members: list[Member], commands: list[dict[str, Any]], result: RepResult, phase: str
) -> list[dict[str, Any]]:
    """Send each member its ``ops`` command at once; their reports, bad outcomes tallied."""
    for member, command in zip(members, commands, strict=True):
        member.send(
            {"op": "ops", "op_timeout": OP_TIMEOUT, "deadline_s": BATCH_DEADLINE, **command}
        )
    deadline = time.monotonic() + BATCH_DEADLINE + REPORT_GRACE
    reports = [m.wait_report("ops", max(0.1, deadline - time.monotonic())) for m in members]
    for report in reports:
        for outcome, count in report["outcomes"].items():
            if outcome != "ok":
                result.bad_ops[f"{phase}_{report['kind']}_{outcome}"] += count
        if report["first_error"]:
            result.errors.append(f"{phase} {report['kind']}: {report['first_error'][:200]}")
    return reports


def _items(tag: str, count: int) -> list[list[str]]:
    return [[f"{tag}/{i}", f"{tag}/{i}/{VALUE_PADDING}"] for i in range(count)]


def measure_ops(plan: Plan, members: list[Member], result: RepResult, tag: str) -> None:
    """The latency phase, then the throughput phase (the bootstrap peer takes no part)."""
    num = plan.num_latency_peers
    writers, readers = members[1 : 1 + num], members[1 + num : 1 + 2 * num]
    per_peer = plan.num_warmup_ops + plan.num_latency_ops
    stored = [_items(f"{tag}/latency/{w}", per_peer) for w in range(num)]
    for kind, group, shift in (
        ("store", writers, 0),
        ("get", readers, 0),
        ("get_latest", readers, 1),
    ):
        # Reader r gets the keys writer r+shift stored (always another peer; a key read
        # a second time by the same reader could come from hivemind's local cache).
        # One peer at a time: each op meets an otherwise idle swarm.
        reports = []
        for r, member in enumerate(group):
            command = {
                "kind": kind,
                "items": stored[(r + shift) % num],
                "concurrency": 1,
                "warmup": plan.num_warmup_ops,
            }
            reports += run_batches([member], [command], result, "latency")
        result.latencies_s[kind] = [s for r in reports for s in r["latencies"]]

    loaders = members[1 : 1 + plan.num_load_peers]
    stored = [_items(f"{tag}/load/{n}", plan.num_load_ops) for n in range(len(loaders))]
    spent = 0.0
    done = 0
    for kind, shift in (("store", 0), ("get", 1)):
        # Peer n gets what peer n+1 stored.
        commands = [
            {
                "kind": kind,
                "items": stored[(n + shift) % len(loaders)],
                "concurrency": plan.load_concurrency,
            }
            for n in range(len(loaders))
        ]
        reports = run_batches(loaders, commands, result, "load")
        seconds = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
        ok = sum(r["outcomes"].get("ok", 0) for r in reports)
        result.ops_per_s[kind] = ok / seconds if seconds > 0 else 0.0
        spent += seconds
        done += ok
    result.ops_per_s["mixed"] = done / spent if spent > 0 else 0.0


def measure_memory(members: list[Member], result: RepResult) -> None:
    """Per peer: RSS and PSS summed over its process tree, and its ``p2pd``'s RSS."""
    for kind in ("rss", "pss", "daemon_rss"):
        result.memory_mb[kind] = []
    for member in members:
        rss = pss = daemon = 0
        for pid in [member.pid, *descendants(member.pid)]:
            sizes = memory_bytes(pid)
            if sizes is None:
                continue
            rss += sizes[0]
            pss += sizes[1]
            if "p2pd" in pid_command(pid):
                daemon += sizes[0]
        result.memory_mb["rss"].append(rss / MB)
        result.memory_mb["pss"].append(pss / MB)
        result.memory_mb["daemon_rss"].append(daemon / MB)


def run_rep(system: str, plan: Plan, rep: int, placement: Placement = LOOPBACK) -> RepResult:
    """One fresh swarm of ``system``: bring-up, ops, memory; always torn down. With a
    placement, peer ``i`` runs in its ``namespace(i)`` and listens on its ``host(i)``."""
    swarm: Swarm = (
        OursSwarm(plan.disjoint_paths, placement, plan.alpha)
        if system == "ours"
        else HivemindSwarm(placement)
    )
    result: RepResult | None = None
    try:
        seconds, join_s = bring_up(swarm, plan.num_peers)
        result = RepResult(seconds, join_s)
        if isinstance(swarm, HivemindSwarm):
            for member in swarm.members:
                member.remember_tree()
        began = time.perf_counter()
        measure_ops(plan, swarm.members, result, f"bench/{system}/{rep}")
        result.phase_s["ops"] = time.perf_counter() - began
        measure_memory(swarm.members, result)
        return result
    finally:
        began = time.perf_counter()
        swarm.close()
        if result is not None:
            result.phase_s["teardown"] = time.perf_counter() - began


# --- main -----------------------------------------------------------------------------


def summarize(results: list[RepResult]) -> dict[str, float]:
    """Medians over repetitions, keyed ``<figure>_<unit>`` (no system suffix yet)."""
    out: dict[str, float] = {
        "bring_up_s": median([r.bring_up_s for r in results]),
        "join_s": median([median(r.join_s) for r in results]),
    }
    for kind in ("store", "get", "get_latest"):
        for q in (50, 95):
            values = [percentile(r.latencies_s[kind], q) for r in results if r.latencies_s[kind]]
            if values:
                out[f"{kind}_p{q}_ms"] = median(values) * 1e3
    for kind in ("store", "get", "mixed"):
        name = "ops_per_s" if kind == "mixed" else f"{kind}_ops_per_s"
        out[name] = median([r.ops_per_s[kind] for r in results])
    for kind in ("rss", "pss", "daemon_rss"):
        out[f"{kind}_per_peer_MB"] = median([median(r.memory_mb[kind]) for r in results])
    out["bad_ops"] = float(sum(sum(r.bad_ops.values()) for r in results))
    return out


#: Ratio name -> (figure, True if larger is better). Ratios are hivemind/ours for
#: costs and ours/hivemind for rates, so > 1 always means ours is better.
RATIOS = {
    "bring_up": ("bring_up_s", False),
    "join": ("join_s", False),
    "store_p50": ("store_p50_ms", False),
    "store_p95": ("store_p95_ms", False),
    "get_p50": ("get_p50_ms", False),
    "get_p95": ("get_p95_ms", False),
    "get_latest_p50": ("get_latest_p50_ms", False),
    "get_latest_p95": ("get_latest_p95_ms", False),
    "ops_per_s": ("ops_per_s", True),
    "store_ops_per_s": ("store_ops_per_s", True),
    "get_ops_per_s": ("get_ops_per_s", True),
    "rss_per_peer": ("rss_per_peer_MB", False),
    "pss_per_peer": ("pss_per_peer_MB", False),
}
#: The ratios we aim for: bring-up <= 0.3x hivemind's, latency and memory <= 0.5x.
TARGETS = {"bring_up": 1 / 0.3, "store_p50": 2.0, "get_p50": 2.0, "rss_per_peer": 2.0}

ROWS = [
    ("bring-up to all joined (s)", "bring_up_s", "{:.2f}"),
    ("per-peer join, imports excluded (s)", "join_s", "{:.3f}"),
    ("store p50 (ms)", "store_p50_ms", "{:.2f}"),
    ("store p95 (ms)", "store_p95_ms", "{:.2f}"),
    ("get p50 (ms)", "get_p50_ms", "{:.2f}"),
    ("get p95 (ms)", "get_p95_ms", "{:.2f}"),
    ("get, freshest value, p50 (ms)", "get_latest_p50_ms", "{:.2f}"),
    ("get, freshest value, p95 (ms)", "get_latest_p95_ms", "{:.2f}"),
    ("store ops/s, concurrent", "store_ops_per_s", "{:.0f}"),
    ("get ops/s, concurrent", "get_ops_per_s", "{:.0f}"),
    ("store+get ops/s, concurrent", "ops_per_s", "{:.0f}"),
    ("RSS per peer, whole tree (MB)", "rss_per_peer_MB", "{:.1f}"),
    ("  of which Go p2pd (MB)", "daemon_rss_per_peer_MB", "{:.1f}"),
    ("PSS per peer, whole tree (MB)", "pss_per_peer_MB", "{:.1f}"),
    ("ops that failed (all reps)", "bad_ops", "{:.0f}"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 peers, 1 rep, under a minute")
    parser.add_argument("--no-hivemind", action="store_true", help="measure ours only")
    parser.add_argument("--peers", type=int, help="peers per swarm")
    parser.add_argument("--reps", type=int, help="repetitions (fresh swarms) per system")
    parser.add_argument(
        "--disjoint-paths", type=int, default=1, help="our lookups' disjoint paths (1)"
    )
    parser.add_argument(
        "--alpha", type=int, help="our lookups' queries in flight (default: DHTConfig's)"
    )
    args = parser.parse_args(argv)
    if args.alpha is not None and args.alpha < 1:
        parser.error(f"--alpha {args.alpha}: our lookups need at least 1 query in flight")
    plan = QUICK if args.quick else FULL
    if args.peers:
        plan = replace(plan, num_peers=args.peers)
    if args.reps:
        plan = replace(plan, num_reps=args.reps)
    plan = replace(plan, disjoint_paths=args.disjoint_paths, alpha=args.alpha)

    notes: list[str] = []
    version, why = (
        (None, "disabled with --no-hivemind") if args.no_hivemind else installed_hivemind()
    )
    if version is None:
        notes.append(f"hivemind not measured: {why}")
        print(f"hivemind: not measured: {why}", file=sys.stderr)
    mode = "quick" if args.quick else "full"
    load_before = os.getloadavg()[0]
    print(
        f"DHT benchmark ({mode}): {plan.num_peers} peer processes on 127.0.0.1, "
        f"{plan.num_reps} rep(s), {os.cpu_count()} CPUs (load average {load_before:.1f});"
        f" hivemind {version or 'absent'}",
        flush=True,
    )
    began = time.monotonic()
    systems = ["ours", "hivemind"] if version else ["ours"]
    results: dict[str, list[RepResult]] = {s: [] for s in systems}
    for rep in range(plan.num_reps):
        shift = rep % len(systems)
        for system in systems[shift:] + systems[:shift]:
            if system not in results:
                continue
            try:
                r = run_rep(system, plan, rep)
            except Exception as e:  # ours fails loudly; hivemind is dropped, with a note
                if system == "ours":
                    raise
                notes.append(f"hivemind failed in repetition {rep + 1}; dropped: {e}")
                print(f"hivemind failed, measuring without it: {e}", file=sys.stderr)
                del results[system]
                continue
            results[system].append(r)
            notes += [f"{system} rep {rep + 1}: {e}" for e in r.errors]
            print(
                f"  rep {rep + 1}/{plan.num_reps} {system:>8}: bring-up {r.bring_up_s:.2f} s,"
                f" store p50 {percentile(r.latencies_s['store'] or [0.0], 50) * 1e3:.2f} ms,"
                f" get p50 {percentile(r.latencies_s['get'] or [0.0], 50) * 1e3:.2f} ms,"
                f" {r.ops_per_s['mixed']:.0f} ops/s, RSS/peer {median(r.memory_mb['rss']):.1f} MB"
                f" (ops {r.phase_s['ops']:.1f} s, teardown {r.phase_s['teardown']:.1f} s)"
                + (f", failed ops {dict(r.bad_ops)}" if r.bad_ops else ""),
                flush=True,
            )
    total_s = time.monotonic() - began

    summary = {s: summarize(rs) for s, rs in results.items() if rs}
    ours, theirs = summary.get("ours", {}), summary.get("hivemind", {})
    figures = {
        f"{name}_{system}": round(value, 4)
        for system, table in summary.items()
        for name, value in table.items()
        if not (system == "ours" and name == "daemon_rss_per_peer_MB")
    }
    ratios: dict[str, float] = {}
    for ratio, (name, larger_is_better) in RATIOS.items():
        if ours.get(name) and theirs.get(name):
            value = ours[name] / theirs[name] if larger_is_better else theirs[name] / ours[name]
            ratios[ratio] = round(value, 3)

    def cell(table: dict[str, float], name: str, fmt: str) -> str:
        return fmt.format(table[name]) if name in table else "-"

    rows = [["measurement", "ours", "hivemind", "ratio"]]
    ratio_of = {figure: ratio for ratio, (figure, _) in RATIOS.items()}
    for label, name, fmt in ROWS:
        shown = ratios.get(ratio_of.get(name, ""))
        rows.append(
            [
                label,
                cell(ours, name, fmt),
                cell(theirs, name, fmt),
                f"{shown:.2f}x" if shown else "",
            ]
        )
    print_table(
        f"{plan.num_peers} peers, medians over {len(next(iter(results.values()), []))} rep(s);"
        " MB = 10^6 bytes; ratio > 1 means ours is better",
        rows,
    )
    for ratio, target in TARGETS.items():
        if ratio in ratios:
            verdict = "met" if ratios[ratio] >= target else "NOT met"
            print(f"target {ratio}: ours <= {1 / target:.1f}x hivemind's: {verdict}")
    for note in notes:
        print(f"note: {note}")
    load_after = os.getloadavg()[0]
    print(f"total {total_s:.1f} s; 1-minute load average {load_before:.1f} -> {load_after:.1f}")
    emit_result(
        "dht",
        figures,
        ratios,
        mode=mode,
        hivemind=version,
        notes=notes,
        plan=asdict(plan),
        cpus=os.cpu_count(),
        load_average=[round(load_before, 1), round(load_after, 1)],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
