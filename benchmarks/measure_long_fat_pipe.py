"""What one TCP connection carries on a long fat pipe (issue 18, item 4): two hosts of
the namespace lab on links of ``--rate-mbit`` (200) Mbit/s, ``--one-way-ms`` (50) ms
each way, so 4x that between them (200 ms). Bulk bytes go from one host to the other
(``one``) or both ways at once (``both``: the all-reduce's pattern), moved by:

- ``threaded``: plain TCP, a blocking ``sendall`` and ``recv`` in a thread per direction;
- ``asyncio``: plain TCP on uvloop's streams (one thread, non-blocking writes and drains);
- ``ours``: one stream of our peers (TCP, Noise, yamux), one connection;
- ``ours x2``: the same bytes split over two streams on two connections (two peers).

Each kind runs with the kernel's default socket buffer maxima in each host and again
with them raised to 32 MiB (``net.ipv4.tcp_rmem``/``tcp_wmem``, in the lab's namespaces
only). Figures: MB/s per direction on a warm connection (the median of the repetitions
after the first, which pays the dial and TCP's ramp), and that rate as a fraction of the
link's payload rate (1448 of every 1514 bytes on the wire). There is no hivemind column:
this measures the transport's floor, not a system.

Needs root and nftables (the namespace lab, docs/netlab.md).

    .venv/bin/python benchmarks/measure_long_fat_pipe.py          # every row: about 4 minutes
    .venv/bin/python benchmarks/measure_long_fat_pipe.py --quick  # both ways, default buffers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import BenchError, emit_result, median, print_table

from peers.netlab import PublicHost

KINDS = ("threaded", "asyncio", "ours", "ours x2")
QUICK_KINDS = ("threaded", "ours")
#: Seconds one client (all its repetitions) may take.
CLIENT_TIMEOUT = 180.0
PORT = 7100
BIG_BUFFER_BYTES = 32 << 20
PIECE = 1 << 20


# --- the movers (run inside the lab's hosts) -------------------------------------------


def _threaded(role: str, host: str, size: int, reps: int, both: bool) -> list[float]:
    def receive(conn: socket.socket) -> None:
        got = 0
        while got < size:
            data = conn.recv(min(PIECE, size - got))
            if not data:
                raise BenchError("the other side closed early")
            got += len(data)

    def send(conn: socket.socket) -> None:
        piece = bytes(PIECE)
        for _ in range(size // PIECE):
            conn.sendall(piece)

    times = []
    if role == "serve":
        server = socket.create_server(("0.0.0.0", PORT))
        print("ready", flush=True)
        conn, _ = server.accept()
    else:
        conn = socket.create_connection((host, PORT), timeout=CLIENT_TIMEOUT)
    with conn:
        for _ in range(reps):
            started = time.perf_counter()
            # the server receives; the client sends (and each does the other too, if both)
            work = [receive if role == "serve" else send]
            if both:
                work.append(send if role == "serve" else receive)
            threads = [threading.Thread(target=w, args=(conn,)) for w in work]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if role == "serve":
                conn.sendall(b"k")  # this repetition is in
            else:
                conn.recv(1)
            times.append(time.perf_counter() - started)
    return times


async def _asyncio(role: str, host: str, size: int, reps: int, both: bool) -> list[float]:
    async def receive(reader: asyncio.StreamReader) -> None:
        got = 0
        while got < size:
            data = await reader.read(min(PIECE, size - got))
            if not data:
                raise BenchError("the other side closed early")
            got += len(data)

    async def send(writer: asyncio.StreamWriter) -> None:
        piece = bytes(PIECE)
        for _ in range(size // PIECE):
            writer.write(piece)
            await writer.drain()

    async def repetitions(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(reps):
            started = time.perf_counter()
            work = [receive(reader) if role == "serve" else send(writer)]
            if both:
                work.append(send(writer) if role == "serve" else receive(reader))
            await asyncio.gather(*work)
            if role == "serve":
                writer.write(b"k")
                await writer.drain()
            else:
                await reader.readexactly(1)
            times.append(time.perf_counter() - started)

    times: list[float] = []
    if role == "serve":
        done = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await repetitions(reader, writer)
            done.set()

        server = await asyncio.start_server(handle, "0.0.0.0", PORT)
        print("ready", flush=True)
        async with server:
            await done.wait()
    else:
        reader, writer = await asyncio.open_connection(host, PORT)
        await repetitions(reader, writer)
        writer.close()
    return times


async def _ours(
    role: str, host: str, size: int, reps: int, both: bool, connections: int, remote: str
) -> list[float]:
    from multiaddr import Multiaddr

    from peers import Peer
    from peers.config import PeerConfig
    from peers.stream_api import StreamLike

    part = size // connections

    async def receive(stream: StreamLike) -> None:
        got = 0
        while got < part:
            chunks = await stream.read_chunks(4 * PIECE)
            if not chunks:
                raise BenchError("the other side closed early")
            got += sum(len(c) for c in chunks)

    async def send(stream: StreamLike) -> None:
        piece = bytes(PIECE)
        for _ in range(part // PIECE):
            await stream.write(piece)

    protocol = "/measure/bulk/1.0.0"
    config = PeerConfig(listen_addrs=(f"/ip4/0.0.0.0/tcp/{PORT}",))
    if role == "serve":
        served = 0
        done = asyncio.Event()

        async def handle(stream: StreamLike) -> None:
            nonlocal served
            await asyncio.gather(receive(stream), *([send(stream)] if both else []))
            await stream.close()
            # The client closes once it has all we sent: until then our bytes may still
            # sit in buffers that exiting would drop (the kernel resets the connection).
            await stream.read()
            served += 1
            if served == reps * connections:
                done.set()

        async with Peer(config) as peer:
            peer.set_stream_handler(protocol, handle)
            print(f"ready {peer.peer_id}", flush=True)
            await asyncio.wait_for(done.wait(), CLIENT_TIMEOUT)
            await asyncio.sleep(0.5)  # the last FINs go out
        return []
    address = Multiaddr(f"/ip4/{host}/tcp/{PORT}/p2p/{remote}")
    times = []
    async with contextlib.AsyncExitStack() as stack:
        peers = [
            await stack.enter_async_context(Peer(PeerConfig(listen_addrs=())))
            for _ in range(connections)
        ]
        for _ in range(reps):
            streams = [await p.new_stream(address, protocol) for p in peers]
            started = time.perf_counter()
            work = [send(s) for s in streams]
            if both:
                work += [receive(s) for s in streams]
            await asyncio.gather(*work)
            for s in streams:
                await s.close()
                await s.read()  # the server's FIN: it has everything
            times.append(time.perf_counter() - started)
    return times


def mover(args: argparse.Namespace) -> None:
    """One side of one measurement; the client prints its repetitions' seconds."""
    from peers import run

    size = args.megabytes << 20
    kind = args.kind
    if kind == "threaded":
        times = _threaded(args.role, args.host, size, args.reps, args.both)
    elif kind == "asyncio":
        times = run(_asyncio(args.role, args.host, size, args.reps, args.both))
    else:
        connections = 2 if kind == "ours x2" else 1
        times = run(
            _ours(args.role, args.host, size, args.reps, args.both, connections, args.remote)
        )
    if args.role == "send":
        print(json.dumps({"seconds": times}), flush=True)


# --- the driver ------------------------------------------------------------------------


def measure(
    lab_hosts: tuple[PublicHost, PublicHost], kind: str, *, both: bool, megabytes: int, reps: int
) -> list[float]:
    server_host, client_host = lab_hosts
    script = str(Path(__file__).resolve())
    common = ["--kind", kind, "--megabytes", str(megabytes), "--reps", str(reps)]
    common += ["--both"] if both else []
    server = server_host.popen(
        [sys.executable, script, "--role", "serve", *common],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ready = server.stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise BenchError(f"{kind} server did not start")
        remote = ready[1] if len(ready) > 1 else ""
        result = client_host.run(
            [
                sys.executable,
                script,
                "--role",
                "send",
                "--host",
                server_host.address,
                "--remote",
                remote,
                *common,
            ],
            timeout=CLIENT_TIMEOUT,
        )
        return [float(s) for s in json.loads(result.stdout.strip().splitlines()[-1])["seconds"]]
    finally:
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="both ways, default buffers")
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--one-way-ms", type=float, default=50.0)
    parser.add_argument("--megabytes", type=int, help="MiB per direction per repetition (32)")
    parser.add_argument("--reps", type=int, help="repetitions, the first untimed (5; --quick 3)")
    parser.add_argument("--role", choices=("serve", "send"), help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--remote", default="", help=argparse.SUPPRESS)
    parser.add_argument("--both", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    megabytes = 32 if args.megabytes is None else args.megabytes
    reps = (3 if args.quick else 5) if args.reps is None else args.reps
    if args.role is not None:
        args.megabytes, args.reps = megabytes, reps
        mover(args)
        return 0
    if reps < 2:
        parser.error(f"--reps {reps}: the first repetition is untimed; give at least 2")
    if megabytes < 1:
        parser.error(f"--megabytes {megabytes}: give at least 1 (MiB per direction)")
    if not args.rate_mbit > 0 or not args.one_way_ms >= 0:
        parser.error(
            f"--rate-mbit {args.rate_mbit:g} --one-way-ms {args.one_way_ms:g}: give a rate"
            " above 0 and a delay of at least 0"
        )
    from peers.netlab import Lab, lab_available

    available, reason = lab_available()
    if not available:
        print(f"no namespace lab here: {reason}")
        emit_result("long_fat_pipe", {}, {}, skipped=reason)
        return 0
    kinds = QUICK_KINDS if args.quick else KINDS
    directions = (True,) if args.quick else (False, True)
    buffers = (None,) if args.quick else (None, BIG_BUFFER_BYTES)
    link_mb_per_s = args.rate_mbit / 8 * 1448 / 1514
    rtt = 4 * args.one_way_ms
    print(
        f"long fat pipe: {args.rate_mbit:g} Mbit/s links, {rtt:g} ms round trip"
        f" ({link_mb_per_s:.1f} MB/s of payload each way); {megabytes} MiB per direction,"
        f" {reps} repetitions (the first untimed)"
    )
    figures: dict[str, float] = {}
    rows = [["buffers", "direction", "kind", "MB/s each way", "fraction of link"]]
    for buffer in buffers:
        with Lab() as lab:
            hosts = (lab.add_public_host("a"), lab.add_public_host("b"))
            for host in hosts:
                lab.shape(host, rate_mbit=args.rate_mbit)
                lab.delay(host, one_way_ms=args.one_way_ms)
                if buffer is not None:
                    host.run(
                        [
                            "sysctl",
                            "-q",
                            "-w",
                            f"net.ipv4.tcp_rmem=4096 131072 {buffer}",
                            f"net.ipv4.tcp_wmem=4096 16384 {buffer}",
                        ]
                    )
            for both in directions:
                for kind in kinds:
                    seconds = measure(hosts, kind, both=both, megabytes=megabytes, reps=reps)
                    rate = (megabytes << 20) / 1e6 / median(seconds[1:])
                    name = (
                        f"{'big' if buffer else 'default'}_buffers_{'both' if both else 'one'}"
                        f"_{kind.replace(' ', '_')}"
                    )
                    figures[f"{name}_MB_per_s"] = round(rate, 2)
                    rows.append(
                        [
                            "32 MiB" if buffer else "default",
                            "both ways" if both else "one way",
                            kind,
                            f"{rate:.1f}",
                            f"{rate / link_mb_per_s:.2f}",
                        ]
                    )
                    print(f"  {rows[-1]}", flush=True)
    print_table("MB/s per direction on a warm connection (medians)", rows)
    ratios: dict[str, float] = {}
    for setting in ("default", "big"):
        for direction in ("one", "both"):
            key = f"{setting}_buffers_{direction}"
            ours = figures.get(f"{key}_ours_MB_per_s")
            if ours is None:
                continue
            ratios[f"{key}_ours_fraction_of_link"] = round(ours / link_mb_per_s, 3)
            threaded = figures.get(f"{key}_threaded_MB_per_s")
            if threaded:
                ratios[f"{key}_ours_vs_threaded_tcp"] = round(ours / threaded, 3)
            pair = figures.get(f"{key}_ours_x2_MB_per_s")
            if pair:
                ratios[f"{key}_two_connections_vs_one"] = round(pair / ours, 3)
    emit_result("long_fat_pipe", figures, ratios, rtt_ms=rtt, rate_mbit=args.rate_mbit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
