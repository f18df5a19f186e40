"""A handshake flood from one host (issue 21, item 5): what one flooding host costs a
peer, ours against hivemind's ``p2pd`` (go-libp2p), in the namespace lab.

The victim listens in one lab host; a flooder in another host opens TCP connections and
runs whole connection upgrades (multistream, Noise XX with a fresh identity each time,
yamux), ``--concurrency`` at a time, for ``--seconds``; meanwhile a third host connects
to the victim and pings it. Three victims, one after another: ours as it ships (a
handshake rate per IP, a static Noise key signed once), ours with the handshake rate
lifted (what a flood got before the rate), and hivemind's ``p2pd``. Figures: handshakes
the victim completed per second, the victim's CPU during the flood (fraction of one
core, from /proc), and the honest host's connect-and-ping seconds.

Needs root and nftables (the namespace lab, docs/netlab.md).

    .venv/bin/python benchmarks/bench_handshake_flood.py --quick    # 3 s floods
    .venv/bin/python benchmarks/bench_handshake_flood.py            # 10 s floods, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import emit_result, installed_hivemind, median, print_table, stop_pids

from peers.netlab import Lab, lab_available
from peers.netlab.hosts import PublicHost
from peers.testing import LocalSwarm, PeerProcess

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tests/peers/targets/flood.py:flood_peer"
PORT = 4001
REPLY_SECONDS = 60.0
#: The handshake rate lifted: more than any flood here can use.
UNLIMITED = {"handshake_rate_per_ip": 1e9, "handshake_burst_per_ip": 10**9}

P2PD_CHILD = r"""
import asyncio, json, sys
from hivemind.p2p import P2P
async def main():
    p2p = await P2P.create(host_maddrs=[sys.argv[1]])
    print(json.dumps({"peer_id": p2p.peer_id.to_base58(), "pid": p2p._child.pid}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await p2p.shutdown()
asyncio.run(main())
"""


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def our_victim(
    swarm: LocalSwarm, host: PublicHost, peer_config: dict[str, Any]
) -> Iterator[tuple[str, int]]:
    (victim,) = swarm.start(
        1,
        target=TARGET,
        options={
            "listen": [f"/ip4/0.0.0.0/tcp/{PORT}"],
            "peer_config": {"reachability": "public", **peer_config},
        },
        namespaces=[host.namespace],
    )
    victim.wait_report("ready", REPLY_SECONDS)
    try:
        yield f"/ip4/{host.address}/tcp/{PORT}/p2p/{victim.peer_id}", victim.pid
    finally:
        swarm.terminate(victim)


@contextmanager
def hivemind_victim(host: PublicHost) -> Iterator[tuple[str, int]]:
    child = host.popen(
        [sys.executable, "-c", P2PD_CHILD, f"/ip4/0.0.0.0/tcp/{PORT}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, HIVEMIND_LOGLEVEL="ERROR"),
    )
    assert child.stdout is not None and child.stdin is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"hivemind's P2P did not start (exit {child.wait(timeout=30)})")
    started = json.loads(line)
    try:
        yield f"/ip4/{host.address}/tcp/{PORT}/p2p/{started['peer_id']}", started["pid"]
    finally:
        child.stdin.close()  # the child shuts its p2pd down
        try:
            child.wait(timeout=15)
        finally:
            stop_pids([started["pid"]], expect_in_command="p2pd")


def flood_once(
    victim: Callable[[], Any], flooder: PeerProcess, honest: PeerProcess, args: argparse.Namespace
) -> dict[str, float]:
    with victim() as (addr, pid):
        time.sleep(0.5)  # let it settle (p2pd starts its own services)
        cpu, wall = cpu_seconds(pid), time.monotonic()
        flooder.send(
            {"cmd": "flood", "addr": addr, "seconds": args.seconds, "concurrency": args.concurrency}
        )
        time.sleep(min(1.0, args.seconds / 3))  # the honest host comes in mid-flood
        honest.send({"cmd": "ping", "addr": addr})
        pinged = honest.wait_report("pinged", REPLY_SECONDS)
        flooded = flooder.wait_report("flooded", REPLY_SECONDS + args.seconds)
        cpu, wall = cpu_seconds(pid) - cpu, time.monotonic() - wall
    return {
        "handshakes_per_s": flooded["completed"] / flooded["seconds"],
        "refused_per_s": flooded["refused"] / flooded["seconds"],
        "cpu_fraction": cpu / wall,
        "honest_ping_seconds": pinged["seconds"] if pinged["ok"] else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 s floods, one round")
    parser.add_argument("--seconds", type=float, help="seconds of each flood (10; 3 with --quick)")
    parser.add_argument(
        "--rounds", type=int, help="rounds of the three victims (3; 1 with --quick)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="upgrades at once (32)")
    parser.add_argument("--no-hivemind", action="store_true", help="ours only")
    args = parser.parse_args()
    args.seconds = args.seconds or (3.0 if args.quick else 10.0)
    rounds = args.rounds or (1 if args.quick else 3)
    available, reason = lab_available()
    if not available:
        print(f"no namespace lab here: {reason}")
        emit_result("handshake_flood", {}, {}, notes=[f"skipped: {reason}"])
        return
    notes: list[str] = []
    version, why = installed_hivemind()
    if args.no_hivemind or version is None:
        notes.append(f"hivemind skipped: {'--no-hivemind' if args.no_hivemind else why}")
    runs: dict[str, list[dict[str, float]]] = {"ours": [], "ours_no_rate": []}
    if not notes:
        runs["hivemind"] = []
    with Lab() as lab, LocalSwarm() as swarm:
        victim_host, flooder_host, honest_host = (
            lab.add_public_host(name) for name in ("victim", "flooder", "honest")
        )
        flooder, honest = swarm.start(
            2, target=TARGET, namespaces=[flooder_host.namespace, honest_host.namespace]
        )
        for proc in (flooder, honest):
            proc.wait_report("ready", REPLY_SECONDS)
        victims: dict[str, Callable[[], Any]] = {
            "ours": lambda: our_victim(swarm, victim_host, {}),
            "ours_no_rate": lambda: our_victim(swarm, victim_host, UNLIMITED),
            "hivemind": lambda: hivemind_victim(victim_host),
        }
        for _ in range(rounds):  # alternating, so a slow spell of the machine hits all
            for name, results in runs.items():
                results.append(flood_once(victims[name], flooder, honest, args))
    figures: dict[str, Any] = {"flood_seconds": args.seconds, "concurrency": args.concurrency}
    rows = [["victim", "handshakes/s", "refused/s", "CPU (cores)", "honest ping (s)"]]
    for name, results in runs.items():
        for key in results[0]:
            figures[f"{name}_{key}"] = median([r[key] for r in results])
        rows.append(
            [
                name,
                f"{figures[f'{name}_handshakes_per_s']:.1f}",
                f"{figures[f'{name}_refused_per_s']:.0f}",
                f"{figures[f'{name}_cpu_fraction']:.2f}",
                f"{figures[f'{name}_honest_ping_seconds']:.3f}",
            ]
        )
    print_table(
        f"one host floods for {args.seconds:g} s, {args.concurrency} upgrades at once "
        f"(median of {rounds})",
        rows,
    )
    ratios: dict[str, float] = {
        "flood_cpu_vs_no_rate": figures["ours_no_rate_cpu_fraction"] / figures["ours_cpu_fraction"],
    }
    if "hivemind" in runs:
        ratios["flood_cpu"] = figures["hivemind_cpu_fraction"] / figures["ours_cpu_fraction"]
        ratios["flood_handshakes_served"] = figures["hivemind_handshakes_per_s"] / max(
            figures["ours_handshakes_per_s"], 1e-9
        )
    emit_result("handshake_flood", figures, ratios, notes=notes)


if __name__ == "__main__":
    main()
