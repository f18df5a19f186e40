"""WAN benchmark: the all-reduce, the DHT, a remote expert and collaborative training on
emulated internet links, ours against hivemind, with the link bound beside both.

Each scenario builds a namespace lab (``peers.netlab``: real network namespaces, real
TCP, every link shaped by tbf and a userspace delay line) with one public host per
member, and runs in it the processes of ``bench_allreduce.py``, one after another:

1. raw TCP: the bytes a butterfly all-reduce moves, over plain sockets, every pair of
   members exchanging at once (what TCP itself gets from these links);
2. ours: butterfly rounds with the group given, then full ``Averager`` steps
   (matchmaking through our DHT, then the round);
3. hivemind 1.1.12: ``DecentralizedAverager.step()`` with its ``p2pd`` running inside
   the same namespaces; its all-reduce is timed inside its process.

Scenarios (``--scenarios``), every link 20 ms one way (80 ms round trip between two
members) unless said:

- ``equal``: 4 members on 100 Mbit/s links (each way); 64M elements;
- ``unequal``: links of 1000, 100, 100 and 20 Mbit/s; 8M elements (a first round with
  equal parts must fit the default timeouts: a newcomer has measured nothing). Ours: rounds with
  equal parts (the group given), then averager steps whose parts follow the rates the
  members measured in their previous step (the first, untimed, has equal parts); the
  part shares and the rates measured are reported. hivemind is told each link's true rate
  (its ``bandwidth`` argument: it sizes parts by what its user declares);
- ``lossy``: as ``equal``, with 1% of frames dropped on every link, each way (a frame
  between two members crosses two links);
- ``far2`` and ``far`` (long fat pipes): 2 and 4 members on 200 Mbit/s links, 50 ms one
  way (200 ms round trip); 16M elements.

In every scenario the averager steps' part shares and measured rates are in the JSON
figures (``..._part_shares_ours_each_step``): on equal links the parts should be equal.

Three more scenarios, every link 100 Mbit/s and 20 ms one way (80 ms round trip):

- ``dht``: 32 DHT peers (``--quick --scenarios dht``: 8, where a reader often holds a
  key's replica itself), one per host, both systems in turn in one lab:
  ``bench_dht.py``'s latency phase (a few peers in turn store keys one at a time, others
  get them) and its throughput phase. Medians in ms and in round trips; the target is a
  get's median within 2 round trips and 10%;
- ``expert``: ``bench_experts.py``'s FFN expert at batch 1, each system's server on one
  host and its client on another; forward (one call) and forward+backward (two calls).
  The bound is a round trip per call plus the local compute (the same module in the
  client's process; with our server's Linear kernels for ours); the target is a forward
  call within 1.2x of it;
- ``train``: collaborative training, 4 peers (one per host): per task (``digits``; with
  a full run also ``charlm``; ``--train-tasks`` chooses), at the recipe's global batch,
  the single-process baseline (``swarm.baseline``, in this process on one thread), then
  in one lab, one run after another: ours with gradient averaging (``swarm train
  --num-peers 4 --listen /ip4/0.0.0.0/tcp/0 --progress json --num-threads 1`` on the
  first host, the join command it prints on the others), hivemind's
  ``hivemind.Optimizer`` (``_hivemind_train.py``, mode ``gradient``), ours with DiLoCo
  (``--diloco H``) and hivemind's local updates (mode ``local``, parameters averaged
  every ``H`` global batches' samples). Per run: the slowest peer's training seconds,
  the schedule's global samples (epochs x the samples of an epoch) and the samples the
  peers computed (a hivemind epoch can hold up to 4x the global batch), both per
  second, the final test loss (and accuracy or bits/char) beside the single process's,
  whether it is within 5% of it, and the bytes sent (ours: in averaging rounds; both:
  every host's link). With a loss curve (``--train-eval-every N``; a full run: every 10
  global batches) the first peer of each run evaluates its model every N global
  batches, and the training seconds until its test loss first came within 5% of the
  single process's are compared (``..._time_to_loss_vs_hivemind``). Sizes
  (``--train-samples`` and ``--train-inner-steps`` override them): ``--quick`` digits
  for 8 global batches of 64, DiLoCo every 4 (about 3.5 minutes, start-ups included:
  not in the default quick list, run ``--quick --scenarios train``); a full run digits
  at its recipe (320 batches, DiLoCo every 10: 32 outer steps, as the loopback tests)
  and charlm for 100 batches of 32 (DiLoCo every 10).
  hivemind's epochs took from 1 to 8.5 s on these links from run to run (ours: 1 s), so
  a full train scenario takes from 20 minutes to an hour.

The link bound of an all-reduce scenario is what the links allow a butterfly all-reduce: a member
with part ``p`` of the vector moves ``N + (n-2) p`` values each way (its vector less its
part out, its part's average to the others; as much in), at its link rate less the
Ethernet, IP and TCP headers of full frames (1448 payload bytes in 1514), plus one round
trip (a value crosses to its reducer and back). With equal links that is equal parts;
with unequal ones, the parts that minimise the slowest member's time (a member on a
slow link reduces little or nothing), and the equal-parts bound is shown beside it. Loss
is not in it: a lossy link's bound is the loss-free one, and raw TCP (equal parts) shows
what loss costs TCP itself. Ours, against the bound and hivemind: the group-given round
on equal links, the averager's all-reduce (measured parts) on unequal ones.

Every round is checked against the true mean (as in ``bench_allreduce.py``); a wrong
result gets no ratio. The run ends with one JSON line; ratios are > 1 where ours is
better, ``*_fraction_of_link_bound`` (link bound seconds / our seconds) at most 1.

Targets (issue 18): the all-reduce at >= 0.8 of the link bound and >= 1.5x hivemind in
every scenario; on unequal links, measured parts faster than equal parts; in ``train``,
ours within 5% of the single process's test loss in both modes (with gradient
averaging, the same model by construction). The train ratios
(``train_{task}_{mode}_samples_per_second_vs_hivemind``: the schedule's samples per
second; ``..._loss_vs_hivemind``: hivemind's final test loss over ours;
``..._time_to_loss_vs_hivemind``: hivemind's training seconds to the single process's
loss over ours, with a loss curve; ``mode``
``diloco`` against hivemind's local updates) are measurements, not targets. Needs root
and nftables (the lab); without them it says why and exits 1.

    .venv/bin/python benchmarks/bench_wan.py --quick   # equal (4M) and expert, about 2 min
    .venv/bin/python benchmarks/bench_wan.py --quick --scenarios train   # digits, ~3.5 min
    .venv/bin/python benchmarks/bench_wan.py --scenarios train   # digits and charlm
    .venv/bin/python benchmarks/bench_wan.py           # every scenario, 64M (unequal: 8M)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
import bench_dht
import bench_experts
from _common import (
    MAX_LINES_PER_WAIT,
    BenchError,
    JsonChild,
    LineReader,
    Placement,
    emit_result,
    installed_hivemind,
    median,
    print_table,
    stop_popen_tree,
)
from bench_allreduce import (
    WIRE_BYTES_PER_ELEMENT,
    Plan,
    Results,
    Series,
    close_processes,
    elements,
    fmt,
    measure_bound,
    measure_hivemind,
    measure_ours,
    sizes_that_fit,
    summarize,
    with_counts,
)

from peers.netlab import Lab, NetlabError, PublicHost, lab_available

#: Payload bytes of a full TCP frame on the wire: 1448 (MSS with timestamps) of 1514
#: (Ethernet header, IP and TCP headers with options, payload); tbf counts whole frames.
TCP_PAYLOAD_SHARE = 1448 / 1514
#: Ratio targets from the issue.
TARGET_FRACTION_OF_LINK_BOUND = 0.8
TARGET_VS_HIVEMIND = 1.5


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """The links of one lab: one per member."""

    name: str
    rates_mbit: tuple[float, ...]
    """Each member's link rate, megabits per second, each way."""
    one_way_ms: float
    """Delay on every link, each way: two members are ``4 * one_way_ms`` apart, round trip."""
    loss: float = 0.0
    """Share of frames dropped on every link, each way."""
    full_sizes: tuple[str, ...] = ("64M",)
    """Vector sizes of a full run (``--quick``: 4M)."""

    @property
    def rtt_seconds(self) -> float:
        return 4 * self.one_way_ms / 1000

    @property
    def unequal(self) -> bool:
        return len(set(self.rates_mbit)) > 1

    def payload_rates(self) -> list[float]:
        """Each member's link rate in TCP payload bytes per second."""
        return [r * 1e6 / 8 * TCP_PAYLOAD_SHARE for r in self.rates_mbit]

    def describe(self) -> str:
        rate = (
            "/".join(f"{r:g}" for r in self.rates_mbit)
            if self.unequal
            else f"{self.rates_mbit[0]:g}"
        )
        rtt_ms = self.rtt_seconds * 1000
        text = f"{len(self.rates_mbit)} members, {rate} Mbit/s links, {rtt_ms:g} ms RTT"
        return text + (f", {self.loss:.0%} loss per link" if self.loss else "")

    def link_bound_seconds(self, num_elements: int, codec: str, *, equal_parts: bool) -> float:
        """Seconds the links allow a butterfly all-reduce of ``num_elements``: member
        ``i`` with part ``p_i`` moves ``N + (n-2) p_i`` values each way at its rate;
        with ``equal_parts`` every ``p_i`` is ``N/n``, else the parts that minimise the
        slowest member's time (water-filling). Plus one round trip."""
        n = len(self.rates_mbit)
        size = num_elements * WIRE_BYTES_PER_ELEMENT[codec]  # bytes of one vector
        rates = self.payload_rates()
        if equal_parts or n < 3:
            return max(size * (1 + (n - 2) / n) / r for r in rates) + self.rtt_seconds

        def parts_fit(seconds: float) -> bool:  # can parts summing to N all finish?
            return sum(max(0.0, (seconds * r - size) / (n - 2)) for r in rates) >= size

        low, high = max(size / r for r in rates), size * (n - 1) / min(rates)
        if parts_fit(low):
            return low + self.rtt_seconds
        for _ in range(100):
            middle = (low + high) / 2
            low, high = (low, middle) if parts_fit(middle) else (middle, high)
        return high + self.rtt_seconds


SCENARIOS = {
    "equal": Scenario(name="equal", rates_mbit=(100.0,) * 4, one_way_ms=20.0),
    "unequal": Scenario(
        name="unequal",
        rates_mbit=(1000.0, 100.0, 100.0, 20.0),
        one_way_ms=20.0,
        full_sizes=("8M",),
    ),
    "lossy": Scenario(name="lossy", rates_mbit=(100.0,) * 4, one_way_ms=20.0, loss=0.01),
    # Long fat pipes: 200 ms round trips at 200 Mbit/s hold 5 MB in flight, past what one
    # TCP connection's default window covers (Linux's tcp_rmem tops out at 6 MB of
    # buffer, about half of it window). Two members move each byte over one connection;
    # four spread their upload over three.
    "far2": Scenario(name="far2", rates_mbit=(200.0,) * 2, one_way_ms=50.0, full_sizes=("16M",)),
    "far": Scenario(name="far", rates_mbit=(200.0,) * 4, one_way_ms=50.0, full_sizes=("16M",)),
}

#: Every scenario's name: the all-reduce's and the DHT's.
ALL_SCENARIOS = (*SCENARIOS, "dht", "expert", "train")
QUICK_SCENARIOS = "equal,expert"

#: hivemind's ``min_matchmaking_time`` and our ``gather_timeout``, seconds. hivemind's
#: requests time out at half of it (bench_allreduce.py): its connection setup and
#: requests take several round trips, and at 1 s (the loopback benchmark's) its
#: matchmaking found no group at 80 ms.
MATCHMAKING_SECONDS = 3.0
#: Seconds the parent waits for one round before calling it hung: our averager paces a
#: round on slow links up to ``AllReduceConfig.max_round_timeout``.
ROUND_WAIT = 1800.0
FULL = Plan(
    sizes=("64M",),
    codecs=("none", "float16"),
    num_rounds=3,
    num_step_rounds=3,
    num_bound_reps=3,
    matchmaking_seconds=MATCHMAKING_SECONDS,
    round_wait=ROUND_WAIT,
)
#: One scenario (``equal`` unless ``--scenarios`` says), one codec, one timed round of
#: each kind: every process of a scenario starts afresh, and that is most of the time.
QUICK = replace(
    FULL, sizes=("4M",), codecs=("none",), num_rounds=1, num_step_rounds=1, num_bound_reps=1
)


def run_scenario(
    scenario: Scenario,
    plan: Plan,
    hivemind: str | None,
    notes: list[str],
    *,
    slow_start_after_idle: bool = True,
    congestion_control: str | None = None,
) -> Results:
    """Build the scenario's lab, measure raw TCP, ours and hivemind in it, tear it down.
    ``slow_start_after_idle=False`` sets Linux's ``tcp_slow_start_after_idle`` to 0 in
    every member's namespace (TCP keeps its window across idle gaps);
    ``congestion_control`` sets the namespaces' TCP congestion control (``bbr``), for
    raw TCP, ours and hivemind alike."""
    print(f"\n== {scenario.name}: {scenario.describe()}", flush=True)
    rates = scenario.payload_rates()
    with Lab() as lab:
        hosts = [
            lab.add_public_host(f"m{rank}", rate_mbit=rate)
            for rank, rate in enumerate(scenario.rates_mbit)
        ]
        for rank, host in enumerate(hosts):
            lab.delay(host, one_way_ms=scenario.one_way_ms, loss=scenario.loss, seed=rank)
            if not slow_start_after_idle:
                sysctl = "net.ipv4.tcp_slow_start_after_idle=0"
                host.run(["sysctl", "-q", "-w", sysctl], timeout=10)
            if congestion_control is not None:
                sysctl = f"net.ipv4.tcp_congestion_control={congestion_control}"
                host.run(["sysctl", "-q", "-w", sysctl], timeout=10)
        placement = Placement(
            namespaces=tuple(h.namespace for h in hosts), hosts=tuple(h.address for h in hosts)
        )
        raw = measure_bound(plan, placement)
        for size in plan.sizes:
            print(f"  raw TCP {size:>4}: {median(raw[size]):.3f} s", flush=True)
        ours, ours_steps = measure_ours(plan, notes, placement, rates)
        theirs: dict[tuple[str, str], Series] = {}
        if hivemind:
            try:
                theirs = measure_hivemind(plan, notes, False, placement, rates)
            except BenchError as e:
                notes.append(f"{scenario.name}: hivemind failed; measured without it: {e}")
                print(f"  hivemind failed: {e}", file=sys.stderr)
    return Results(plan=plan, raw=raw, ours=ours, ours_steps=ours_steps, theirs=theirs)


@dataclass(frozen=True, kw_only=True)
class AlikeLinks:
    """A lab of public hosts with one link shape: ``rate_mbit`` and ``one_way_ms`` each
    way on every host's link (the DHT and expert scenarios)."""

    name: str
    rate_mbit: float = 100.0
    one_way_ms: float = 20.0

    @property
    def rtt_seconds(self) -> float:
        return 4 * self.one_way_ms / 1000

    def links(self) -> str:
        return f"{self.rate_mbit:g} Mbit/s links, {self.rtt_seconds * 1000:g} ms RTT"

    def hosts(self, lab: Lab, names: list[str]) -> tuple[list[PublicHost], Placement]:
        """A shaped host per name, and the placement of rank i on the i-th."""
        hosts = [lab.add_public_host(name, rate_mbit=self.rate_mbit) for name in names]
        for i, host in enumerate(hosts):
            lab.delay(host, one_way_ms=self.one_way_ms, seed=i)
        placement = Placement(
            namespaces=tuple(h.namespace for h in hosts), hosts=tuple(h.address for h in hosts)
        )
        return hosts, placement


def describe_dht(scenario: AlikeLinks, plan: bench_dht.Plan) -> str:
    return f"{plan.num_peers} DHT peers, {scenario.links()}"


def describe_expert(scenario: AlikeLinks) -> str:
    return f"one expert server and one client, {scenario.links()}"


DHT_SCENARIO = AlikeLinks(name="dht")
#: bench_dht's phases at WAN speed: fewer timed ops (each is a few round trips).
DHT_FULL = replace(
    bench_dht.FULL, num_reps=1, num_latency_ops=40, num_warmup_ops=10, num_load_ops=10
)
DHT_QUICK = replace(DHT_FULL, num_peers=8, num_latency_ops=15, num_warmup_ops=5, num_load_peers=4)
#: Milliseconds under which a get was served from the reader's own replica: far under
#: a round trip. Ours answers a first-live-value get from it (hivemind asks the network
#: anyway), so in a swarm of few more peers than replicas such a ratio means nothing.
LOCAL_HIT_MS = 1.0
#: The DHT target (issue 18): a get's median within two round trips and 10%.
TARGET_DHT_GET_ROUND_TRIPS = 2.2


def run_dht_scenario(
    scenario: AlikeLinks,
    plan: bench_dht.Plan,
    hivemind: str | None,
    notes: list[str],
    figures: dict[str, Any],
    ratios: dict[str, float],
) -> list[list[str]]:
    """Both systems' DHT swarms, one after the other, in one lab of ``plan.num_peers``
    hosts: bench_dht's latency and throughput phases. Figures and ratios (``dht_...``)
    are added in place; returns the table's rows."""
    print(f"\n== {scenario.name}: {describe_dht(scenario, plan)}", flush=True)
    results: dict[str, bench_dht.RepResult] = {}
    with Lab() as lab:
        _, placement = scenario.hosts(lab, [f"d{i}" for i in range(plan.num_peers)])
        for system in ("ours", "hivemind") if hivemind else ("ours",):
            try:
                result = bench_dht.run_rep(system, plan, 0, placement)
            except BenchError as e:
                if system == "ours":
                    raise
                notes.append(f"{scenario.name}: hivemind failed; measured without it: {e}")
                print(f"  hivemind failed: {e}", file=sys.stderr)
                continue
            results[system] = result
            notes.extend(f"{scenario.name} {system}: {e}" for e in result.errors)
            if result.bad_ops:
                notes.append(f"{scenario.name} {system}: failed ops {dict(result.bad_ops)}")
    summary = {system: bench_dht.summarize([r]) for system, r in results.items()}
    rtt_ms = scenario.rtt_seconds * 1000
    rows = [["measurement", "ours", "hivemind", "ours in RTTs", "hivemind in RTTs", "vs hivemind"]]
    for kind, label in (("store", "store"), ("get", "get"), ("get_latest", "get, freshest")):
        for q in (50, 95):
            name = f"{kind}_p{q}_ms"
            mine = summary.get("ours", {}).get(name)
            hers = summary.get("hivemind", {}).get(name)
            for system, value in (("ours", mine), ("hivemind", hers)):
                if value is not None:
                    figures[f"{scenario.name}_{name}_{system}"] = round(value, 2)
                    figures[f"{scenario.name}_{kind}_p{q}_round_trips_{system}"] = round(
                        value / rtt_ms, 3
                    )
            if mine is not None and mine < LOCAL_HIT_MS:
                notes.append(
                    f"{scenario.name}: our {kind} p{q} is {mine:.3f} ms, a replica the reader"
                    " holds itself (a small swarm: 8 replicas); no ratio for it"
                )
            elif mine and hers:
                ratios[f"{scenario.name}_{kind}_p{q}_vs_hivemind"] = round(hers / mine, 3)
            rows.append(
                [
                    f"{label} p{q} (ms)",
                    fmt(mine, "{:.1f}"),
                    fmt(hers, "{:.1f}"),
                    fmt(mine / rtt_ms if mine else None, "{:.2f}"),
                    fmt(hers / rtt_ms if hers else None, "{:.2f}"),
                    fmt(hers / mine if mine and hers else None, "{:.2f}x"),
                ]
            )
    for name, label in (("ops_per_s", "store+get ops/s, concurrent"),):
        mine = summary.get("ours", {}).get(name)
        hers = summary.get("hivemind", {}).get(name)
        for system, value in (("ours", mine), ("hivemind", hers)):
            if value is not None:
                figures[f"{scenario.name}_{name}_{system}"] = round(value, 1)
        if mine and hers:
            ratios[f"{scenario.name}_{name}_vs_hivemind"] = round(mine / hers, 3)
        rows.append(
            [label, fmt(mine, "{:.0f}"), fmt(hers, "{:.0f}"), "", "",
             fmt(mine / hers if mine and hers else None, "{:.2f}x")]
        )  # fmt: skip
    return rows


EXPERT_SCENARIO = AlikeLinks(name="expert")
#: bench_experts' FFN expert at batch 1 (a call's bytes are 4 KB each way: latency only).
EXPERT_FULL = bench_experts.Plan(batches=(1,), calls={1: 60}, warmup={1: 5}, num_reps=2)
EXPERT_QUICK = bench_experts.Plan(batches=(1,), calls={1: 15}, warmup={1: 3}, num_reps=1)
#: The expert target (issue 18): a call within 1.2x of one round trip plus the local compute.
TARGET_EXPERT_OVER_BOUND = 1.2
#: Remote calls per measured operation in both systems: a forward; a forward, then a
#: backward (the server recomputes the forward). Each costs a round trip at least.
CALLS_PER_MODE = {"forward": 1, "forward_backward": 2}


#: Bytes each way of the plain-TCP echo beside the expert: about one forward call's at
#: batch 1 (1024 float32 values, plus framing).
ECHO_BYTES = 4200
#: Echoes timed (after 5 untimed), back to back as the calls are.
ECHO_ROUNDS = 40
ECHO_SERVER = """
import socket, sys
server = socket.create_server(("0.0.0.0", 7000))
server.settimeout(60)
print("up", flush=True)
conn, _ = server.accept()
conn.settimeout(60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
size = int(sys.argv[1])
for _ in range(10_000):
    got = b""
    while len(got) < size:
        data = conn.recv(65536)
        if not data:
            raise SystemExit(0)
        got += data
    conn.sendall(got)
"""
ECHO_CLIENT = """
import socket, statistics, sys, time
size, rounds = int(sys.argv[2]), int(sys.argv[3])
conn = socket.create_connection((sys.argv[1], 7000), timeout=60)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
seconds = []
for _ in range(5 + rounds):
    began = time.perf_counter()
    conn.sendall(b"x" * size)
    got = 0
    while got < size:
        got += len(conn.recv(65536))
    seconds.append(time.perf_counter() - began)
print(statistics.median(seconds[5:]))
"""


def raw_echo_seconds(server: PublicHost, client: PublicHost) -> float:
    """The median round trip of ``ECHO_BYTES`` each way over plain TCP, client to server:
    the lab's own floor for a call's bytes (tbf, the delay lines, TCP)."""
    listener = server.popen(
        [sys.executable, "-c", ECHO_SERVER, str(ECHO_BYTES)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout is not None
        if listener.stdout.readline().strip() != "up":
            raise BenchError("the echo server did not start")
        done = client.run(
            [sys.executable, "-c", ECHO_CLIENT, server.address, str(ECHO_BYTES), str(ECHO_ROUNDS)],
            timeout=120,
        )
        return float(done.stdout.split()[0])
    finally:
        listener.kill()
        listener.wait()


def run_expert_scenario(
    scenario: AlikeLinks,
    plan: bench_experts.Plan,
    hivemind: str | None,
    notes: list[str],
    figures: dict[str, Any],
    ratios: dict[str, float],
) -> list[list[str]]:
    """bench_experts' latency measurement with each system's server on one host and its
    client on another (the local module: the compute without a network), after a plain
    TCP echo of a call's bytes between the two hosts. The bound is a round trip per
    remote call (one for a forward, two for a forward and backward) plus the local
    compute (with our server's kernels for ours,
    where they differ from torch's). Figures and ratios (``expert_...``) are added in
    place; returns the table's rows."""
    print(f"\n== {scenario.name}: {describe_expert(scenario)}", flush=True)
    with Lab() as lab:
        hosts, placement = scenario.hosts(lab, ["server", "client"])
        echo = raw_echo_seconds(hosts[0], hosts[1])
        print(f"  plain TCP echo of {ECHO_BYTES} bytes each way: {echo * 1e3:.1f} ms", flush=True)
        figures[f"{scenario.name}_raw_tcp_echo_ms"] = round(echo * 1e3, 2)
        systems = [s for s in bench_experts.SYSTEMS if s != "hivemind" or hivemind]
        results, used = bench_experts.measure(
            plan, systems, notes, fused=True, kernels="auto", placement=placement
        )
    rows = [
        ["batch 1", "ours ms", "hivemind ms", "local ms", "ours: RTTs above local",
         "hivemind: RTTs above local", "ours/bound", "ours/echo bound", "vs hivemind"]
    ]  # fmt: skip
    for mode in bench_experts.MODES:
        values = {
            system: median(results[(system, mode, 1)])
            for system in bench_experts.SYSTEMS
            if results.get((system, mode, 1))
        }
        mine, hers, local = values.get("ours"), values.get("hivemind"), values.get("local")
        our_local = values.get("local_server_kernels", local)  # our server's compute
        key = f"{scenario.name}_{mode}_b1"
        rtt = scenario.rtt_seconds
        network = rtt * CALLS_PER_MODE[mode]  # a round trip per call
        for system, value in values.items():
            figures[f"{key}_ms_{system}"] = round(value * 1e3, 3)
        if mine is not None and our_local is not None:
            figures[f"{key}_round_trips_above_local_ours"] = round((mine - our_local) / rtt, 3)
            ratios[f"{key}_fraction_of_bound"] = round((network + our_local) / mine, 3)
            echo_bound = echo * CALLS_PER_MODE[mode] + our_local
            ratios[f"{key}_fraction_of_echo_bound"] = round(echo_bound / mine, 3)
        if hers is not None and local is not None:
            figures[f"{key}_round_trips_above_local_hivemind"] = round((hers - local) / rtt, 3)
        if mine and hers:
            ratios[f"{key}_latency_vs_hivemind"] = round(hers / mine, 3)
        rows.append(
            [
                "fwd" if mode == "forward" else "fwd+bwd",
                fmt(mine * 1e3 if mine else None, "{:.1f}"),
                fmt(hers * 1e3 if hers else None, "{:.1f}"),
                fmt(local * 1e3 if local else None, "{:.1f}"),
                fmt((mine - our_local) / rtt if mine and our_local else None, "{:.2f}"),
                fmt((hers - local) / rtt if hers and local else None, "{:.2f}"),
                fmt((network + our_local) / mine if mine and our_local else None, "{:.2f}"),
                fmt(
                    (echo * CALLS_PER_MODE[mode] + our_local) / mine
                    if mine and our_local
                    else None,
                    "{:.2f}",
                ),
                fmt(hers / mine if mine and hers else None, "{:.2f}x"),
            ]
        )
    figures[f"{scenario.name}_linear_kernels_ours"] = used
    return rows


# --- collaborative training -----------------------------------------------------------

TRAIN_SCENARIO = AlikeLinks(name="train")
#: Peers of every training run, one per host.
TRAIN_PEERS = 4
#: The training modes, ours and hivemind's counterpart: our gradient averaging against
#: ``hivemind.Optimizer`` (hivemind's default), our DiLoCo against its local updates.
#: ``diloco-overlap`` (``--diloco-overlap``: each round runs during the next inner steps)
#: has no hivemind counterpart: it is measured against our plain DiLoCo.
TRAIN_MODES = ("gradient", "diloco", "diloco-overlap")
HIVEMIND_MODE = {"gradient": "gradient", "diloco": "local"}
#: A run whose final test loss is within this share of the single process's reached it.
TRAIN_LOSS_TOLERANCE = 0.05
#: Peers whose final test losses differ by more than this share ended with different
#: models (a note says so).
PEER_LOSS_TOLERANCE = 0.01
#: Seconds to wait for a trainer's join command, or a hivemind peer's ``joined`` and
#: ``ready`` (it imports torch and starts p2pd; every earlier peer must be up).
TRAIN_START_TIMEOUT = 180.0
#: Seconds a run's peers get to close by themselves once it has ended (hivemind's shut
#: down its optimizer and DHT), before they are stopped by PID.
TRAIN_CLOSE_SECONDS = 15.0
SWARM_CLI = [sys.executable, "-m", "swarm.cli"]
HIVEMIND_TRAIN_FILE = Path(__file__).resolve().parent / "_hivemind_train.py"


#: Seconds a run may take per global batch of its schedule before it is called hung:
#: hivemind took 1 to 8.5 s an epoch here (gradient mode; ours 1 s), and a run is
#: also given ``TRAIN_WAIT_BASE_SECONDS``.
TRAIN_WAIT_PER_BATCH_SECONDS = 20.0
TRAIN_WAIT_BASE_SECONDS = 120.0


@dataclass(frozen=True, kw_only=True)
class TrainTask:
    """One task's runs: every system and mode trains ``num_samples`` global samples at
    the recipe's global batch (``batch_size``); DiLoCo (and hivemind's local updates)
    synchronise every ``inner_steps`` global batches."""

    task: str
    batch_size: int
    """The task recipe's global batch (checked against the recipe when it runs)."""
    num_samples: int
    inner_steps: int
    outer_momentum: float | None = None
    """Our DiLoCo's outer momentum (None: ``DiLoCoConfig``'s, the paper's 0.9)."""
    eval_every: int = 0
    """A loss curve: the first peer of every run evaluates the model every this many
    global batches (in DiLoCo and local modes, every ``eval_every // inner_steps``
    epochs, at least 1) and at the end; 0: the final model only."""

    def __post_init__(self) -> None:
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.batch_size < 1 or self.inner_steps < 1:
            raise ValueError(f"batch_size and inner_steps must be >= 1 in {self}")
        if self.num_samples < self.batch_size * self.inner_steps:
            raise ValueError(
                f"num_samples must be at least one DiLoCo period, {self.inner_steps} global"
                f" batches of {self.batch_size} ({self.batch_size * self.inner_steps})"
                f" for {self.task}; got {self.num_samples}"
            )

    def eval_epochs(self, mode: str) -> int:
        """``eval_every`` in the epochs of ``mode`` (0: no curve)."""
        if not self.eval_every:
            return 0
        return (
            self.eval_every if mode == "gradient" else max(1, self.eval_every // self.inner_steps)
        )

    @property
    def wait_seconds(self) -> float:
        """Seconds from a run's start until every peer must have reported its result."""
        batches = self.num_samples / self.batch_size
        return TRAIN_WAIT_BASE_SECONDS + TRAIN_WAIT_PER_BATCH_SECONDS * batches


#: ``--quick``: digits for 8 global batches of 64 (512 samples; DiLoCo every 4, 2 outer
#: steps): each system's start-up (half a minute for ours, more for hivemind's four
#: peers started one after another) and hivemind's epochs (1 to 8.5 s each, ours 1 s)
#: make the four runs 3 to 3.5 minutes; enough to see both systems work and what a
#: step costs, not to reach a loss. charlm (with ``--train-tasks``) likewise.
TRAIN_QUICK = {
    "digits": TrainTask(task="digits", batch_size=64, num_samples=64 * 8, inner_steps=4),
    "charlm": TrainTask(task="charlm", batch_size=32, num_samples=32 * 8, inner_steps=4),
}
TRAIN_QUICK_TASKS = ("digits",)
#: A full run: digits at its recipe (320 global batches of 64; DiLoCo every 10, 32 outer
#: steps, as the loopback tests use); charlm for 100 global batches of 32 (an eighth of
#: its recipe) with DiLoCo every 10 (10 outer steps). hivemind's epochs make it long:
#: 20 minutes to an hour, most of it hivemind's gradient runs (``--train-samples``
#: shortens it).
TRAIN_FULL = {
    "digits": TrainTask(
        task="digits", batch_size=64, num_samples=20_480, inner_steps=10, eval_every=10
    ),
    "charlm": TrainTask(
        task="charlm", batch_size=32, num_samples=32 * 100, inner_steps=10, eval_every=10
    ),
}
TRAIN_FULL_TASKS = ("digits", "charlm")


@dataclass(kw_only=True)
class TrainRun:
    """One run of one system in one mode, as its peers reported it."""

    system: str
    mode: str
    failure: str | None = None
    epochs: int = 0
    schedule_samples: int = 0
    """Global samples of the run's schedule: epochs x the samples of an epoch (the
    global batch, times ``inner_steps`` in DiLoCo and local modes)."""
    computed_samples: int = 0
    """Samples the peers computed, summed: hivemind's epochs hold more (its docstring)."""
    train_seconds: float = 0.0
    """The slowest peer's, from its first step to its last."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The first peer's final test metrics."""
    peer_losses: list[float] = field(default_factory=list)
    """Each peer's final test loss, by rank (one model: all equal, or nearly)."""
    peer_seconds: list[float] = field(default_factory=list)
    """Each peer's training seconds, by rank (``train_seconds`` is their largest)."""
    final_sync_seconds: list[float] = field(default_factory=list)
    """hivemind: each peer's wait for its last background round, by rank (in its
    training seconds)."""
    bytes_sent: int | None = None
    """Bytes the peers sent in averaging rounds, summed (ours: its statistics)."""
    wire_bytes: int | None = None
    """Bytes every host sent on its link during the run (all traffic, TCP/IP included):
    ours from once every peer is started, hivemind's from once every peer is ready,
    until every peer reported its result."""
    phases: dict[str, float] = field(default_factory=dict)
    """Ours: where an epoch's time went, seconds per epoch averaged over the peers
    (``wait``: for the others' samples; ``matchmaking``; ``allreduce``)."""
    curve: list[tuple[float, int, float]] = field(default_factory=list)
    """With ``TrainTask.eval_every``: the first peer's (seconds of training, evaluations
    left out; epochs; test loss), ending with the final model."""
    eval_seconds: float = 0.0
    """What the first peer spent evaluating (left out of ``train_seconds``)."""

    def seconds_to(self, loss: float) -> float | None:
        """Training seconds until the curve first reached ``loss``; None if it did not."""
        return next((seconds for seconds, _, value in self.curve if value <= loss), None)

    @property
    def ok(self) -> bool:
        return self.failure is None and self.train_seconds > 0


#: What the train scenario's figures mean beside hivemind (notes of every run with it).
TRAIN_NOTES = (
    "hivemind gradient is hivemind.Optimizer's default (use_local_updates=False): gradients"
    " all-reduced each epoch as ours, plus a background round averaging the parameters"
    " every epoch (average_state_every=1) that ours does not take",
    "hivemind local is use_local_updates=True, parameters averaged each time the swarm has"
    " processed H global batches: DiLoCo with an outer SGD at learning rate 1 and no"
    " momentum (ours: Nesterov, 0.7 and 0.9), H counted in the swarm's samples, not in"
    " local steps; both send parameter changes as float16",
    "a hivemind epoch ends when a peer sees the swarm's samples reach the global batch, so"
    " its peers may each compute a whole one per epoch (computed samples up to 4x the"
    " schedule's: a bigger batch, not a longer run)",
    "samples_per_second_vs_hivemind compares the schedule's samples (epochs x the global"
    " batch, times H in DiLoCo/local) per second of the slowest peer: progress through the"
    " same number of optimizer steps; computed samples/s are figures beside it",
    "loss_vs_hivemind is hivemind's final test loss over ours (the first peer's model);"
    " with a loss curve (--train-eval-every, on by default in a full run), the first peer"
    " of each run evaluates its model every N global batches, and time_to_loss_vs_hivemind"
    " compares the training seconds (evaluations left out) until each first came within"
    " 5% of the single process's final test loss",
)


def host_tx_bytes(hosts: list[PublicHost]) -> int | None:
    """Bytes the hosts have sent on their links so far (``/proc/net/dev`` of each
    namespace, every interface but loopback); ``None`` if it cannot be read."""
    total = 0
    try:
        for host in hosts:
            lines = host.run(["cat", "/proc/net/dev"], timeout=30).stdout.splitlines()
            for line in lines[2:]:
                name, _, counters = line.partition(":")
                if name.strip() != "lo":
                    total += int(counters.split()[8])  # transmit bytes
    except (NetlabError, OSError, ValueError, IndexError):
        return None
    return total


def _difference(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def _stderr_tail(reader: LineReader) -> str:
    with contextlib.suppress(BenchError):
        for _ in range(MAX_LINES_PER_WAIT):
            reader.next_line(time.monotonic())
    return " | ".join(reader.tail[-5:]) or "(none)"


def _next_event(
    out: LineReader,
    err: LineReader,
    event: str,
    deadline: float,
    name: str,
    evals: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The next JSON line of ``event`` a ``swarm train --progress json`` printed; the
    ``eval`` events on the way are added to ``evals`` (when given)."""
    for _ in range(MAX_LINES_PER_WAIT):
        try:
            _, line = out.next_line(deadline)
        except BenchError as e:
            raise BenchError(f"{name}: no {event!r}: {e}; stderr: {_stderr_tail(err)}") from None
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                record: dict[str, Any] = json.loads(line)
                if record.get("event") == event:
                    return record
                if evals is not None and record.get("event") == "eval":
                    evals.append(record)
    raise BenchError(f"{name} printed too much without {event!r}")


def run_ours_training(hosts: list[PublicHost], plan: TrainTask, mode: str) -> TrainRun:
    """``swarm train`` on the first host, its join command on the others; the run's
    result events, summed up. Every process is stopped by PID at the end."""
    run = TrainRun(system="ours", mode=mode)
    flags = ["--progress", "json", "--num-threads", "1", "--stop-when-stdin-closes"]
    argv = [
        *SWARM_CLI, "train", "--task", plan.task, "--num-peers", str(len(hosts)),
        "--listen", "/ip4/0.0.0.0/tcp/0", "--num-samples", str(plan.num_samples),
        "--run-id", f"bench-{plan.task}-{mode}-{secrets.token_hex(4)}", *flags,
    ]  # fmt: skip
    if mode.startswith("diloco"):
        argv += ["--diloco", str(plan.inner_steps)]
        if plan.outer_momentum is not None:
            argv += ["--outer-momentum", str(plan.outer_momentum)]
    if mode == "diloco-overlap":
        argv.append("--diloco-overlap")
    if plan.eval_every:  # the first peer's alone (the join command does not carry it)
        argv += ["--eval-every", str(plan.eval_epochs(mode))]
    procs: list[subprocess.Popen[str]] = []
    readers: list[tuple[LineReader, LineReader]] = []

    def start(host: PublicHost, command: list[str]) -> None:
        kwargs: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        proc = host.popen(command, stdin=subprocess.PIPE, text=True, **kwargs)
        procs.append(proc)
        readers.append((LineReader(proc.stdout), LineReader(proc.stderr)))

    try:
        start(hosts[0], argv)
        deadline = time.monotonic() + TRAIN_START_TIMEOUT
        join: list[str] = []
        while not join:
            text = str(_next_event(*readers[0], "message", deadline, "swarm train")["text"])
            if " join --initial-peers " in f" {text.strip()} ":
                join = text.strip().split()
        join = join[join.index("join") :]
        for host in hosts[1:]:
            start(host, [*SWARM_CLI, *join, *flags])
        deadline = time.monotonic() + plan.wait_seconds
        wire_before = host_tx_bytes(hosts)
        evals: list[dict[str, Any]] = []
        results = [
            _next_event(
                out, err, "result", deadline, f"ours peer {rank}", evals if rank == 0 else None
            )
            for rank, (out, err) in enumerate(readers)
        ]
        run.wire_bytes = _difference(host_tx_bytes(hosts), wire_before)
    except BenchError as e:
        run.failure = str(e)
        return run
    finally:
        for proc in procs:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
        for proc in procs:
            stop_popen_tree(proc)
    run.epochs = min(int(r["epochs"]) for r in results)
    run.schedule_samples = min(int(r["global_samples"]) for r in results)
    run.computed_samples = sum(int(r["statistics"]["local_samples"]) for r in results)
    run.peer_seconds = [float(r["train_seconds"]) for r in results]
    run.train_seconds = max(run.peer_seconds)
    run.metrics = dict(results[0]["metrics"])
    run.peer_losses = [float(r["metrics"]["loss"]) for r in results]
    run.bytes_sent = sum(int(r["statistics"]["bytes_sent"]) for r in results)
    run.curve = [
        (float(e["train_seconds"]), int(e["epoch"]), float(e["metrics"]["loss"])) for e in evals
    ]
    run.eval_seconds = float(results[0].get("eval_seconds", 0.0))
    if run.epochs:
        run.phases = {
            phase: sum(float(r["statistics"][f"{phase}_seconds"]) for r in results)
            / len(results)
            / run.epochs
            for phase in STEP_PHASES
        }
    return run


#: Where an epoch of ours goes (``OptimizerStatistics``' ``{phase}_seconds``; with
#: overlap, matchmaking and all-reduce run during the inner steps, and ``late_round`` is
#: what the training loop waited for a round at the next outer step).
STEP_PHASES = ("wait", "matchmaking", "allreduce", "late_round")


def close_children(children: list[JsonChild]) -> None:
    """Close each child's stdin (a hivemind peer then shuts hivemind down), give them
    ``TRAIN_CLOSE_SECONDS``, then stop what is left of them and what they started, by PID."""
    for child in children:
        child.remember_tree()
        with contextlib.suppress(OSError):
            if child.popen.stdin is not None:
                child.popen.stdin.close()
    deadline = time.monotonic() + TRAIN_CLOSE_SECONDS
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(max(0.1, deadline - time.monotonic()))
    close_processes(children)


def run_hivemind_training(hosts: list[PublicHost], plan: TrainTask, mode: str) -> TrainRun:
    """A ``_hivemind_train.py`` peer per host, started one after another (each given
    every earlier peer's addresses), then trained from one moment on; summed up as ours."""
    run = TrainRun(system="hivemind", mode=mode)
    local = mode == "diloco"
    base: dict[str, Any] = {
        "task": plan.task,
        "mode": HIVEMIND_MODE[mode],
        "num_peers": len(hosts),
        "num_samples": plan.num_samples,
        "inner_steps": plan.inner_steps if local else 1,
        # As ours: gradients in float32, DiLoCo's parameter changes in float16.
        "compression": "float16" if local else "none",
        "run_id": f"bench_{plan.task}_{mode}_{secrets.token_hex(4)}",
        "join_timeout": TRAIN_START_TIMEOUT,
        "peers_timeout": TRAIN_START_TIMEOUT,
        "command_timeout": TRAIN_START_TIMEOUT * len(hosts) + 60,
        "train_timeout": plan.wait_seconds,
    }
    children: list[JsonChild] = []
    try:
        addrs: list[str] = []
        for rank, host in enumerate(hosts):
            options = {**base, "rank": rank, "host": host.address, "initial_peers": addrs}
            if rank == 0 and plan.eval_every:  # (as ours: the first peer's alone)
                options["eval_every"] = plan.eval_epochs(mode)
            children.append(
                JsonChild(
                    HIVEMIND_TRAIN_FILE,
                    [json.dumps(options)],
                    name=f"hivemind peer {rank}",
                    namespace=host.namespace,
                )
            )
            addrs = addrs + children[-1].wait_report("joined", TRAIN_START_TIMEOUT)["addrs"][:1]
        deadline = time.monotonic() + TRAIN_START_TIMEOUT
        readies = [c.wait_report("ready", max(0.1, deadline - time.monotonic())) for c in children]
        failed = [r["error"] for r in readies if "error" in r]
        if failed:
            raise BenchError(f"a peer did not get ready: {failed[0]}")
        per_epoch = int(readies[0]["target_batch_size"])
        wire_before = host_tx_bytes(hosts)
        start_at = time.monotonic() + 1.0
        for child in children:
            child.send({"op": "train", "start_at": start_at})
        deadline = start_at + plan.wait_seconds + 120  # its own bound, and its report's
        reports = [
            c.wait_report("trained", max(0.1, deadline - time.monotonic())) for c in children
        ]
        run.wire_bytes = _difference(host_tx_bytes(hosts), wire_before)
        failed = [r["error"] for r in reports if "error" in r]
        if failed:
            raise BenchError(f"training failed: {failed[0]}")
    except BenchError as e:
        run.failure = str(e)
        return run
    finally:
        close_children(children)
    run.epochs = min(int(r["epochs"]) for r in reports)
    run.schedule_samples = run.epochs * per_epoch
    run.computed_samples = sum(int(r["local_samples"]) for r in reports)
    run.eval_seconds = float(reports[0].get("eval_seconds", 0.0))
    # As ours: the seconds of training, the first peer's evaluations left out.
    run.peer_seconds = [
        float(r["train_seconds"]) - (run.eval_seconds if rank == 0 else 0.0)
        for rank, r in enumerate(reports)
    ]
    run.train_seconds = max(run.peer_seconds)
    run.final_sync_seconds = [float(r.get("final_sync_s", 0.0)) for r in reports]
    run.metrics = dict(reports[0]["metrics"])
    run.peer_losses = [float(r["metrics"]["loss"]) for r in reports]
    run.curve = [
        (float(seconds), int(epoch), float(metrics["loss"]))
        for seconds, epoch, metrics in reports[0].get("eval_curve", [])
    ]
    return run


@dataclass(frozen=True, kw_only=True)
class SingleProcess:
    """The single-process baseline of a task's runs."""

    metrics: dict[str, float]
    train_seconds: float
    num_samples: int


def run_single_process(plan: TrainTask) -> SingleProcess:
    """The task at its recipe's global batch for ``plan.num_samples``, in this process on
    one thread (as every peer)."""
    import torch

    from swarm.baseline import BaselineConfig, run_baseline
    from swarm.tasks import get_task

    torch.set_num_threads(1)
    task = get_task(plan.task)
    if task.recipe.batch_size != plan.batch_size:
        raise BenchError(
            f"{plan.task}'s recipe has a global batch of {task.recipe.batch_size},"
            f" the plan {plan.batch_size}"
        )
    config = BaselineConfig(
        task=plan.task,
        batch_size=task.recipe.batch_size,
        num_samples=plan.num_samples,
        optimizer=task.recipe.optimizer,
    )
    result = run_baseline(config, task=task)
    return SingleProcess(
        metrics=result.metrics, train_seconds=result.train_seconds, num_samples=result.num_samples
    )


def describe_train(scenario: AlikeLinks, plans: tuple[TrainTask, ...]) -> str:
    tasks = ", ".join(f"{p.task} {p.num_samples:,} samples, H={p.inner_steps}" for p in plans)
    return f"{TRAIN_PEERS} training peers, {scenario.links()}; {tasks}"


def _second_metric(metrics: dict[str, float]) -> tuple[str, float | None]:
    """The task's other test metric: bits per char (charlm) or accuracy (digits)."""
    for name in ("bits_per_char", "accuracy"):
        if name in metrics:
            return name, metrics[name]
    return "", None


def run_train_scenario(
    scenario: AlikeLinks,
    plans: tuple[TrainTask, ...],
    hivemind: str | None,
    notes: list[str],
    figures: dict[str, Any],
    ratios: dict[str, float],
    failures: dict[str, str],
    modes: tuple[str, ...] = TRAIN_MODES,
) -> list[list[str]]:
    """Per task: the single-process baseline, then in one lab of ``TRAIN_PEERS`` hosts
    ours and hivemind in each of ``modes``, one run after another. Figures and ratios
    (``train_{task}_{mode}_...``) are added in place; returns the table's rows."""
    print(f"\n== {scenario.name}: {describe_train(scenario, plans)}", flush=True)
    notes.extend(f"{scenario.name}: {note}" for note in TRAIN_NOTES if hivemind)
    rows = [
        ["task", "system", "mode", "epochs", "schedule samples", "computed samples", "train s",
         "schedule samples/s", "computed samples/s", "test loss", "single loss", "other",
         "single other", "reached", "s to single loss", "averaging MB", "wire MB"]
    ]  # fmt: skip
    for plan in plans:
        single = run_single_process(plan)
        key = f"{scenario.name}_{plan.task}"
        base_loss = single.metrics["loss"]
        other_name, base_other = _second_metric(single.metrics)
        figures[f"{key}_single_process_loss"] = round(base_loss, 5)
        if base_other is not None:
            figures[f"{key}_single_process_{other_name}"] = round(base_other, 5)
        figures[f"{key}_single_process_seconds"] = round(single.train_seconds, 3)
        figures[f"{key}_single_process_samples_per_second"] = round(
            single.num_samples / single.train_seconds, 1
        )
        print(
            f"  {plan.task} single process: {single.num_samples:,} samples in"
            f" {single.train_seconds:.1f} s, loss {base_loss:.4f}",
            flush=True,
        )
        runs: dict[tuple[str, str], TrainRun] = {}
        with Lab() as lab:
            hosts, _ = scenario.hosts(lab, [f"t{i}" for i in range(TRAIN_PEERS)])
            for mode in modes:
                systems = ("ours", "hivemind") if hivemind and mode in HIVEMIND_MODE else ("ours",)
                for system in systems:
                    began = time.monotonic()
                    if system == "ours":
                        run = run_ours_training(hosts, plan, mode)
                    else:
                        run = run_hivemind_training(hosts, plan, mode)
                    runs[(system, mode)] = run
                    label = (
                        f"{plan.task} {system} {mode if system == 'ours' else HIVEMIND_MODE[mode]}"
                    )
                    if run.failure:
                        notes.append(f"{scenario.name} {label} failed: {run.failure}")
                        if system == "hivemind":
                            failures[f"{key}_{mode}"] = run.failure
                        print(f"  {label}: FAILED: {run.failure}", file=sys.stderr, flush=True)
                    else:
                        low, high = min(run.peer_losses), max(run.peer_losses)
                        if high > low * (1 + PEER_LOSS_TOLERANCE):
                            losses = ", ".join(f"{x:.4f}" for x in run.peer_losses)
                            notes.append(
                                f"{scenario.name} {label}: the peers ended with different"
                                f" models, test losses {losses} (the table shows the first's)"
                            )
                        phases = "".join(
                            f", {phase} {seconds:.3f}" for phase, seconds in run.phases.items()
                        )
                        print(
                            f"  {label}: {run.epochs} epochs in {run.train_seconds:.1f} s"
                            f" ({time.monotonic() - began:.0f} s with start-up),"
                            f" loss {run.metrics.get('loss', math.nan):.4f}"
                            + (f"; per epoch{phases} s" if phases else ""),
                            flush=True,
                        )
        for mode in modes:
            rows += [
                _train_row(plan, found, single, key, figures)
                for system in ("ours", "hivemind")
                if (found := runs.get((system, mode))) is not None
            ]
            mine, hers = runs.get(("ours", mode)), runs.get(("hivemind", mode))
            if mine and hers and mine.ok and hers.ok:
                ratios[f"{key}_{mode}_samples_per_second_vs_hivemind"] = round(
                    (mine.schedule_samples / mine.train_seconds)
                    / (hers.schedule_samples / hers.train_seconds),
                    3,
                )
                ratios[f"{key}_{mode}_loss_vs_hivemind"] = round(
                    hers.metrics["loss"] / mine.metrics["loss"], 3
                )
                target = base_loss * (1 + TRAIN_LOSS_TOLERANCE)
                my_time, her_time = mine.seconds_to(target), hers.seconds_to(target)
                if my_time and her_time:
                    ratios[f"{key}_{mode}_time_to_loss_vs_hivemind"] = round(her_time / my_time, 3)
                elif mine.curve and hers.curve:
                    reached_by = (
                        "ours alone" if my_time else "hivemind alone" if her_time else "neither"
                    )
                    notes.append(
                        f"{scenario.name} {plan.task} {mode}: no time-to-loss ratio: the"
                        f" single process's loss (within {TRAIN_LOSS_TOLERANCE:.0%}) was"
                        f" reached by {reached_by}"
                    )
        plain, overlap = runs.get(("ours", "diloco")), runs.get(("ours", "diloco-overlap"))
        if plain and overlap and plain.ok and overlap.ok and plain.epochs and overlap.epochs:
            per_step = {run.mode: run.train_seconds / run.epochs for run in (plain, overlap)}
            for mode, seconds in per_step.items():
                figures[f"{key}_{mode}_seconds_per_outer_step_ours"] = round(seconds, 4)
            ratios[f"{key}_diloco_overlap_outer_step_speedup"] = round(
                per_step["diloco"] / per_step["diloco-overlap"], 3
            )
            ratios[f"{key}_diloco_overlap_loss_vs_plain"] = round(
                plain.metrics["loss"] / overlap.metrics["loss"], 3
            )
        for system in ("ours", "hivemind"):
            gradient, diloco = runs.get((system, "gradient")), runs.get((system, "diloco"))
            if gradient and diloco and gradient.ok and diloco.ok:
                if gradient.wire_bytes and diloco.wire_bytes:
                    figures[f"{key}_diloco_wire_bytes_vs_gradient_{system}"] = round(
                        gradient.wire_bytes / diloco.wire_bytes, 3
                    )
                if gradient.bytes_sent and diloco.bytes_sent:
                    figures[f"{key}_diloco_bytes_vs_gradient_{system}"] = round(
                        gradient.bytes_sent / diloco.bytes_sent, 3
                    )
    return rows


def _train_row(
    plan: TrainTask, run: TrainRun, single: SingleProcess, key: str, figures: dict[str, Any]
) -> list[str]:
    """A run's table row; its figures (``{key}_{mode}_..._{system}``) added in place."""
    mode = run.mode if run.system == "ours" else HIVEMIND_MODE[run.mode]
    if not run.ok:
        return [plan.task, run.system, mode, "FAILED", *[""] * 13]
    base_loss = single.metrics["loss"]
    other_name, base_other = _second_metric(single.metrics)
    _, other = _second_metric(run.metrics)
    loss = run.metrics["loss"]
    reached = loss <= base_loss * (1 + TRAIN_LOSS_TOLERANCE)
    to_loss = run.seconds_to(base_loss * (1 + TRAIN_LOSS_TOLERANCE))
    schedule_rate = run.schedule_samples / run.train_seconds
    computed_rate = run.computed_samples / run.train_seconds
    prefix, suffix = f"{key}_{run.mode}", run.system
    found: dict[str, Any] = {
        "epochs": run.epochs,
        "schedule_samples": run.schedule_samples,
        "computed_samples": run.computed_samples,
        "train_seconds": round(run.train_seconds, 3),
        "schedule_samples_per_second": round(schedule_rate, 1),
        "computed_samples_per_second": round(computed_rate, 1),
        "loss": round(loss, 5),
        "loss_over_single_process": round(loss / base_loss, 4),
        "reached_single_process_loss": reached,
        "loss_per_peer": [round(x, 5) for x in run.peer_losses],
        "train_seconds_per_peer": [round(x, 3) for x in run.peer_seconds],
    }
    if run.final_sync_seconds:
        found["final_sync_seconds_per_peer"] = [round(x, 3) for x in run.final_sync_seconds]
    if other is not None:
        found[other_name] = round(other, 5)
    if run.bytes_sent is not None:
        found["averaging_bytes_sent"] = run.bytes_sent
    if run.wire_bytes is not None:
        found["wire_bytes_sent"] = run.wire_bytes
    for phase, seconds in run.phases.items():
        found[f"{phase}_seconds_per_epoch"] = round(seconds, 4)
    if run.curve:
        found["loss_curve"] = [[round(t, 3), epoch, round(x, 5)] for t, epoch, x in run.curve]
        found["eval_seconds"] = round(run.eval_seconds, 3)
        found["seconds_to_single_process_loss"] = None if to_loss is None else round(to_loss, 3)
    figures.update({f"{prefix}_{name}_{suffix}": value for name, value in found.items()})
    as_other = "{:.1%}" if other_name == "accuracy" else "{:.3f}"
    return [
        plan.task,
        run.system,
        mode,
        str(run.epochs),
        f"{run.schedule_samples:,}",
        f"{run.computed_samples:,}",
        f"{run.train_seconds:.1f}",
        f"{schedule_rate:,.0f}",
        f"{computed_rate:,.0f}",
        f"{loss:.4f}",
        f"{base_loss:.4f}",
        fmt(other, as_other),
        fmt(base_other, as_other),
        "yes" if reached else "no",
        fmt(to_loss, "{:.1f}") if run.curve else "",
        fmt(run.bytes_sent / 1e6 if run.bytes_sent is not None else None, "{:.1f}"),
        fmt(run.wire_bytes / 1e6 if run.wire_bytes is not None else None, "{:.1f}"),
    ]


def _good(series: Series | None, seconds: list[float]) -> float | None:
    """The median of ``seconds`` if ``series`` ran and was right."""
    if series is None or series.problems or series.failure or not seconds:
        return None
    return median(seconds)


def link_bound_figures(
    scenario: Scenario, results: Results, figures: dict[str, Any], ratios: dict[str, float]
) -> list[list[str]]:
    """Each size and codec against the link bound: rows for the table; figures and ratios
    (``{scenario}_{size}_{codec}_...``) added in place. Ours is the round with the group
    given (equal parts) on equal links, and the averager's all-reduce (parts from the
    rates it measured) on unequal ones; hivemind's is its all-reduce."""
    rows = []
    for size in results.plan.sizes:
        n = elements(size)
        for codec in results.plan.codecs:
            key = f"{scenario.name}_{size}_{codec}"
            bound = scenario.link_bound_seconds(n, codec, equal_parts=False)
            equal_bound = scenario.link_bound_seconds(n, codec, equal_parts=True)
            figures[f"{key}_link_bound_seconds"] = round(bound, 3)
            mine = results.ours.get((size, codec))
            steps = results.ours_steps.get((size, codec))
            hers = results.theirs.get((size, codec))
            equal_s = _good(mine, mine.seconds if mine else [])
            measured_s = _good(steps, steps.seconds if steps else [])
            hers_s = _good(hers, hers.seconds if hers else [])
            ours_s = measured_s if scenario.unequal else equal_s
            shares = ""
            if scenario.unequal:
                figures[f"{key}_equal_parts_link_bound_seconds"] = round(equal_bound, 3)
                if equal_s is not None:
                    figures[f"{key}_equal_parts_seconds_ours"] = round(equal_s, 3)
                if measured_s is not None:
                    figures[f"{key}_measured_parts_seconds_ours"] = round(measured_s, 3)
                if equal_s is not None and measured_s is not None:
                    ratios[f"{key}_measured_parts_vs_equal_parts"] = round(equal_s / measured_s, 3)
            if steps is not None and steps.shares:  # equal links should get equal parts
                last = steps.shares[-1]
                figures[f"{key}_part_shares_ours"] = [round(x, 3) for x in last]
                figures[f"{key}_measured_MB_per_s_ours"] = [
                    round(x / 1e6, 2) for x in steps.measured[-1]
                ]
                figures[f"{key}_part_shares_ours_each_step"] = [
                    [round(x, 3) for x in step] for step in steps.shares
                ]
                shares = " ".join(f"{x:.2f}" for x in last)
            if ours_s is not None:
                ratios[f"{key}_fraction_of_link_bound"] = round(bound / ours_s, 3)
            if hers_s is not None:
                figures[f"{key}_allreduce_seconds_hivemind"] = round(hers_s, 3)
                figures[f"{key}_fraction_of_link_bound_hivemind"] = round(bound / hers_s, 3)
            if ours_s is not None and hers_s is not None:
                ratios[f"{key}_throughput_vs_hivemind"] = round(hers_s / ours_s, 3)
            raw_s = median(results.raw[size]) * WIRE_BYTES_PER_ELEMENT[codec] / 4
            rows.append(
                [
                    scenario.name,
                    size,
                    codec,
                    f"{bound:.2f}",
                    f"{equal_bound:.2f}" if scenario.unequal else "",
                    f"{raw_s:.2f}",
                    fmt(equal_s, "{:.2f}"),
                    fmt(measured_s, "{:.2f}"),
                    "FAILED" if hers and hers.failure else fmt(hers_s, "{:.2f}"),
                    fmt(bound / ours_s if ours_s else None, "{:.2f}"),
                    fmt(bound / hers_s if hers_s else None, "{:.2f}"),
                    fmt(hers_s / ours_s if ours_s and hers_s else None, "{:.2f}x"),
                    shares,
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="equal (4M elements, 1 round) and expert (fewer calls); with --scenarios dht,"
        " 8 DHT peers; with --scenarios train, digits for 512 samples (train is not in"
        " the default quick list: about 3.5 minutes more)",
    )
    parser.add_argument("--no-hivemind", action="store_true", help="measure ours only")
    parser.add_argument(
        "--scenarios",
        help=f"comma-separated: {', '.join(ALL_SCENARIOS)}"
        f" (default: all; --quick: {QUICK_SCENARIOS})",
    )
    parser.add_argument("--dht-peers", type=int, help="peers in the DHT scenario (32; --quick: 8)")
    parser.add_argument(
        "--train-tasks",
        help=f"comma-separated tasks of the train scenario: {', '.join(TRAIN_FULL)}"
        f" (default {','.join(TRAIN_FULL_TASKS)}; --quick: {','.join(TRAIN_QUICK_TASKS)})",
    )
    parser.add_argument(
        "--train-samples",
        type=int,
        help="global samples of every train scenario task (default: its plan's)",
    )
    parser.add_argument(
        "--train-inner-steps",
        type=int,
        metavar="H",
        help="global batches between DiLoCo's (and hivemind's local) averaging rounds in the"
        " train scenario (default 10; --quick: 4)",
    )
    parser.add_argument(
        "--train-outer-momentum",
        type=float,
        metavar="M",
        help="our DiLoCo's outer momentum in the train scenario (default 0.9, the paper's)",
    )
    parser.add_argument(
        "--train-eval-every",
        type=int,
        metavar="N",
        help="train scenario: a loss curve, the first peer of every run evaluating its model"
        " every N global batches (default: 10 in a full run, none with --quick; 0: none)",
    )
    parser.add_argument(
        "--train-modes",
        help=f"comma-separated modes of the train scenario: {', '.join(TRAIN_MODES)}"
        " (default: all)",
    )
    parser.add_argument("--sizes", help="comma-separated sizes in elements, e.g. 4M,64M")
    parser.add_argument("--codecs", help="comma-separated: none,float16,uint8,blockwise8")
    parser.add_argument("--rounds", type=int, help="timed rounds per size and codec")
    parser.add_argument("--step-rounds", type=int, help="timed full steps (0: none of ours)")
    parser.add_argument(
        "--connections-per-member",
        type=int,
        choices=range(1, 13),
        metavar="N",
        help="all-reduce scenarios: the connections our members' links run on together on"
        " long round trips (AllReduceConfig.connections_per_member; default its 2: in a"
        " pair two per link; 1: one per link, as before lanes)",
    )
    parser.add_argument(
        "--no-reverse-lane",
        action="store_true",
        help="all-reduce scenarios: our members that do not open a link wait for the"
        " opener's stream before they send (AllReduceConfig.reverse_lane=False), as before"
        " the reverse lane",
    )
    parser.add_argument(
        "--no-slow-start-after-idle",
        action="store_true",
        help="all-reduce scenarios: set net.ipv4.tcp_slow_start_after_idle=0 in every"
        " member's namespace (TCP keeps its window across the gaps between rounds)",
    )
    parser.add_argument(
        "--congestion-control",
        choices=("cubic", "bbr", "reno"),
        help="all-reduce scenarios: the TCP congestion control of every member's namespace"
        " (net.ipv4.tcp_congestion_control), for raw TCP, ours and hivemind alike;"
        " default: the kernel's (cubic)",
    )
    args = parser.parse_args(argv)
    names = (args.scenarios or (QUICK_SCENARIOS if args.quick else ",".join(ALL_SCENARIOS))).split(
        ","
    )
    unknown = [s for s in names if s not in ALL_SCENARIOS]
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(ALL_SCENARIOS)}"
        )
    scenarios = [SCENARIOS[s] for s in names if s in SCENARIOS]
    dht_plan = DHT_QUICK if args.quick else DHT_FULL
    if args.dht_peers:
        try:
            dht_plan = replace(dht_plan, num_peers=args.dht_peers)
        except ValueError as e:
            parser.error(f"--dht-peers {args.dht_peers}: {e}")
    train_tasks = (
        args.train_tasks.split(",")
        if args.train_tasks
        else list(TRAIN_QUICK_TASKS if args.quick else TRAIN_FULL_TASKS)
    )
    bad_tasks = [t for t in train_tasks if t not in TRAIN_FULL] or len(set(train_tasks)) < len(
        train_tasks
    )
    if bad_tasks:
        parser.error(
            f"--train-tasks {args.train_tasks}: give each once, from {', '.join(TRAIN_FULL)}"
        )
    train_modes = tuple(args.train_modes.split(",")) if args.train_modes else TRAIN_MODES
    if not set(train_modes) <= set(TRAIN_MODES) or len(set(train_modes)) < len(train_modes):
        parser.error(f"--train-modes {args.train_modes}: give each once, from {TRAIN_MODES}")
    train_plans = tuple((TRAIN_QUICK if args.quick else TRAIN_FULL)[t] for t in train_tasks)
    for flag, name, value in (
        ("--train-samples", "num_samples", args.train_samples),
        ("--train-inner-steps", "inner_steps", args.train_inner_steps),
        ("--train-outer-momentum", "outer_momentum", args.train_outer_momentum),
        ("--train-eval-every", "eval_every", args.train_eval_every),
    ):
        if value is not None:
            try:
                train_plans = tuple(replace(p, **{name: value}) for p in train_plans)
            except ValueError as e:
                parser.error(f"{flag} {value}: {e}")
    available, why = lab_available()
    if not available:
        print(f"the WAN benchmark needs the namespace lab: {why}", file=sys.stderr)
        return 1
    plan = with_counts(QUICK if args.quick else FULL, args)
    if args.connections_per_member is not None:
        plan = replace(plan, connections_per_member=args.connections_per_member)
    if args.no_reverse_lane:
        plan = replace(plan, reverse_lane=False)
    notes: list[str] = []
    hivemind, why = (
        (None, "disabled with --no-hivemind") if args.no_hivemind else installed_hivemind()
    )
    if hivemind is None:
        notes.append(f"hivemind not measured: {why}")
    run_kind = "quick" if args.quick else "full"
    print(
        f"WAN benchmark ({run_kind}): all-reduce in float32, codecs {', '.join(plan.codecs)};"
        f" {os.cpu_count()} CPUs; hivemind {hivemind or 'absent'}",
        flush=True,
    )
    began = time.monotonic()
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    failures: dict[str, str] = {}
    bound_rows = [
        ["scenario", "size", "codec", "link bound s", "(equal parts)", "raw TCP s",
         "ours equal parts s", "ours measured parts s", "hivemind s", "ours/bound",
         "hivemind/bound", "vs hivemind", "our parts"]
    ]  # fmt: skip
    for scenario in scenarios:
        sizes = tuple(args.sizes.split(",")) if args.sizes else scenario.full_sizes
        scenario_plan = replace(
            plan,
            sizes=("4M",) if args.quick and not args.sizes else sizes,
            num_peers=len(scenario.rates_mbit),
        )
        scenario_plan = replace(scenario_plan, sizes=sizes_that_fit(scenario_plan, notes))
        if not scenario_plan.sizes:
            notes.append(f"{scenario.name}: no size fits in the memory available")
            continue
        results = run_scenario(
            scenario,
            scenario_plan,
            hivemind,
            notes,
            slow_start_after_idle=not args.no_slow_start_after_idle,
            congestion_control=args.congestion_control,
        )
        scenario_notes: list[str] = []
        found, found_ratios, found_failures, tables = summarize(results, scenario_notes)
        notes.extend(f"{scenario.name}: {note}" for note in scenario_notes)
        figures.update({f"{scenario.name}_{k}": v for k, v in found.items()})
        failures.update({f"{scenario.name}_{k}": v for k, v in found_failures.items()})
        for key, value in found_ratios.items():
            if key.endswith("_step_vs_hivemind"):  # the full steps, matchmaking included
                ratios[f"{scenario.name}_{key}"] = value
            elif "fraction" in key:  # of raw TCP's time here: a figure, the link's is the ratio
                figures[f"{scenario.name}_{key}_raw_tcp"] = value
            # (its throughput_vs_hivemind: link_bound_figures says which of ours compares)
        for title, rows in tables:
            if len(rows) > 1:
                print_table(f"[{scenario.name}] {title}", rows)
        bound_rows += link_bound_figures(scenario, results, figures, ratios)
    dht_rows: list[list[str]] = []
    if DHT_SCENARIO.name in names:
        dht_rows = run_dht_scenario(DHT_SCENARIO, dht_plan, hivemind, notes, figures, ratios)
        print_table(
            f"[{DHT_SCENARIO.name}] {describe_dht(DHT_SCENARIO, dht_plan)}: latency of one op at a"
            " time (medians of its timed ops), in ms and in round trips",
            dht_rows,
        )
    if EXPERT_SCENARIO.name in names:
        expert_plan = EXPERT_QUICK if args.quick else EXPERT_FULL
        expert_rows = run_expert_scenario(
            EXPERT_SCENARIO, expert_plan, hivemind, notes, figures, ratios
        )
        print_table(
            f"[{EXPERT_SCENARIO.name}] {describe_expert(EXPERT_SCENARIO)}: median call at batch 1;"
            " bound = a round trip per call (fwd: 1, fwd+bwd: 2) + the local compute;"
            " echo bound = a plain TCP echo of a call's bytes per call + the local compute",
            expert_rows,
        )
    if TRAIN_SCENARIO.name in names:
        # Last: its single-process baselines run in this process (torch on one thread).
        train_rows = run_train_scenario(
            TRAIN_SCENARIO, train_plans, hivemind, notes, figures, ratios, failures, train_modes
        )
        print_table(
            f"[{TRAIN_SCENARIO.name}] {describe_train(TRAIN_SCENARIO, train_plans)}:"
            " train s = the slowest peer's, first step to last; schedule samples = epochs x"
            " the samples of an epoch, computed = what the peers computed (a hivemind epoch"
            " holds more); other = accuracy or bits/char; reached = test loss within"
            f" {TRAIN_LOSS_TOLERANCE:.0%} of the single process's; s to single loss = the"
            " first peer's training seconds until its loss curve first did; averaging MB = what our"
            " peers sent in rounds, wire MB = every host's link, all traffic",
            train_rows,
        )
    if len(bound_rows) > 1:
        print_table(
            "the all-reduce against the link bound (the best parts at the link rates less"
            " TCP/IP headers, plus one round trip; equal parts beside it where links differ);"
            " raw TCP (equal parts) scaled to the codec's wire bytes",
            bound_rows,
        )
    for key, value in ratios.items():
        if key.endswith("_fraction_of_link_bound"):
            target, text = TARGET_FRACTION_OF_LINK_BOUND, f"{value:.2f}"
        elif key.endswith("_throughput_vs_hivemind"):
            target, text = TARGET_VS_HIVEMIND, f"{value:.2f}x"
        elif key.endswith("_measured_parts_vs_equal_parts"):
            target, text = 1.0, f"{value:.2f}x"
        elif key.startswith(EXPERT_SCENARIO.name) and key.endswith("_fraction_of_bound"):
            target, text = 1 / TARGET_EXPERT_OVER_BOUND, f"{value:.2f}"
        else:
            continue
        print(f"target {key} >= {target:g}: {text}, {'met' if value >= target else 'NOT met'}")
    for task in train_tasks if TRAIN_SCENARIO.name in names else ():
        for mode in TRAIN_MODES:
            reached = figures.get(
                f"{TRAIN_SCENARIO.name}_{task}_{mode}_reached_single_process_loss_ours"
            )
            if reached is not None:
                print(
                    f"target {TRAIN_SCENARIO.name} {task} {mode}: the single process's loss"
                    f" (within {TRAIN_LOSS_TOLERANCE:.0%}), {'met' if reached else 'NOT met'}"
                )
    got = figures.get(f"{DHT_SCENARIO.name}_get_p50_round_trips_ours")
    if got is not None and got * DHT_SCENARIO.rtt_seconds * 1000 < LOCAL_HIT_MS:
        print("target dht get p50: not judged (the reader held the replicas itself)")
    elif got is not None:
        verdict = "met" if got <= TARGET_DHT_GET_ROUND_TRIPS else "NOT met"
        print(
            f"target dht get p50 <= {TARGET_DHT_GET_ROUND_TRIPS:g} round trips:"
            f" {got:.2f}, {verdict}"
        )
    for note in notes:
        print(f"note: {note}")
    print(f"total {time.monotonic() - began:.1f} s")
    emit_result(
        "wan",
        figures,
        ratios,
        mode=run_kind,
        hivemind=hivemind,
        hivemind_failures=failures,
        notes=notes,
        plan=asdict(plan),
        scenarios=[asdict(s) for s in scenarios],
        dht_plan=asdict(dht_plan) if DHT_SCENARIO.name in names else None,
        train_plans=[asdict(p) for p in train_plans] if TRAIN_SCENARIO.name in names else None,
        cpus=os.cpu_count(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
