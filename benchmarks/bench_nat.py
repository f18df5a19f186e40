"""NAT traversal benchmark: relayed against direct connections, and hole punching.

1. On loopback, three kinds of process: a relay (circuit relay v2 hop), a peer that is
   private (reserved on the relay), and dialers. One dialer reaches the private peer
   directly (the limit: what a connection without the relay does on this machine), the
   other through the relay, hole punching off so it stays relayed. Both send the same
   bulk transfer over one stream and ping; repetitions alternate direct and relayed.
   Figures: MB/s, added round-trip latency, the relay's CPU seconds per MB relayed.
2. In the namespace lab (root and nftables; skipped otherwise): a public relay and two
   laptops behind endpoint-independent home routers (real NAT, unsolicited inbound
   dropped). Each trial starts two fresh laptop processes on a fresh port; one dials
   the other through the relay, and DCUtR tries to punch a direct connection. Figures:
   success rate, seconds from the relayed connection to the direct one.
3. Training in the lab, real ``swarm train``/``swarm join`` processes: five peers train
   ``digits`` (global batch 64): with four of them laptops behind endpoint-independent
   home routers (all with one private address), with two of those four behind symmetric
   routers instead (everything to and from them crosses a relay), and with all five on
   public addresses (the limit). Figure: global samples per second after the first
   steps, read from the public peer's progress, and the ratios to all public (goal >=
   0.9).

There is no hivemind column: go-libp2p's relays cap a relayed connection at 128 KiB
(p2pd's defaults differ but still reset it), and hivemind never punches holes itself;
the comparison that matters is against the direct path, which is the limit.

    .venv/bin/python benchmarks/bench_nat.py --quick   # under two minutes
    .venv/bin/python benchmarks/bench_nat.py           # full
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import emit_result, median, percentile, print_table

from peers.netlab import Lab, lab_available
from peers.netlab.nat import NatType
from peers.testing import LocalSwarm, PeerProcess

TARGET = str(Path(__file__).resolve().parent / "_nat_peers.py") + ":bench_peer"
REPLY_SECONDS = 120.0
MB = 1 << 20


def ask(proc: PeerProcess, command: dict[str, Any]) -> dict[str, Any]:
    proc.send(command)
    return proc.wait_report(command["cmd"], REPLY_SECONDS)


#: What each process reported when it joined (its bound addresses), by PeerID.
JOINED: dict[str, dict[str, Any]] = {}


def start(swarm: LocalSwarm, namespace: str | None = None, **options: Any) -> PeerProcess:
    [proc] = swarm.start(1, target=TARGET, options=options, namespaces=[namespace])
    JOINED[proc.peer_id] = proc.wait_report("joined", REPLY_SECONDS)
    return proc


def loopback(num_bytes: int, reps: int, num_pings: int) -> dict[str, Any]:
    with LocalSwarm() as swarm:
        relay = start(swarm, peer_config={"reachability": "public"})
        private = start(
            swarm,
            bootstrap=relay.addrs,
            peer_config={"reachability": "private", "hole_punching": False},
        )
        [circuit] = ask(private, {"cmd": "wait_relays", "n": 1, "timeout": 30})["circuit_addrs"]
        dialer = {"reachability": "public", "relay_service": False}
        direct = start(swarm, peer_config=dialer)
        relayed = start(swarm, peer_config=dialer)
        bound = JOINED[private.peer_id]["bound"][0]
        reply = ask(direct, {"cmd": "dial", "addr": f"{bound}/p2p/{private.peer_id}"})
        if not reply["direct"]:
            raise SystemExit(f"the direct dialer is not connected directly: {reply}")
        reply = ask(relayed, {"cmd": "dial", "addr": circuit})
        if reply["direct"]:
            raise SystemExit(f"the relayed dialer is connected directly: {reply}")
        rates: dict[str, list[float]] = {"direct": [], "relayed": []}
        relay_cpu_per_mb: list[float] = []
        for rep in range(reps):
            order = ["direct", "relayed"] if rep % 2 == 0 else ["relayed", "direct"]
            for kind in order:
                proc = direct if kind == "direct" else relayed
                if kind == "relayed":  # a fresh circuit each time: the relay limits each
                    ask(relayed, {"cmd": "dial", "addr": circuit, "fresh": True})
                cpu_before = ask(relay, {"cmd": "cpu"})["seconds"]
                result = ask(proc, {"cmd": "bulk", "peer": private.peer_id, "num_bytes": num_bytes})
                cpu = ask(relay, {"cmd": "cpu"})["seconds"] - cpu_before
                if result["received"] != num_bytes:
                    raise SystemExit(f"{kind}: {result['received']} of {num_bytes} bytes arrived")
                if result["relayed"] != (kind == "relayed"):
                    raise SystemExit(f"{kind} transfer went the wrong way: {result}")
                rates[kind].append(num_bytes / MB / result["seconds"])
                if kind == "relayed":
                    relay_cpu_per_mb.append(cpu / (num_bytes / MB))
        rtts = {
            kind: ask(proc, {"cmd": "ping", "peer": private.peer_id, "n": num_pings})["rtts"]
            for kind, proc in (("direct", direct), ("relayed", relayed))
        }
    return {
        "direct_MB_per_s": median(rates["direct"]),
        "relayed_MB_per_s": median(rates["relayed"]),
        "direct_rtt_p50_ms": percentile(rtts["direct"], 50) * 1000,
        "relayed_rtt_p50_ms": percentile(rtts["relayed"], 50) * 1000,
        "relay_cpu_seconds_per_MB": median(relay_cpu_per_mb),
    }


def hole_punching(trials: int) -> dict[str, Any]:
    seconds: list[float] = []
    attempts: list[int] = []
    with Lab() as lab, LocalSwarm() as swarm:
        relay_host = lab.add_public_host("relay")
        laptops = [
            lab.add_lan_host(lab.add_home_router(f"home{i}", nat="endpoint-independent"), f"l{i}")
            for i in range(2)
        ]
        relay = start(
            swarm,
            relay_host.namespace,
            listen=["/ip4/0.0.0.0/tcp/4001"],
            peer_config={"reachability": "public"},
        )
        for trial in range(trials):
            # Fresh processes on a fresh port: the last trial's connections linger in
            # TIME_WAIT on the old 4-tuples, which would keep the listen port from dialing.
            options = {
                "listen": [f"/ip4/0.0.0.0/tcp/{4100 + trial}"],
                "bootstrap": relay.addrs,
                "peer_config": {"reachability": "private"},
            }
            a, b = (start(swarm, host.namespace, **options) for host in laptops)
            [circuit] = ask(b, {"cmd": "wait_relays", "n": 1, "timeout": 30})["circuit_addrs"]
            ask(a, {"cmd": "dial", "addr": circuit, "direct_within": 15.0})
            punches = ask(b, {"cmd": "punches"})["punches"]
            if punches and punches[0]["success"]:
                seconds.append(punches[0]["seconds"])
                attempts.append(punches[0]["attempts"])
            swarm.terminate(a)
            swarm.terminate(b)
    return {
        "hole_punch_trials": trials,
        "hole_punch_successes": len(seconds),
        "hole_punch_seconds_p50": median(seconds) if seconds else None,
        "hole_punch_seconds_max": max(seconds) if seconds else None,
        "hole_punch_attempts_max": max(attempts) if attempts else None,
    }


SWARM = [sys.executable, "-m", "swarm.cli"]
#: Global steps of the training runs, and how many to leave out at the start (the
#: first rounds open connections, reserve relays and punch holes).
TRAIN_STEPS = {True: 40, False: 200}
WARM_STEPS = 10


#: The four peers besides the public one, by scenario: their routers' NAT, or public.
SCENARIOS: dict[str, tuple[NatType | Literal["public"], ...]] = {
    "public": ("public",) * 4,
    "private": ("endpoint-independent",) * 4,
    "private_mixed": ("endpoint-independent", "symmetric") * 2,
}


def training(scenario: str, steps: int) -> float:
    """Global samples per second of five peers training ``digits`` in the lab, after
    ``WARM_STEPS`` steps; the four besides the public one as ``SCENARIOS`` says."""
    batch = 64
    with Lab() as lab, tempfile.TemporaryDirectory() as logs:
        server = lab.add_public_host("server")
        hosts: list[Any] = [
            lab.add_public_host(f"peer{i}")
            if kind == "public"
            else lab.add_lan_host(lab.add_home_router(f"home{i}", nat=kind), f"laptop{i}")
            for i, kind in enumerate(SCENARIOS[scenario])
        ]
        argv = [*SWARM, "train", "--listen", "/ip4/0.0.0.0/tcp/0", "--num-peers", "5"]
        argv += ["--num-samples", str(batch * steps), "--num-threads", "1", "--progress", "json"]
        first = server.popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert first.stdout is not None
        joiners: list[subprocess.Popen[str]] = []
        try:
            join: list[str] = []
            for line in first.stdout:  # the join command comes before any progress
                text = json.loads(line).get("text", "") if line.startswith("{") else ""
                found = re.search(r" (join --initial-peers /ip4/198\.18\.\S+ .*)", text)
                if found:
                    join = found.group(1).split()
                    break
            if not join:
                raise RuntimeError("swarm train printed no join command")
            for i, host in enumerate(hosts):
                with open(Path(logs) / f"{i}.log", "w") as log:
                    argv = [*SWARM, *join, "--num-threads", "1", "--progress", "none"]
                    joiners.append(host.popen(argv, stdout=log, stderr=log, text=True))
            start: tuple[float, int] | None = None
            end: tuple[float, int] | None = None
            for line in first.stdout:  # bounded: the run ends after ``steps`` steps
                record = json.loads(line) if line.startswith("{") else {}
                # every new epoch prints a progress line: time from the first one past
                # the warm-up to the first one of the last epoch (not the result line,
                # which follows leaving the swarm and evaluating)
                if record.get("event") == "progress" and record["samples"] >= batch * WARM_STEPS:
                    start = start or (time.monotonic(), record["samples"])
                    if end is None or record["samples"] > end[1]:
                        end = (time.monotonic(), record["samples"])
            first.wait(timeout=60)
            for proc in joiners:
                proc.wait(timeout=60)
            if start is None or end is None or first.returncode != 0:
                raise RuntimeError(f"the training run did not finish (exit {first.returncode})")
            if end[1] <= start[1] or end[0] <= start[0]:
                raise RuntimeError(f"no step was timed after the first {WARM_STEPS}: {start, end}")
            return (end[1] - start[1]) / (end[0] - start[0])
        finally:
            for proc in [first, *joiners]:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (under two minutes)")
    parser.add_argument("--no-lab", action="store_true", help="skip the hole punching part")
    parser.add_argument(
        "--train-steps",
        type=int,
        help=f"global steps of each training run (default {TRAIN_STEPS[True]} with --quick, "
        f"else {TRAIN_STEPS[False]}; at least {WARM_STEPS + 2}, the first {WARM_STEPS} not timed)",
    )
    parser.add_argument(
        "--punch-trials", type=int, help="hole punching trials (default 3 with --quick, else 10)"
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"training scenarios, comma-separated (default all: {','.join(SCENARIOS)}; "
        "public is always run, the others' ratios are to it)",
    )
    args = parser.parse_args()
    scenarios = ["public", *(n for n in args.scenarios.split(",") if n and n != "public")]
    if unknown := [n for n in scenarios if n not in SCENARIOS]:
        parser.error(f"unknown scenario {unknown[0]!r}; known: {', '.join(SCENARIOS)}")
    if args.train_steps is not None and args.train_steps < WARM_STEPS + 2:
        parser.error(f"--train-steps must be at least {WARM_STEPS + 2}")
    if args.punch_trials is not None and args.punch_trials < 1:
        parser.error("--punch-trials must be at least 1")
    num_bytes = (32 if args.quick else 256) * MB
    figures = loopback(
        num_bytes, reps=3 if args.quick else 5, num_pings=200 if args.quick else 1000
    )
    rows = [
        ["path", "MB/s", "rtt p50 (ms)"],
        [
            "direct (the limit)",
            f"{figures['direct_MB_per_s']:.0f}",
            f"{figures['direct_rtt_p50_ms']:.3f}",
        ],
        ["relayed", f"{figures['relayed_MB_per_s']:.0f}", f"{figures['relayed_rtt_p50_ms']:.3f}"],
    ]
    print_table(f"one stream, {num_bytes // MB} MiB, loopback", rows)
    print(f"  relay CPU: {figures['relay_cpu_seconds_per_MB'] * 1000:.2f} ms per MB relayed")
    notes: list[str] = []
    available, reason = lab_available()
    if args.no_lab or not available:
        notes.append(f"hole punching skipped: {'--no-lab' if args.no_lab else reason}")
    else:
        trials = args.punch_trials or (3 if args.quick else 10)
        figures.update(hole_punching(trials))
        print(
            f"\nhole punching through two endpoint-independent NATs: "
            f"{figures['hole_punch_successes']}/{figures['hole_punch_trials']} succeeded, "
            f"p50 {figures['hole_punch_seconds_p50']} s"
        )
        steps, reps = args.train_steps or TRAIN_STEPS[args.quick], 1 if args.quick else 3
        rates: dict[str, list[float]] = {name: [] for name in scenarios}
        for _ in range(reps):  # alternating, so a slow spell of the machine hits all
            for name, runs in rates.items():
                runs.append(training(name, steps))
        for name, runs in rates.items():
            figures[f"training_samples_per_s_{name}"] = median(runs)
            figures[f"training_samples_per_s_{name}_runs"] = runs
        print(
            f"\ntraining digits, 5 peers, {steps} steps of 64, median of {reps} (samples/s): "
            + ", ".join(f"{n} {median(r):.0f}" for n, r in rates.items())
        )
    ratios: dict[str, float] = {
        "relayed_throughput_fraction_of_direct": figures["relayed_MB_per_s"]
        / figures["direct_MB_per_s"],
        "relayed_latency_fraction_of_direct": figures["direct_rtt_p50_ms"]
        / figures["relayed_rtt_p50_ms"],
    }
    if "hole_punch_trials" in figures:
        ratios["hole_punch_success_fraction"] = (
            figures["hole_punch_successes"] / figures["hole_punch_trials"]
        )
        for name in scenarios[1:]:
            ratios[f"training_{name}_fraction_of_public"] = (
                figures[f"training_samples_per_s_{name}"] / figures["training_samples_per_s_public"]
            )
    emit_result("nat", figures, ratios, notes=notes)


if __name__ == "__main__":
    main()
