"""Transport benchmark: ours (``peers``) against hivemind (Go ``p2pd``) and raw TCP.

Everything runs on 127.0.0.1, each measurement between two separate OS processes (a
server and a client, started with multiprocessing's ``spawn`` context):

1. unary latency: a 100-byte request echoed, p50 and p95 over a few hundred calls after
   a warm-up. Ours: ``Peer.call_unary`` to the built-in echo service. Hivemind:
   ``P2P.call_protobuf_handler`` to a protobuf handler echoing a ``runtime_pb2.Tensor``.
2. bulk throughput: one float32 array (256 MiB; 64 MiB with ``--quick``) sent over ONE
   streaming call in chunks, acknowledged by the server at the end. Ours:
   ``Peer.call_stream`` with numpy chunks; hivemind: ``serialize_torch_tensor`` +
   ``split_for_streaming`` into a ``stream_input`` protobuf handler, the way its
   averager and MoE client move tensors. Serialization is inside the timed span for
   both: it is part of moving a tensor. Ours is also measured in a private network
   (``ours_pnet``: both peers with one swarm key, every byte XSalsa20-encrypted under
   Noise as well, :mod:`peers.pnet`); p2pd has no private networks to compare with.
3. the physical limit: the same bytes over a plain TCP socket pair (``sendall`` /
   ``recv_into``) between two processes.
4. start-up: from just before ``Popen`` to the line printing a dialable multiaddr. Ours:
   ``swarm bootstrap``; hivemind: ``P2P.create`` + ``get_visible_maddrs`` in
   ``python -c``, and the ``hivemind-dht`` command.

Systems alternate within each repetition (rotating the order), so slow drift on a
noisy machine hits all of them alike. Servers live for the whole run; every repetition
uses a fresh client process, since a process's throughput depends on its allocator's
history. Every figure is the median over repetitions (bulk also reports min and max).
The run ends with one JSON line; ratios are oriented so that > 1 means we are better.

    .venv/bin/python benchmarks/bench_transport.py --quick   # under a minute
    .venv/bin/python benchmarks/bench_transport.py           # full, a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import (
    BenchError,
    LineReader,
    descendants,
    emit_result,
    importable_hivemind,
    median,
    percentile,
    print_table,
    receive_from,
    stop_pids,
)
from _common import (
    PipeChild as Child,
)
from _transport_peers import (
    BULK_TIMEOUT,
    CHILD_STOP_GRACE,
    LOOPBACK_LISTEN,
    MB,
    MIB,
    UNARY_BATCH_TIMEOUT,
    _child_entry,
)

#: Seconds a spawned child has to import its stack (torch, for hivemind) and listen;
#: generous because two cores may be starting several interpreters at once.
CHILD_STARTUP_TIMEOUT = 90.0
#: Seconds a start-up command has to print its multiaddr.
STARTUP_TIMEOUT = 60.0
ADDR_PATTERN = re.compile(r"/ip4/127\.0\.0\.1/tcp/(\d+)/p2p/(\w+)")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How much to measure."""

    num_unary_calls: int
    """Timed unary calls per repetition."""
    num_unary_warmup: int
    """Untimed unary calls before each repetition's timed ones."""
    unary_bytes: int = 100
    """Request (and echoed reply) payload size."""
    bulk_bytes: int
    """Bytes in the one array of a bulk transfer."""
    chunk_bytes: int = 1 * MIB
    """Bytes per streamed chunk (hivemind's MoE uses 4 MiB, its averager 64 KiB)."""
    warmup_bulk_bytes: int = 16 * MIB
    """One untimed transfer per system first (allocator, windows, caches)."""
    num_reps: int
    """Repetitions of each transfer measurement; figures are medians over them."""
    num_startup_reps: int
    """Start-ups of ours and of hivemind's ``P2P``."""
    num_dht_startup_reps: int
    """Start-ups of ``hivemind-dht`` (0 to skip)."""


QUICK = Plan(
    num_unary_calls=100,
    num_unary_warmup=20,
    bulk_bytes=64 * MIB,
    num_reps=3,
    num_startup_reps=3,
    num_dht_startup_reps=1,
)
FULL = Plan(
    num_unary_calls=300,
    num_unary_warmup=50,
    bulk_bytes=256 * MIB,
    num_reps=5,
    num_startup_reps=7,
    num_dht_startup_reps=3,
)


# --- the parent side ------------------------------------------------------------------


class Fleet:
    """Every child this run started, and the daemons they started; stops each by PID."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.children: list[Child] = []

    def start(self, role: str, options: dict[str, Any] | None = None) -> Child:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_child_entry, args=(role, theirs, options or {}), name=role, daemon=True
        )
        process.start()
        theirs.close()
        child = Child(role, process, ours)
        self.children.append(child)
        return child

    def receive(self, child: Child, timeout: float) -> Any:
        """The child's next answer; :class:`BenchError` if it fails, dies or is late."""
        return receive_from(child, timeout)

    def request(self, child: Child, kind: str, options: dict[str, Any], timeout: float) -> Any:
        child.conn.send((kind, options))
        return self.receive(child, timeout)

    def stop(self, children: list[Child]) -> None:
        """Ask ``children`` to stop; terminate, then kill, those that do not (by PID)."""
        trees = {id(c): descendants(c.process.pid) for c in children if c.process.pid}
        for child in children:
            with contextlib.suppress(OSError, ValueError):
                child.conn.send(("stop", None))
        deadline = time.monotonic() + CHILD_STOP_GRACE
        for child in children:
            child.process.join(max(0.0, deadline - time.monotonic()))
        for child in children:
            if child.process.is_alive():
                child.process.terminate()
                child.process.join(5.0)
            if child.process.is_alive():
                child.process.kill()
                child.process.join(5.0)
            with contextlib.suppress(OSError):
                child.conn.close()
            stop_pids(trees.get(id(child), []))
            stop_pids(child.daemon_pids, expect_in_command="p2pd")
            if child in self.children:
                self.children.remove(child)

    def close(self) -> None:
        self.stop(list(self.children))


@dataclass
class TransferResults:
    unary_p50_s: dict[str, list[float]]
    unary_p95_s: dict[str, list[float]]
    bulk_s: dict[str, list[float]]


def _start_server(fleet: Fleet, system: str) -> dict[str, Any]:
    """Start ``system``'s server; return the options its clients need to reach it.
    ``ours_pnet`` is ours in a private network (every byte also XSalsa20-encrypted
    under a swarm key, :mod:`peers.pnet`)."""
    key = {"swarm_key": os.urandom(32).hex()} if system == "ours_pnet" else {}
    server = fleet.start(f"{_role(system)}_server", key)
    ready = fleet.receive(server, CHILD_STARTUP_TIMEOUT)
    if system == "raw":
        return {"port": ready["port"]}
    return {"server_addr": ready["addrs"][0], **key}


def _role(system: str) -> str:
    return "ours" if system == "ours_pnet" else system


def _measure_client(
    fleet: Fleet, plan: Plan, system: str, server: dict[str, Any], results: TransferResults
) -> str:
    """One repetition with a fresh client process: warm-up, unary batch, bulk transfer.

    Fresh per repetition because a process's bulk throughput can depend on its history
    (ours varies ~3x between processes with glibc's heap trimming): one long-lived
    client would sample that only once.
    """
    client = fleet.start(f"{_role(system)}_client", server)
    try:
        fleet.receive(client, CHILD_STARTUP_TIMEOUT)
        bulk = {"bytes": plan.bulk_bytes, "chunk_bytes": plan.chunk_bytes}
        warmup = dict(bulk, bytes=min(plan.warmup_bulk_bytes, plan.bulk_bytes))
        fleet.request(client, "bulk", warmup, BULK_TIMEOUT + 15)
        line = ""
        if system != "raw":
            unary = {
                "bytes": plan.unary_bytes,
                "calls": plan.num_unary_calls,
                "warmup": plan.num_unary_warmup,
            }
            latencies = fleet.request(client, "unary", unary, UNARY_BATCH_TIMEOUT + 15)
            p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
            results.unary_p50_s.setdefault(system, []).append(p50)
            results.unary_p95_s.setdefault(system, []).append(p95)
            line += f" unary p50 {p50 * 1e3:.3f} ms p95 {p95 * 1e3:.3f} ms;"
        seconds = fleet.request(client, "bulk", bulk, BULK_TIMEOUT + 15)
        results.bulk_s.setdefault(system, []).append(seconds)
        return line + f" bulk {plan.bulk_bytes / seconds / MB:.1f} MB/s"
    finally:
        fleet.stop([client])


def measure_transfers(plan: Plan, systems: list[str], notes: list[str]) -> TransferResults:
    """Unary latency and bulk throughput of each system, alternating within repetitions.

    Servers live for the whole run; each repetition starts a fresh client per system.
    A hivemind failure drops hivemind (with a note) and keeps measuring the rest.
    """
    results = TransferResults({}, {}, {})
    fleet = Fleet()
    try:
        servers: dict[str, dict[str, Any]] = {}
        for system in systems:
            try:
                servers[system] = _start_server(fleet, system)
            except BenchError as e:
                if system != "hivemind":
                    raise
                notes.append(f"hivemind could not start: {e}")
                print(f"hivemind could not start, measuring without it: {e}", file=sys.stderr)
        order = list(servers)
        for rep in range(plan.num_reps):
            shift = rep % len(order)
            for system in order[shift:] + order[:shift]:
                if system not in servers:
                    continue
                try:
                    line = _measure_client(fleet, plan, system, servers[system], results)
                except BenchError as e:
                    if system != "hivemind":
                        raise
                    notes.append(f"hivemind failed in repetition {rep + 1}; dropped: {e}")
                    print(f"hivemind failed, measuring without it: {e}", file=sys.stderr)
                    del servers[system]
                    continue
                print(f"  rep {rep + 1}/{plan.num_reps} {system:>8}:{line}", flush=True)
    finally:
        fleet.close()
    return results


# --- start-up -------------------------------------------------------------------------


def _script(name: str) -> Path | None:
    path = Path(sys.executable).parent / name
    return path if path.exists() else None


_HIVEMIND_P2P_SCRIPT = """
import asyncio, sys
from hivemind.p2p import P2P
async def main():
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    for maddr in await p2p.get_visible_maddrs():
        print(maddr, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await p2p.shutdown()
asyncio.run(main())
"""


def startup_command(system: str) -> list[str]:
    if system == "ours":
        swarm = _script("swarm")
        base = [str(swarm)] if swarm else [sys.executable, "-m", "swarm.cli"]
        return [*base, "bootstrap", "--listen", LOOPBACK_LISTEN]
    if system == "hivemind_p2p":
        return [sys.executable, "-c", _HIVEMIND_P2P_SCRIPT]
    dht = _script("hivemind-dht")
    base = [str(dht)] if dht else [sys.executable, "-m", "hivemind.hivemind_cli.run_dht"]
    return [*base, "--host_maddrs", LOOPBACK_LISTEN]


def measure_startup(system: str) -> float:
    """Seconds from just before ``Popen`` to a printed multiaddr that accepts TCP."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    command = startup_command(system)
    start = time.perf_counter()
    popen = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    tree: list[int] = []
    try:
        reader = LineReader(popen.stdout)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for _ in range(10_000):
            arrived, line = reader.next_line(deadline)
            match = ADDR_PATTERN.search(line)
            if match:
                break
        else:
            raise BenchError(f"{system} printed no multiaddr")
        elapsed = arrived - start
        # Check the address is real (outside the timed span).
        with socket.create_connection(("127.0.0.1", int(match.group(1))), timeout=5.0):
            pass
        tree = descendants(popen.pid)
        # Ask politely first: ours and hivemind-dht stop on SIGTERM, the P2P script on EOF.
        if system == "hivemind_p2p":
            assert popen.stdin is not None
            popen.stdin.close()
        else:
            popen.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(CHILD_STOP_GRACE)
        return elapsed
    finally:
        tree = tree or descendants(popen.pid)
        if popen.poll() is None:
            popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(5.0)
        stop_pids(tree)
        for pipe in (popen.stdin, popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def measure_startups(plan: Plan, hivemind: bool, notes: list[str]) -> dict[str, list[float]]:
    systems = ["ours", "hivemind_p2p"] if hivemind else ["ours"]
    results: dict[str, list[float]] = {}
    for rep in range(plan.num_startup_reps):
        shift = rep % len(systems)
        for system in systems[shift:] + systems[:shift]:
            try:
                seconds = measure_startup(system)
            except (BenchError, OSError) as e:
                if system == "ours":
                    raise
                notes.append(f"{system} start-up failed: {e}")
                systems.remove(system)
                continue
            results.setdefault(system, []).append(seconds)
            print(f"  start-up {rep + 1}/{plan.num_startup_reps} {system}: {seconds:.3f} s")
    if hivemind:
        for rep in range(plan.num_dht_startup_reps):
            try:
                seconds = measure_startup("hivemind_dht")
            except (BenchError, OSError) as e:
                notes.append(f"hivemind-dht start-up failed: {e}")
                break
            results.setdefault("hivemind_dht", []).append(seconds)
            print(f"  start-up {rep + 1}/{plan.num_dht_startup_reps} hivemind-dht: {seconds:.3f} s")
    return results


# --- main -----------------------------------------------------------------------------


def _ms(values: list[float] | None) -> str:
    return f"{median(values) * 1e3:.3f}" if values else "-"


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced run, under a minute")
    parser.add_argument("--no-hivemind", action="store_true", help="measure ours only")
    parser.add_argument("--bulk-mib", type=int, help="bulk array size in MiB")
    parser.add_argument("--chunk-mib", type=float, help="bulk chunk size in MiB (default 1)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.bulk_mib:
        plan = replace(plan, bulk_bytes=args.bulk_mib * MIB)
    if args.chunk_mib:
        plan = replace(plan, chunk_bytes=int(args.chunk_mib * MIB) // 4 * 4)

    notes: list[str] = []
    version, why = (
        (None, "disabled with --no-hivemind")
        if args.no_hivemind
        else importable_hivemind("hivemind.p2p", CHILD_STARTUP_TIMEOUT)
    )
    if version is None:
        notes.append(why)
        print(f"hivemind: not measured: {why}", file=sys.stderr)
    mode = "quick" if args.quick else "full"
    print(
        f"transport benchmark ({mode}): loopback, 2 processes per measurement, "
        f"{os.cpu_count()} CPUs; hivemind {version or 'absent'}"
    )
    began = time.monotonic()
    systems = ["ours", "ours_pnet", "hivemind", "raw"] if version else ["ours", "ours_pnet", "raw"]
    transfers = measure_transfers(plan, systems, notes)
    startups = measure_startups(plan, "hivemind" in transfers.bulk_s, notes)
    total_s = time.monotonic() - began

    def mbps(system: str) -> float | None:
        seconds = transfers.bulk_s.get(system)
        return plan.bulk_bytes / median(seconds) / MB if seconds else None

    def med(table: dict[str, list[float]], system: str) -> float | None:
        return median(table[system]) if table.get(system) else None

    figures: dict[str, Any] = {}
    for system in ("ours", "ours_pnet", "hivemind"):
        for name, table in (("p50", transfers.unary_p50_s), ("p95", transfers.unary_p95_s)):
            value = med(table, system)
            figures[f"unary_{name}_ms_{system}"] = round(value * 1e3, 4) if value else None
    spreads: dict[str, str] = {}
    labels = (
        ("ours", "ours"),
        ("ours_pnet", "ours_pnet"),
        ("hivemind", "hivemind"),
        ("raw", "raw_tcp"),
    )
    for system, label in labels:
        value = mbps(system)
        figures[f"bulk_MBps_{label}"] = round(value, 1) if value else None
        if transfers.bulk_s.get(system):
            low = plan.bulk_bytes / max(transfers.bulk_s[system]) / MB
            high = plan.bulk_bytes / min(transfers.bulk_s[system]) / MB
            figures[f"bulk_MBps_{label}_min"] = round(low, 1)
            figures[f"bulk_MBps_{label}_max"] = round(high, 1)
            spreads[system] = f"{low:.0f}-{high:.0f}"
    for system in ("ours", "hivemind_p2p", "hivemind_dht"):
        value = med(startups, system)
        figures[f"startup_s_{system}"] = round(value, 4) if value else None
    figures["bulk_fraction_of_raw_tcp_hivemind"] = _ratio(mbps("hivemind"), mbps("raw"))
    figures = {k: v for k, v in figures.items() if v is not None}

    ratios = {
        "unary_latency_p50": _ratio(
            med(transfers.unary_p50_s, "hivemind"), med(transfers.unary_p50_s, "ours")
        ),
        "unary_latency_p95": _ratio(
            med(transfers.unary_p95_s, "hivemind"), med(transfers.unary_p95_s, "ours")
        ),
        "bulk_throughput": _ratio(mbps("ours"), mbps("hivemind")),
        "bulk_ours_fraction_of_raw_tcp": _ratio(mbps("ours"), mbps("raw")),
        "bulk_private_network_throughput": _ratio(mbps("ours_pnet"), mbps("hivemind")),
        "bulk_private_network_fraction_of_open": _ratio(mbps("ours_pnet"), mbps("ours")),
        "bootstrap_startup": _ratio(med(startups, "hivemind_p2p"), med(startups, "ours")),
        "bootstrap_startup_vs_hivemind_dht": _ratio(
            med(startups, "hivemind_dht"), med(startups, "ours")
        ),
    }
    ratios = {k: v for k, v in ratios.items() if v is not None}

    def fig(key: str, fmt: str = "{:.1f}") -> str:
        return fmt.format(figures[key]) if key in figures else "-"

    def rat(key: str) -> str:
        return f"{ratios[key]:.2f}x" if key in ratios else "-"

    reps = plan.num_reps
    print_table(
        f"medians over {reps} reps; MB = 10^6 bytes; ratio > 1 means ours is better",
        [
            ["measurement", "ours", "hivemind", "raw TCP", "ratio"],
            [
                f"unary {plan.unary_bytes} B echo p50 (ms)",
                _ms(transfers.unary_p50_s.get("ours")),
                _ms(transfers.unary_p50_s.get("hivemind")),
                "",
                rat("unary_latency_p50"),
            ],
            [
                f"unary {plan.unary_bytes} B echo p95 (ms)",
                _ms(transfers.unary_p95_s.get("ours")),
                _ms(transfers.unary_p95_s.get("hivemind")),
                "",
                rat("unary_latency_p95"),
            ],
            [
                f"bulk {plan.bulk_bytes // MIB} MiB, {plan.chunk_bytes / MIB:g} MiB chunks (MB/s)",
                fig("bulk_MBps_ours"),
                fig("bulk_MBps_hivemind"),
                fig("bulk_MBps_raw_tcp"),
                rat("bulk_throughput"),
            ],
            [
                "bulk, ours in a private network (swarm key)",
                fig("bulk_MBps_ours_pnet"),
                fig("bulk_MBps_hivemind"),
                "",
                rat("bulk_private_network_throughput"),
            ],
            [
                "  range over reps (MB/s)",
                spreads.get("ours", "-"),
                spreads.get("hivemind", "-"),
                spreads.get("raw", "-"),
                "",
            ],
            [
                "bulk as a fraction of raw TCP",
                rat("bulk_ours_fraction_of_raw_tcp").rstrip("x"),
                fig("bulk_fraction_of_raw_tcp_hivemind", "{:.2f}"),
                "1.00",
                "",
            ],
            [
                "start-up to dialable maddr (s), P2P",
                fig("startup_s_ours", "{:.3f}"),
                fig("startup_s_hivemind_p2p", "{:.3f}"),
                "",
                rat("bootstrap_startup"),
            ],
            [
                "start-up (s), hivemind-dht command",
                fig("startup_s_ours", "{:.3f}"),
                fig("startup_s_hivemind_dht", "{:.3f}"),
                "",
                rat("bootstrap_startup_vs_hivemind_dht"),
            ],
        ],
    )
    for note in notes:
        print(f"note: {note}")
    print(f"total {total_s:.1f} s")
    emit_result(
        "transport",
        figures,
        ratios,
        mode=mode,
        hivemind=version,
        notes=notes,
        plan=asdict(plan),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
