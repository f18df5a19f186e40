"""All-reduce benchmark: ours (butterfly rounds on ``peers``) against hivemind's
``DecentralizedAverager``, and the physical limit, 4 peer processes each.

Everything runs on 127.0.0.1; every peer is its own OS process, with
``torch.set_num_threads(1)`` on both sides (4 processes share the cores; torch's thread
pools would oversubscribe them). Each member averages a float32 vector of N elements
(standard normal values, a different one per member) with the others, equal weights, for
each size and codec (none, float16, 8-bit uniform: ours ``Uniform8BitCodec``, hivemind's
``Uniform8BitQuantization``). Three measurements, one after another (never two systems at
once: a 64M-element vector is 256 MiB per peer):

1. the limit: 4 processes exchange over plain TCP (no encryption, no framing) the bytes a
   butterfly all-reduce moves: every peer sends 2N/n bytes to each of the n-1 others and
   receives as much, all links at once. Per-peer throughput = 2(n-1)/n N bytes / seconds
   (from a common start to the last peer done); the bound for a codec is
   2(n-1)/n x (N x the codec's wire bytes per element) / that throughput.
2. ours, the round itself: the group is given (``AllReduceService.run_round`` with a
   ``RoundSpec`` naming the 4 members, no matchmaking). Every member starts at one agreed
   instant; a round's time runs from it to the last member holding its result. Then the
   full ``Averager.step`` (matchmaking through our DHT, then the round), timed the same way.
3. hivemind: ``DecentralizedAverager.step()`` (``target_group_size=min_group_size=4``,
   ``min_matchmaking_time`` as given, ``allow_retries=False``, our rounds' default
   timeouts). Its all-reduce is timed inside the averager's process, around
   ``_aggregate_with_group`` (what runs after matchmaking: part balancing, the butterfly
   all-reduce, adding the result to the tensors); a round's time runs from the first
   member entering it to the last leaving it. ``step()`` as a whole (matchmaking + the
   all-reduce) is timed from the common call instant to the last member returning.

Every round is checked against the true mean on sampled blocks on both sides (largest
and RMS error; ours also against its codecs' declared error bound), and every member must
hold the same sampled values; a system that is wrong gets no ratio. hivemind 1.1.12's
8-bit codecs fail on numpy 2 (``int()`` of a 1-element array): that failure is recorded
as is, then (unless ``--no-patch``) the same codec runs again with that one line fixed
in hivemind's process, reported separately as ``uint8_patched``.

Figures are medians over rounds, after one untimed warm-up round per size and codec.
The run ends with one JSON line; ratios are oriented so that > 1 means ours is better,
except ``*_fraction_of_bound`` (bound seconds / our seconds, <= 1: the bound for the
codec's wire bytes) and, for the compressed codecs, ``*_fraction_of_float32_bound``
(the issue's bound, 2(n-1)/n x N float32 bytes, whatever the codec sends).

    .venv/bin/python benchmarks/bench_allreduce.py --quick   # 4M elements, about a minute
    .venv/bin/python benchmarks/bench_allreduce.py           # 16M and 64M, a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import (
    LOOPBACK,
    BenchError,
    JsonChild,
    Placement,
    emit_result,
    installed_hivemind,
    median,
    print_table,
    stop_pids,
)

PEERS_FILE = Path(__file__).resolve().parent / "_allreduce_peers.py"
OURS_TARGET = f"{PEERS_FILE}:ours_node"
#: Throughput unit: 10^6 bytes per second.
MB = 1_000_000
#: Wire bytes per float32 element of each codec (headers aside): the bound moves these.
WIRE_BYTES_PER_ELEMENT = {"none": 4.0, "float16": 2.0, "uint8": 1.0, "blockwise8": 1.0}
#: Largest RMS error of a result relative to the RMS of the true mean, per codec: float32
#: summation order; float16 rounding twice (2**-11 relative each); 8-bit rounding twice
#: on a 256-step grid spanning about 6-9 standard deviations.
RMS_TOLERANCE = {"none": 1e-6, "float16": 2e-3, "uint8": 0.05, "blockwise8": 0.05}
#: Absolute slack on our declared error bounds (float32 rounding of the mean itself).
BOUND_SLACK = 1e-5
#: Memory a size needs, as a multiple of one vector's bytes per peer. Measured peaks at
#: 64M elements (256 MiB vectors), rounds and full steps: ours 8.0-8.9x (2.15-2.38 GB
#: per peer), hivemind's 10.8-12.8x (2.9-3.4 GB); the systems run one at a time. A size that does
#: not fit in MemAvailable is skipped with a note rather than risk the OOM killer.
MEMORY_PER_VECTOR = 14
#: Ratio targets from the issue: >= 3x hivemind's throughput; >= 30% of the bound.
TARGET_VS_HIVEMIND = 3.0
TARGET_FRACTION_OF_BOUND = 0.3

#: Seconds a process has to start (hivemind's imports torch and starts p2pd, on 2 cores).
STARTUP_TIMEOUT = 240.0
#: Seconds members building their vectors (and our codecs' bounds) may take.
PREPARE_TIMEOUT = 300.0
#: Seconds from sending a round's command to its start: time for every member to read it.
START_DELAY = 0.3
#: The same for a full step, which also enters an ``Averager`` (copying the vector):
#: this much plus ``STEP_START_DELAY_PER_ELEMENT`` times the vector's length.
STEP_START_DELAY = 0.5
STEP_START_DELAY_PER_ELEMENT = 1e-8
#: A member starting this much after the agreed instant is counted late (the machine is
#: too loaded for the start delay; its lateness inflates that round's time).
LATE_SECONDS = 0.05
#: Round timeouts for both systems (ours' defaults: ``AllReduceConfig``).
SENDER_TIMEOUT, REDUCER_TIMEOUT, ROUND_TIMEOUT = 10.0, 20.0, 60.0
#: Seconds the parent waits for a round's reports beyond the round's own timeouts.
REPORT_GRACE = 60.0


def elements(size: str) -> int:
    """``"16M"`` -> 16 * 2**20; ``"256K"`` -> 256 * 2**10; a plain number as is."""
    found = re.fullmatch(r"(\d+)([KM]?)", size)
    if not found or int(found.group(1)) <= 0:
        raise ValueError(f"size {size!r}: use e.g. 16M, 256K or 1000")
    return int(found.group(1)) << {"": 0, "K": 10, "M": 20}[found.group(2)]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How much to measure."""

    num_peers: int = 4
    """Members of every round."""
    sizes: tuple[str, ...]
    """Vector sizes in elements, as labels: ``16M`` is 16 x 2**20 float32 values."""
    codecs: tuple[str, ...] = ("none", "float16", "uint8")
    """Wire codecs, by our names."""
    num_rounds: int
    """Timed rounds per size and codec (after one warm-up round)."""
    num_step_rounds: int
    """Timed full steps (matchmaking + round) per size and codec, ours and hivemind's
    (after one warm-up); hivemind's all-reduce figures come from its first
    ``num_rounds`` of these."""
    num_bound_reps: int
    """Timed raw TCP exchanges per size (after one warm-up)."""
    matchmaking_seconds: float = 1.0
    """hivemind's ``min_matchmaking_time`` and our ``gather_timeout``."""
    round_wait: float = ROUND_TIMEOUT
    """Seconds the parent waits for a round beyond its start (and matchmaking) before it
    calls the round hung: rounds on slow links are paced longer than the default
    timeouts (``bench_wan.py``)."""
    reducers_per_part: int = 1
    """Our rounds' ``RoundSpec.reducers_per_part`` (3: each coordinate reduced by three
    members, the median kept; hivemind has no such mode and runs as always)."""
    connections_per_member: int | None = None
    """Our ``AllReduceConfig.connections_per_member`` (None: its default): 1 measures
    links on one connection each, as before lanes."""
    reverse_lane: bool | None = None
    """Our ``AllReduceConfig.reverse_lane`` (None: its default): False measures the
    member that does not open a link waiting for the opener's stream, as before."""

    def __post_init__(self) -> None:
        if self.num_peers < 2:
            raise ValueError("an all-reduce needs 2 peers")
        for codec in self.codecs:
            if codec not in WIRE_BYTES_PER_ELEMENT:
                raise ValueError(f"unknown codec {codec!r}")
        for size in self.sizes:
            elements(size)


QUICK = Plan(sizes=("4M",), num_rounds=2, num_step_rounds=1, num_bound_reps=3)
FULL = Plan(sizes=("16M", "64M"), num_rounds=5, num_step_rounds=5, num_bound_reps=5)


# --- processes -------------------------------------------------------------------------


class JsonProcess(JsonChild):
    """A ``_allreduce_peers.py`` process (hivemind or raw), its output, and its children."""

    def __init__(self, args: list[str], namespace: str | None = None) -> None:
        super().__init__(PEERS_FILE, args, namespace=namespace)


def close_processes(processes: Sequence[JsonChild]) -> None:
    """SIGTERM (then SIGKILL) every process and everything it started, by PID."""
    for proc in processes:
        proc.remember_tree()
    stop_pids([p.pid for p in processes] + sorted({pid for p in processes for pid in p.tree}))
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.popen.wait(1.0)
        for pipe in (proc.popen.stdin, proc.popen.stdout, proc.popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        for socket_path in proc.sockets:
            path = Path(socket_path)
            if path.is_socket():
                path.unlink(missing_ok=True)


def wait_all(members: list[Any], event: str, timeout: float) -> list[dict[str, Any]]:
    """Each member's next ``event`` report (``error`` reports from ours raise)."""
    deadline = time.monotonic() + timeout
    reports = []
    for member in members:
        while True:
            if isinstance(member, JsonProcess):
                report = member.wait_report(event, max(0.1, deadline - time.monotonic()))
            else:  # peers.testing.PeerProcess
                report = member.next_report(max(0.1, deadline - time.monotonic()))
                if report.get("event") == "error":
                    raise BenchError(f"our peer {member.index} failed: {report['error']}")
            if report.get("event") == event:
                reports.append(report)
                break
    return reports


# --- records ---------------------------------------------------------------------------


@dataclass
class Series:
    """The timed rounds of one system at one size and codec."""

    seconds: list[float] = field(default_factory=list)
    """The all-reduce (the round itself), one per round."""
    step_seconds: list[float] = field(default_factory=list)
    """The whole step, matchmaking included."""
    matchmaking_seconds: list[float] = field(default_factory=list)
    """Per round, the median over members of matchmaking alone."""
    bytes_sent: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    """Per round, the median over members of CPU seconds spent in the round (ours) or
    in ``step()`` (hivemind, its whole process tree: averager, DHT process, ``p2pd``)."""
    peak_rss_mb: float = 0.0
    """The largest peak resident set (VmHWM; hivemind: summed over its process tree) of
    any member after any round, in 10^6 bytes: a process's peak over its life so far."""
    num_late: int = 0
    """Rounds where a member started more than ``LATE_SECONDS`` after the agreed instant."""
    max_error: float = 0.0
    rms_relative_error: float = 0.0
    shares: list[list[float]] = field(default_factory=list)
    """Per timed full step (ours), each member's share of the vector to reduce, by rank:
    what the rates the members announced bought them."""
    measured: list[list[float]] = field(default_factory=list)
    """Per timed full step (ours), the rate (bytes/s) each member measured in it (what
    it announces in the next), by rank."""
    problems: list[str] = field(default_factory=list)
    """Why a result was wrong (empty when every checked round was right)."""
    failure: str = ""
    """The error that stopped this series, if one did."""

    def add_memory(self, reports: list[dict[str, Any]]) -> None:
        peaks = [r.get("peak_rss_MB", 0.0) for r in reports]
        self.peak_rss_mb = max(self.peak_rss_mb, *peaks)

    def count_late(self, reports: list[dict[str, Any]], start_at: float) -> None:
        self.num_late += max(r["started"] for r in reports) - start_at > LATE_SECONDS


def check_round(
    reports: list[dict[str, Any]],
    series: Series,
    codec: str,
    tolerance: float | None,
    *,
    identical: bool,
) -> None:
    """Fold one round's correctness into ``series``: every member's errors within
    tolerance and, with ``identical``, every member holding the same sampled values
    (ours promises it; hivemind adds the averaged delta to each member's own values, so
    its members differ in the last bits, which is fine)."""
    rms = max(r["rms_error"] / max(r["rms_mean"], 1e-30) for r in reports)
    worst = max(r["max_error"] for r in reports)
    series.max_error = max(series.max_error, worst)
    series.rms_relative_error = max(series.rms_relative_error, rms)
    if rms > RMS_TOLERANCE[codec]:
        series.problems.append(f"RMS error {rms:.2e} of the mean's RMS > {RMS_TOLERANCE[codec]}")
    if tolerance is not None and worst > tolerance:
        series.problems.append(f"largest error {worst:.3g} > declared bound {tolerance:.3g}")
    if identical and len({r["digest"] for r in reports}) != 1:
        series.problems.append("members hold different results")
    for r in reports:
        if r.get("agreed") is False or r.get("fraction", 1.0) < 1.0 or r.get("failed"):
            series.problems.append(f"round incomplete: {r.get('fraction')}, {r.get('failed')}")
        if "group_size" in r and r["group_size"] != len(reports):
            series.problems.append(f"group of {r['group_size']}, not {len(reports)}")


def span(reports: list[dict[str, Any]], start: str, end: str) -> float:
    return float(max(r[end] for r in reports) - min(r[start] for r in reports))


# --- the limit -------------------------------------------------------------------------


def measure_bound(plan: Plan, placement: Placement = LOOPBACK) -> dict[str, list[float]]:
    """Per size, seconds of each timed raw all-to-all exchange."""
    procs = [
        JsonProcess(["raw", placement.host(rank)], placement.namespace(rank))
        for rank in range(plan.num_peers)
    ]
    try:
        ports = [p.wait_report("listening", STARTUP_TIMEOUT)["port"] for p in procs]
        hosts = [placement.host(rank) for rank in range(plan.num_peers)]
        for rank, proc in enumerate(procs):
            proc.send({"op": "connect", "rank": rank, "ports": ports, "hosts": hosts})
        wait_all(procs, "connected", STARTUP_TIMEOUT)
        out: dict[str, list[float]] = {}
        for size in plan.sizes:
            per_link = 2 * 4 * elements(size) // plan.num_peers
            out[size] = []
            for rep in range(1 + plan.num_bound_reps):
                # The first exchange of a size also fills its buffers: start it later.
                start_at = time.monotonic() + (3.0 if rep == 0 else START_DELAY)
                for proc in procs:
                    proc.send({"op": "transfer", "bytes_per_link": per_link, "start_at": start_at})
                reports = wait_all(procs, "transferred", 120.0)
                errors = [e for r in reports for e in r["errors"]]
                if errors:
                    raise BenchError(f"raw TCP exchange failed: {errors[0]}")
                if rep:
                    out[size].append(span(reports, "started", "ended"))
        return out
    finally:
        close_processes(procs)


# --- ours ------------------------------------------------------------------------------


def measure_ours(
    plan: Plan,
    notes: list[str],
    placement: Placement = LOOPBACK,
    rates: list[float] | None = None,
) -> tuple[dict[tuple[str, str], Series], dict[tuple[str, str], Series]]:
    """Rounds with the group given (equal parts; with ``rates``, each member's link rate
    in bytes/s, their timeouts paced for those links as an averager would), then full
    ``Averager`` steps, one averager per codec across its steps; per (size, codec)."""
    from peers.testing import LocalSwarm, SwarmError

    rounds: dict[tuple[str, str], Series] = {}
    steps: dict[tuple[str, str], Series] = {}
    seed = secrets.randbelow(1 << 20)
    with LocalSwarm(startup_timeout=STARTUP_TIMEOUT) as swarm:
        try:
            members = swarm.start(
                plan.num_peers,
                target=OURS_TARGET,
                per_peer_options=[
                    {"listen": [f"/ip4/{placement.host(rank)}/tcp/0"]}
                    for rank in range(plan.num_peers)
                ],
                namespaces=[placement.namespace(rank) for rank in range(plan.num_peers)],
            )
        except SwarmError as e:
            raise BenchError(str(e)) from e
        wait_all(members, "serving", STARTUP_TIMEOUT)
        addresses = [[m.peer_id, m.maddr] for m in members]
        joined = False
        for size in plan.sizes:
            n = elements(size)
            for rank, member in enumerate(members):
                member.send(
                    {"op": "prepare", "elements": n, "seed": seed, "rank": rank,
                     "codecs": list(plan.codecs)}
                )  # fmt: skip
            prepared = wait_all(members, "prepared", PREPARE_TIMEOUT)
            for codec in plan.codecs:
                tolerance = 2 * 1.05 * max(r["bounds"][codec] for r in prepared) + BOUND_SLACK
                series = rounds[(size, codec)] = Series()
                for r in range(1 + plan.num_rounds):
                    command: dict[str, Any] = {
                        "op": "round",
                        "round_id": secrets.token_hex(16),
                        "members": addresses,
                        "codec": codec,
                        "start_at": time.monotonic() + START_DELAY,
                        "reducers_per_part": plan.reducers_per_part,
                        "rates": rates,
                        "connections_per_member": plan.connections_per_member,
                        "reverse_lane": plan.reverse_lane,
                    }
                    for member in members:
                        member.send(command)
                    reports = wait_all(members, "round", plan.round_wait + REPORT_GRACE)
                    check_round(reports, series, codec, tolerance, identical=True)
                    if r:
                        series.seconds.append(span(reports, "started", "ended"))
                        series.bytes_sent.append(median([x["bytes_sent"] for x in reports]))
                        series.cpu_seconds.append(median([x["cpu_seconds"] for x in reports]))
                        series.count_late(reports, command["start_at"])
                        series.add_memory(reports)
                seconds = median(series.seconds)
                print(f"  ours {size:>4} {codec:>8}: round {seconds:.3f} s", flush=True)
            if plan.num_step_rounds <= 0:
                continue
            if not joined:
                members[0].send({"op": "dht"})
                wait_all(members[:1], "joined", STARTUP_TIMEOUT)
                for member in members[1:]:
                    member.send({"op": "dht", "initial_peers": [members[0].maddr]})
                wait_all(members[1:], "joined", STARTUP_TIMEOUT)
                joined = True
            step_delay = STEP_START_DELAY + STEP_START_DELAY_PER_ELEMENT * n
            for codec in plan.codecs:
                series = steps[(size, codec)] = Series()
                for r in range(1 + plan.num_step_rounds):
                    command = {
                        "op": "step",
                        "codec": codec,
                        "prefix": f"bench{size}{codec}",
                        "key": f"{secrets.token_hex(8)}",
                        "num_members": plan.num_peers,
                        "gather_seconds": plan.matchmaking_seconds,
                        "timeout": plan.matchmaking_seconds + 30.0,
                        "start_at": time.monotonic() + step_delay,
                        "connections_per_member": plan.connections_per_member,
                        "reverse_lane": plan.reverse_lane,
                    }
                    for member in members:
                        member.send(command)
                    timeout = step_delay + plan.matchmaking_seconds + 30.0 + plan.round_wait
                    reports = wait_all(members, "step", timeout + REPORT_GRACE)
                    failed = [x["error"] for x in reports if "error" in x]
                    if failed:
                        series.failure = failed[0]
                        notes.append(f"ours full step {size} {codec} failed: {failed[0]}")
                        break
                    check_round(reports, series, codec, None, identical=True)
                    if r:
                        series.step_seconds.append(span(reports, "started", "ended"))
                        series.seconds.append(median([x["allreduce_seconds"] for x in reports]))
                        series.matchmaking_seconds.append(
                            median([x["matchmaking_seconds"] for x in reports])
                        )
                        series.cpu_seconds.append(median([x["cpu_seconds"] for x in reports]))
                        series.count_late(reports, command["start_at"])
                        series.add_memory(reports)
                        shares = reports[0]["shares"]
                        series.shares.append([shares[m.peer_id] for m in members])
                        series.measured.append([x["measured"] for x in reports])
                if series.step_seconds:
                    print(
                        f"  ours {size:>4} {codec:>8}: full step {median(series.step_seconds):.3f}"
                        f" s (matchmaking {median(series.matchmaking_seconds):.3f} s)",
                        flush=True,
                    )
    return rounds, steps


# --- hivemind --------------------------------------------------------------------------


def measure_hivemind(
    plan: Plan,
    notes: list[str],
    patch_8bit: bool,
    placement: Placement = LOOPBACK,
    bandwidths: list[float] | None = None,
) -> dict[tuple[str, str], Series]:
    """``DecentralizedAverager.step()`` per (size, codec); ``uint8_patched`` too when
    hivemind's stock 8-bit codec fails and ``patch_8bit``. ``bandwidths`` (by rank) go
    to its averagers' ``bandwidth``: hivemind sizes parts by what its user declares."""
    out: dict[tuple[str, str], Series] = {}
    seed = secrets.randbelow(1 << 20)
    first = JsonProcess(
        ["hivemind", json.dumps({"initial_peers": [], "host": placement.host(0)})],
        placement.namespace(0),
    )
    procs = [first]
    try:
        addrs = first.wait_report("joined", STARTUP_TIMEOUT)["addrs"][:1]
        if placement == LOOPBACK:
            procs += [
                JsonProcess(["hivemind", json.dumps({"initial_peers": addrs})])
                for _ in range(1, plan.num_peers)
            ]
            wait_all(procs[1:], "joined", STARTUP_TIMEOUT)
        else:
            # p2pd finds peers' addresses through go-libp2p's Kademlia DHT, which keeps
            # only public or private (LAN) addresses; the lab's 198.18.0.0/15 is neither
            # (reserved for benchmarks), so each peer is given every earlier one's.
            for r in range(1, plan.num_peers):
                options = {"initial_peers": addrs, "host": placement.host(r)}
                procs.append(JsonProcess(["hivemind", json.dumps(options)], placement.namespace(r)))
                addrs = addrs + procs[-1].wait_report("joined", STARTUP_TIMEOUT)["addrs"][:1]
        for proc in procs:
            proc.remember_tree()
        num_rounds = max(plan.num_rounds, plan.num_step_rounds)
        for size in plan.sizes:
            for rank, proc in enumerate(procs):
                proc.send({"op": "prepare", "elements": elements(size), "seed": seed, "rank": rank})
            wait_all(procs, "prepared", PREPARE_TIMEOUT)
            variants = [(c, False) for c in plan.codecs]
            while variants:
                codec, patched = variants.pop(0)
                label = f"{codec}_patched" if patched else codec
                series = out[(size, label)] = Series()
                for rank, proc in enumerate(procs):
                    proc.send(
                        {
                            "op": "averager",
                            "codec": codec,
                            "prefix": f"bench_{size}_{label}",
                            "num_members": plan.num_peers,
                            "matchmaking_seconds": plan.matchmaking_seconds,
                            "sender_timeout": SENDER_TIMEOUT,
                            "reducer_timeout": REDUCER_TIMEOUT,
                            "allreduce_timeout": ROUND_TIMEOUT,
                            "patch_8bit": patched,
                            "bandwidth": bandwidths[rank] if bandwidths else None,
                        }
                    )
                codec_errors = [
                    x["codec_error"] for x in wait_all(procs, "averager", STARTUP_TIMEOUT)
                ]
                for r in range(1 + num_rounds):
                    find_timeout = plan.matchmaking_seconds + 30.0
                    command: dict[str, Any] = {
                        "op": "step",
                        "num_members": plan.num_peers,
                        "timeout": find_timeout,
                        "start_at": time.monotonic() + START_DELAY,
                    }
                    for proc in procs:
                        proc.send(command)
                    timeout = START_DELAY + find_timeout + plan.round_wait + REPORT_GRACE
                    reports = wait_all(procs, "step", timeout)
                    failed = [x["error"] for x in reports if "error" in x]
                    if failed:
                        series.failure = failed[0]
                        notes.append(f"hivemind {size} {label} failed in round {r}: {failed[0]}")
                        print(f"  hivemind {size:>4} {label:>8}: FAILED: {failed[0]}", flush=True)
                        if codec == "uint8" and not patched and patch_8bit:
                            variants.insert(0, (codec, True))
                        break
                    check_round(reports, series, codec, None, identical=False)
                    if series.problems and not series.seconds:
                        # Wrong from the first round: say what hivemind logged, stop.
                        logged = [line for p in procs for line in p.drain_errors()]
                        logged = [
                            x.split("] ", 1)[-1].strip()[:200]
                            for x in logged
                            if any(w in x for w in ("[WARN]", "[ERROR]", "Error", "Exception"))
                        ]
                        series.failure = f"wrong result: {series.problems[0]}"
                        if logged:
                            series.failure += f"; hivemind logged: {'; '.join(sorted(set(logged)))}"
                        if any(codec_errors):
                            series.failure += (
                                f"; its codec alone raises: {next(e for e in codec_errors if e)}"
                            )
                        notes.append(f"hivemind {size} {label}: {series.failure}")
                        print(f"  hivemind {size:>4} {label:>8}: FAILED: {series.failure}")
                        if codec == "uint8" and not patched and patch_8bit:
                            variants.insert(0, (codec, True))
                        break
                    if r:
                        series.step_seconds.append(span(reports, "started", "ended"))
                        if r <= plan.num_rounds:
                            series.seconds.append(
                                span(reports, "allreduce_started", "allreduce_ended")
                            )
                        series.matchmaking_seconds.append(
                            median([x["allreduce_started"] - x["started"] for x in reports])
                        )
                        series.cpu_seconds.append(median([x["cpu_seconds"] for x in reports]))
                        series.count_late(reports, command["start_at"])
                        series.add_memory(reports)
                if series.seconds:
                    print(
                        f"  hivemind {size:>4} {label:>8}: all-reduce {median(series.seconds):.3f}"
                        f" s, step {median(series.step_seconds):.3f} s",
                        flush=True,
                    )
        return out
    finally:
        close_processes(procs)


# --- main ------------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def sizes_that_fit(plan: Plan, notes: list[str]) -> tuple[str, ...]:
    """The sizes whose estimated memory fits in what is available now; notes the rest."""
    available = available_memory_bytes()
    if available is None:
        return plan.sizes
    fit = []
    for size in plan.sizes:
        needed = plan.num_peers * MEMORY_PER_VECTOR * 4 * elements(size)
        if needed <= available:
            fit.append(size)
        else:
            notes.append(
                f"size {size} skipped: needs about {needed / 1e9:.1f} GB, {available / 1e9:.1f} GB"
                " available (--ignore-memory to run it anyway)"
            )
    return tuple(fit)


def fmt(value: float | None, pattern: str) -> str:
    """``value`` in ``pattern``, or ``-`` when there is none."""
    return "-" if value is None else pattern.format(value)


def _median(values: list[float]) -> float | None:
    return median(values) if values else None


@dataclass
class Results:
    """Everything measured, keyed by (size, codec label)."""

    plan: Plan
    raw: dict[str, list[float]]
    ours: dict[tuple[str, str], Series]
    ours_steps: dict[tuple[str, str], Series]
    theirs: dict[tuple[str, str], Series]

    def throughput(self, size: str) -> float:
        """Raw TCP bytes per second per peer (each way) at ``size``."""
        n = self.plan.num_peers
        return 2 * (n - 1) / n * 4 * elements(size) / median(self.raw[size])

    def bound_seconds(self, size: str, codec: str) -> float:
        n = self.plan.num_peers
        wire_bytes = elements(size) * WIRE_BYTES_PER_ELEMENT[codec]
        return 2 * (n - 1) / n * wire_bytes / self.throughput(size)

    def labels(self, size: str) -> list[str]:
        """Our codecs, plus ``uint8_patched`` where hivemind ran it."""
        extra = ["uint8_patched"] if (size, "uint8_patched") in self.theirs else []
        return list(self.plan.codecs) + extra


def summarize(
    results: Results, notes: list[str]
) -> tuple[dict[str, Any], dict[str, float], dict[str, str], list[tuple[str, list[list[str]]]]]:
    """Figures, ratios (> 1: ours better, except fractions of the bound), hivemind's
    failures, and the tables to print."""
    plan = results.plan
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    failures: dict[str, str] = {}
    head = ["size", "codec"]
    main_rows = [
        [*head, "ours s", "hivemind s", "ours MB/s", "hivemind MB/s", "bound s", "ours/bound",
         "hivemind/bound", "ours/f32 bound", "vs hivemind"]
    ]  # fmt: skip
    step_rows = [[*head, "ours s", "(matchmaking)", "hivemind s", "(matchmaking)", "vs hivemind"]]
    cpu_rows = [[*head, "ours round", "ours step", "hivemind step (tree)"]]
    memory_rows = [[*head, "ours", "hivemind (tree)"]]
    check_rows = [[*head, "ours max err", "ours rms rel", "hivemind max err", "hivemind rms rel"]]
    raw_rows = [["size", "bytes per peer each way", "seconds", "per-peer MB/s"]]
    for size in plan.sizes:
        n_bytes = 4 * elements(size)
        per_peer = 2 * (plan.num_peers - 1) / plan.num_peers * n_bytes
        figures[f"{size}_raw_seconds"] = round(median(results.raw[size]), 4)
        figures[f"{size}_raw_per_peer_MB_per_s"] = round(results.throughput(size) / MB, 1)
        raw_rows.append(
            [size, f"{per_peer / MB:.0f} MB", f"{median(results.raw[size]):.3f}",
             f"{results.throughput(size) / MB:.0f}"]
        )  # fmt: skip
        for label in results.labels(size):
            codec = label.removesuffix("_patched")
            key = f"{size}_{label}"
            mine = results.ours.get((size, label))  # None for uint8_patched
            mine_step = results.ours_steps.get((size, label))
            hers = results.theirs.get((size, label))
            bound_s = results.bound_seconds(size, codec)
            figures[f"{key}_bound_seconds"] = round(bound_s, 4)
            ours_ok = mine is not None and not mine.problems
            hers_ok = hers is not None and not hers.problems and not hers.failure
            if hers is not None and hers.failure:
                failures[key] = hers.failure
            for who, series in (("ours", mine), ("ours full step", mine_step), ("hivemind", hers)):
                if series is not None and series.problems and not series.failure:
                    notes.append(f"{who} {key} WRONG: {series.problems[0]}")
                if series is not None and series.num_late:
                    notes.append(
                        f"{who} {key}: a member started over {LATE_SECONDS} s late in"
                        f" {series.num_late} timed round(s) (loaded machine; time inflated)"
                    )

            ours_s = _median(mine.seconds) if mine else None
            hers_s = _median(hers.seconds) if hers and hers_ok else None
            if ours_s is not None:
                figures[f"{key}_round_seconds_ours"] = round(ours_s, 4)
                figures[f"{key}_MB_per_s_ours"] = round(n_bytes / ours_s / MB, 1)
                if mine and mine.bytes_sent:
                    figures[f"{key}_bytes_sent_per_peer_ours"] = int(median(mine.bytes_sent))
                if ours_ok:
                    ratios[f"{key}_fraction_of_bound"] = round(bound_s / ours_s, 3)
                    if codec != "none":  # the bound: N float32 bytes, any codec
                        ratios[f"{key}_fraction_of_float32_bound"] = round(
                            results.bound_seconds(size, "none") / ours_s, 3
                        )
            if hers_s is not None:
                figures[f"{key}_allreduce_seconds_hivemind"] = round(hers_s, 4)
                figures[f"{key}_MB_per_s_hivemind"] = round(n_bytes / hers_s / MB, 1)
                figures[f"{key}_fraction_of_bound_hivemind"] = round(bound_s / hers_s, 3)
            if ours_s is not None and hers_s is not None and ours_ok:
                ratios[f"{key}_throughput_vs_hivemind"] = round(hers_s / ours_s, 3)
            unpatched = results.ours.get((size, codec)) if label != codec else None
            if unpatched and unpatched.seconds and not unpatched.problems and hers_s:
                # hivemind's codec with its numpy-2 failure fixed, against our same codec.
                ratios[f"{key}_throughput_vs_hivemind"] = round(
                    hers_s / median(unpatched.seconds), 3
                )
            main_rows.append(
                [
                    size,
                    label,
                    fmt(ours_s, "{:.3f}"),
                    "FAILED" if hers is not None and hers.failure else fmt(hers_s, "{:.3f}"),
                    fmt(n_bytes / ours_s / MB if ours_s else None, "{:.0f}"),
                    fmt(n_bytes / hers_s / MB if hers_s else None, "{:.0f}"),
                    f"{bound_s:.3f}",
                    fmt(bound_s / ours_s if ours_s else None, "{:.2f}"),
                    fmt(bound_s / hers_s if hers_s else None, "{:.2f}"),
                    fmt(
                        results.bound_seconds(size, "none") / ours_s if ours_s else None,
                        "{:.2f}",
                    ),
                    fmt(ratios.get(f"{key}_throughput_vs_hivemind"), "{:.2f}x"),
                ]
            )

            ours_step = _median(mine_step.step_seconds) if mine_step else None
            hers_step = _median(hers.step_seconds) if hers and hers_ok else None
            if ours_step is not None:
                figures[f"{key}_step_seconds_ours"] = round(ours_step, 4)
            if hers_step is not None:
                figures[f"{key}_step_seconds_hivemind"] = round(hers_step, 4)
            if ours_step and hers_step and mine_step and not mine_step.problems:
                ratios[f"{key}_step_vs_hivemind"] = round(hers_step / ours_step, 3)
            step_rows.append(
                [
                    size,
                    label,
                    fmt(ours_step, "{:.3f}"),
                    fmt(_median(mine_step.matchmaking_seconds) if mine_step else None, "{:.3f}"),
                    fmt(hers_step, "{:.3f}"),
                    fmt(_median(hers.matchmaking_seconds) if hers_step and hers else None,
                         "{:.3f}"),
                    fmt(ratios.get(f"{key}_step_vs_hivemind"), "{:.2f}x"),
                ]
            )  # fmt: skip

            cpu = [
                _median(mine.cpu_seconds) if mine else None,
                _median(mine_step.cpu_seconds) if mine_step else None,
                _median(hers.cpu_seconds) if hers and hers_ok else None,
            ]
            for name, value in zip(("round_ours", "step_ours", "step_hivemind"), cpu, strict=True):
                if value is not None:
                    figures[f"{key}_cpu_seconds_per_peer_{name}"] = round(value, 3)
            cpu_rows.append([size, label, *(fmt(c, "{:.3f}") for c in cpu)])
            peaks = [
                max(mine.peak_rss_mb, mine_step.peak_rss_mb if mine_step else 0.0)
                if mine
                else None,
                hers.peak_rss_mb if hers and hers_ok else None,
            ]
            for name, value in zip(("ours", "hivemind"), peaks, strict=True):
                if value:
                    figures[f"{key}_peak_rss_MB_per_peer_{name}"] = round(value)
            memory_rows.append([size, label, *(fmt(p or None, "{:.0f}") for p in peaks)])
            check_rows.append(
                [
                    size,
                    label,
                    fmt(mine.max_error if mine else None, "{:.2e}"),
                    fmt(mine.rms_relative_error if mine else None, "{:.2e}"),
                    fmt(hers.max_error if hers and hers.seconds else None, "{:.2e}"),
                    fmt(hers.rms_relative_error if hers and hers.seconds else None, "{:.2e}"),
                ]
            )
    tables = [
        (f"raw TCP all-to-all, {plan.num_peers} processes (the limit), median of"
         f" {plan.num_bound_reps}", raw_rows),
        (f"the all-reduce itself, medians of {plan.num_rounds} rounds; MB/s = N bytes / seconds"
         " (MB = 10^6 bytes); bound = 2(n-1)/n x wire bytes / raw per-peer throughput;"
         " f32 bound = the same for N float32 bytes (the issue's, whatever the codec);"
         " vs hivemind = hivemind s / ours s", main_rows),
        (f"full step (matchmaking + all-reduce), medians of {plan.num_step_rounds};"
         f" min_matchmaking_time = gather_timeout = {plan.matchmaking_seconds} s", step_rows),
        ("CPU seconds per peer (user + system), medians", cpu_rows),
        ("peak RSS per peer so far (MB), largest member", memory_rows),
        ("errors against the true mean (sampled blocks; worst round)", check_rows),
    ]  # fmt: skip
    return figures, ratios, failures, tables


def with_counts(plan: Plan, args: argparse.Namespace) -> Plan:
    """``plan`` with the ``--codecs``, ``--rounds`` and ``--step-rounds`` given."""
    if args.codecs:
        plan = replace(plan, codecs=tuple(args.codecs.split(",")))
    if args.rounds is not None:
        plan = replace(plan, num_rounds=args.rounds)
    if args.step_rounds is not None:
        plan = replace(plan, num_step_rounds=args.step_rounds)
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4M elements, 2 rounds")
    parser.add_argument("--no-hivemind", action="store_true", help="measure ours only")
    parser.add_argument("--sizes", help="comma-separated sizes in elements, e.g. 16M,64M")
    parser.add_argument("--codecs", help="comma-separated: none,float16,uint8,blockwise8")
    parser.add_argument("--rounds", type=int, help="timed rounds per size and codec")
    parser.add_argument("--step-rounds", type=int, help="timed full steps (0: none of ours)")
    parser.add_argument("--matchmaking-seconds", type=float, help="min_matchmaking_time")
    parser.add_argument(
        "--reducers-per-part",
        type=int,
        choices=(1, 3),
        default=1,
        help="our rounds reduce each coordinate this many times (3: outvotes a lying reducer)",
    )
    parser.add_argument(
        "--no-patch", action="store_true", help="do not rerun hivemind's 8-bit codec patched"
    )
    parser.add_argument(
        "--ignore-memory", action="store_true", help="run sizes that may not fit in memory"
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.sizes:
        plan = replace(plan, sizes=tuple(args.sizes.split(",")))
    plan = with_counts(plan, args)
    if args.matchmaking_seconds is not None:
        plan = replace(plan, matchmaking_seconds=args.matchmaking_seconds)
    plan = replace(plan, reducers_per_part=args.reducers_per_part)

    notes: list[str] = []
    if not args.ignore_memory:
        plan = replace(plan, sizes=sizes_that_fit(plan, notes))
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        if not plan.sizes:
            print("no size fits in the memory available", file=sys.stderr)
            return 1
    version, why = (
        (None, "disabled with --no-hivemind") if args.no_hivemind else installed_hivemind()
    )
    if version is None:
        notes.append(f"hivemind not measured: {why}")
        print(f"hivemind: not measured: {why}", file=sys.stderr)
    mode = "quick" if args.quick else "full"
    load_before = os.getloadavg()[0]
    print(
        f"all-reduce benchmark ({mode}): {plan.num_peers} peer processes on 127.0.0.1, sizes"
        f" {', '.join(plan.sizes)} float32, codecs {', '.join(plan.codecs)}; {os.cpu_count()}"
        f" CPUs (load average {load_before:.1f}); hivemind {version or 'absent'}"
        + (
            f"; ours {plan.reducers_per_part} reducers per part"
            if plan.reducers_per_part > 1
            else ""
        ),
        flush=True,
    )
    began = time.monotonic()
    raw = measure_bound(plan)
    for size in plan.sizes:
        print(f"  raw TCP {size:>4}: {median(raw[size]):.3f} s", flush=True)
    phase_s = {"raw": time.monotonic() - began}
    ours, ours_steps = measure_ours(plan, notes)
    phase_s["ours"] = time.monotonic() - began - sum(phase_s.values())
    theirs: dict[tuple[str, str], Series] = {}
    if version:
        try:
            theirs = measure_hivemind(plan, notes, not args.no_patch)
        except BenchError as e:
            notes.append(f"hivemind failed; measured without it: {e}")
            print(f"hivemind failed: {e}", file=sys.stderr)
        phase_s["hivemind"] = time.monotonic() - began - sum(phase_s.values())
    total_s = time.monotonic() - began

    results = Results(plan=plan, raw=raw, ours=ours, ours_steps=ours_steps, theirs=theirs)
    figures, ratios, failures, tables = summarize(results, notes)
    for title, rows in tables:
        if len(rows) > 1:
            print_table(title, rows)
    for key, value in ratios.items():
        if key.endswith("_throughput_vs_hivemind"):
            verdict = "met" if value >= TARGET_VS_HIVEMIND else "NOT met"
            print(f"target {key} >= {TARGET_VS_HIVEMIND:g}x: {value:.2f}x, {verdict}")
        elif key.endswith("_fraction_of_bound"):
            verdict = "met" if value >= TARGET_FRACTION_OF_BOUND else "NOT met"
            print(f"target {key} >= {TARGET_FRACTION_OF_BOUND:g}: {value:.2f}, {verdict}")
    for note in notes:
        print(f"note: {note}")
    load_after = os.getloadavg()[0]
    print(
        f"total {total_s:.1f} s ("
        + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phase_s.items())
        + f"); 1-minute load average {load_before:.1f} -> {load_after:.1f}"
    )
    emit_result(
        "allreduce",
        figures,
        ratios,
        mode=mode,
        hivemind=version,
        hivemind_failures=failures,
        notes=notes,
        plan=asdict(plan),
        cpus=os.cpu_count(),
        load_average=[round(load_before, 1), round(load_after, 1)],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
