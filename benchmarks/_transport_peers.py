"""The child processes of ``bench_transport.py``: our, hivemind's and raw-TCP servers
and clients, each started with multiprocessing's ``spawn`` context and driven by commands
on its pipe (``ROLES`` maps a role name to its entry point; ``_child_entry`` runs one)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import (
    BenchError,
    run_role,
)

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
SINK_PROTOCOL = "/swarmtrain/bench-sink/1.0.0"
HIVEMIND_ECHO = "bench_echo"
HIVEMIND_SINK = "bench_sink"
MIB = 1024 * 1024
#: Throughput unit: 10^6 bytes per second.
MB = 1_000_000

#: Seconds one RPC may take before the run is declared broken.
CALL_TIMEOUT = 10.0
#: Seconds for a whole batch of unary calls.
UNARY_BATCH_TIMEOUT = 120.0
#: Seconds for one bulk transfer (256 MiB at a miserable 5 MB/s would be 54 s).
BULK_TIMEOUT = 120.0
#: Seconds a child lives at most: it exits by itself if the parent forgets it.
CHILD_LIFETIME = 900.0
#: Seconds a stopped child (hivemind shuts its daemon down) gets before SIGTERM.
CHILD_STOP_GRACE = 15.0
#: Most bulk transfers a raw TCP server accepts on one connection, and most connections.
MAX_RAW_TRANSFERS = 1000
MAX_RAW_CLIENTS = 1000
#: Most commands a child answers before it stops by itself.
MAX_CHILD_COMMANDS = 10_000


# --- the child side -------------------------------------------------------------------

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


def _child_entry(role: str, conn: Connection, options: dict[str, Any]) -> None:
    """Entry point of every spawned child: run ``role``, report a failure on the pipe."""
    run_role(ROLES, role, conn, options)


def _run_fast_loop(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run`` on uvloop where installed (ours and hivemind's DHT both use it)."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


async def _recv_command(conn: Connection, deadline: float) -> tuple[str, Any] | None:
    """The parent's next command, or ``None`` at EOF (the parent is gone) or the deadline."""
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(conn.fileno(), readable.set)
    try:
        async with asyncio.timeout_at(deadline):
            await readable.wait()
    except TimeoutError:
        return None
    finally:
        loop.remove_reader(conn.fileno())
    try:
        message: tuple[str, Any] = conn.recv()
    except (EOFError, OSError):
        return None
    return message


async def _serve_commands(conn: Connection, handlers: dict[str, Handler]) -> None:
    """Answer the parent's commands until it says stop, goes away, or time runs out."""
    deadline = asyncio.get_running_loop().time() + CHILD_LIFETIME
    for _ in range(MAX_CHILD_COMMANDS):
        message = await _recv_command(conn, deadline)
        if message is None or message[0] == "stop":
            return
        kind, options = message
        try:
            result = await handlers[kind](options)
        except Exception:
            conn.send(("error", traceback.format_exc()))
        else:
            conn.send(("ok", result))


async def _time_calls(call: Callable[[], Awaitable[None]], options: dict[str, Any]) -> list[float]:
    """Seconds per call of ``call``, after ``warmup`` untimed ones; bounded in time."""
    async with asyncio.timeout(UNARY_BATCH_TIMEOUT):
        for _ in range(options["warmup"]):
            await call()
        latencies = []
        for _ in range(options["calls"]):
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)
    return latencies


_ARRAYS: dict[int, Any] = {}


def _bulk_array(num_bytes: int) -> Any:
    """The float32 array to send, made once per size per process."""
    if num_bytes not in _ARRAYS:
        import numpy as np

        _ARRAYS.clear()
        _ARRAYS[num_bytes] = np.random.default_rng(0).random(num_bytes // 4, dtype=np.float32)
    return _ARRAYS[num_bytes]


def _swarm_key(options: dict[str, Any]) -> bytes | None:
    """The private network's key (``ours_pnet``), or None."""
    key = options.get("swarm_key")
    return bytes.fromhex(key) if key else None


def _ours_server(conn: Connection, options: dict[str, Any]) -> None:
    from collections.abc import AsyncIterator

    import numpy as np

    from peers import Peer, PeerConfig, run
    from peers.echo import install_echo
    from peers.rpc import CallContext

    async def sink(requests: AsyncIterator[np.ndarray], context: CallContext) -> AsyncIterator[int]:
        total = 0
        async for array in requests:
            total += array.nbytes
        yield total

    async def main() -> None:
        config = PeerConfig(listen_addrs=(LOOPBACK_LISTEN,), swarm_key=_swarm_key(options))
        async with Peer(config) as peer:
            install_echo(peer)
            peer.add_stream_handler(SINK_PROTOCOL, sink, np.ndarray)
            conn.send(("ready", {"addrs": [str(a) for a in peer.listen_addrs]}))
            await _serve_commands(conn, {})

    run(main())


def _ours_client(conn: Connection, options: dict[str, Any]) -> None:
    from peers import Peer, PeerConfig, run
    from peers.echo import ECHO_PROTOCOL_ID

    async def main() -> None:
        async with Peer(PeerConfig(listen_addrs=(), swarm_key=_swarm_key(options))) as peer:
            async with asyncio.timeout(CALL_TIMEOUT):
                remote = await peer.connect(options["server_addr"])

            async def unary(o: dict[str, Any]) -> list[float]:
                payload = "x" * o["bytes"]

                async def call() -> None:
                    reply = await peer.call_unary(
                        remote, ECHO_PROTOCOL_ID, payload, str, timeout=CALL_TIMEOUT
                    )
                    if reply != payload:
                        raise BenchError("echo returned something else")

                return await _time_calls(call, o)

            async def bulk(o: dict[str, Any]) -> float:
                array = _bulk_array(o["bytes"])
                step = o["chunk_bytes"] // array.itemsize
                start = time.perf_counter()
                chunks = (array[i : i + step] for i in range(0, array.size, step))
                acks = [
                    ack
                    async for ack in peer.call_stream(
                        remote, SINK_PROTOCOL, chunks, int, timeout=BULK_TIMEOUT
                    )
                ]
                elapsed = time.perf_counter() - start
                if acks != [array.nbytes]:
                    raise BenchError(f"server acknowledged {acks}, expected [{array.nbytes}]")
                return elapsed

            conn.send(("ready", {}))
            await _serve_commands(conn, {"unary": unary, "bulk": bulk})

    run(main())


def _quiet_hivemind() -> None:
    # Benchmark children need no INFO chatter from hivemind or its daemon.
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")


def _hivemind_server(conn: Connection, options: dict[str, Any]) -> None:
    _quiet_hivemind()
    from collections.abc import AsyncIterator

    from hivemind.p2p import P2P, P2PContext
    from hivemind.proto import runtime_pb2, test_pb2

    async def echo(request: runtime_pb2.Tensor, context: P2PContext) -> runtime_pb2.Tensor:
        return request

    async def sink(
        requests: AsyncIterator[runtime_pb2.Tensor], context: P2PContext
    ) -> test_pb2.TestResponse:
        total = 0
        async for part in requests:
            total += len(part.buffer)
        return test_pb2.TestResponse(number=total // 1024)

    async def main() -> None:
        p2p = await P2P.create(host_maddrs=[LOOPBACK_LISTEN])
        try:
            conn.send(("pids", [p2p._child.pid]))
            await p2p.add_protobuf_handler(HIVEMIND_ECHO, echo, runtime_pb2.Tensor)
            await p2p.add_protobuf_handler(
                HIVEMIND_SINK, sink, runtime_pb2.Tensor, stream_input=True
            )
            maddrs = await p2p.get_visible_maddrs()
            conn.send(("ready", {"addrs": [str(m) for m in maddrs]}))
            await _serve_commands(conn, {})
        finally:
            await asyncio.wait_for(p2p.shutdown(), CHILD_STOP_GRACE / 2)

    _run_fast_loop(main())


def _hivemind_client(conn: Connection, options: dict[str, Any]) -> None:
    _quiet_hivemind()
    import torch
    from hivemind.compression import serialize_torch_tensor
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import runtime_pb2, test_pb2
    from hivemind.utils.streaming import split_for_streaming

    server_addr: str = options["server_addr"]
    server_id = PeerID.from_base58(server_addr.rsplit("/p2p/", 1)[1])

    async def main() -> None:
        p2p = await P2P.create(host_maddrs=[LOOPBACK_LISTEN], initial_peers=[server_addr])
        try:
            conn.send(("pids", [p2p._child.pid]))

            async def unary(o: dict[str, Any]) -> list[float]:
                request = runtime_pb2.Tensor(buffer=b"x" * o["bytes"])

                async def call() -> None:
                    reply = await asyncio.wait_for(
                        p2p.call_protobuf_handler(
                            server_id, HIVEMIND_ECHO, request, runtime_pb2.Tensor
                        ),
                        CALL_TIMEOUT,
                    )
                    if reply.buffer != request.buffer:
                        raise BenchError("echo returned something else")

                return await _time_calls(call, o)

            async def bulk(o: dict[str, Any]) -> float:
                tensor = torch.from_numpy(_bulk_array(o["bytes"]))
                start = time.perf_counter()
                serialized = serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)

                async def parts() -> Any:
                    for part in split_for_streaming(serialized, o["chunk_bytes"]):
                        yield part

                ack = await asyncio.wait_for(
                    p2p.call_protobuf_handler(
                        server_id, HIVEMIND_SINK, parts(), test_pb2.TestResponse
                    ),
                    BULK_TIMEOUT,
                )
                elapsed = time.perf_counter() - start
                if ack.number != o["bytes"] // 1024:
                    raise BenchError(f"server acknowledged {ack.number} KiB of {o['bytes']} B")
                return elapsed

            conn.send(("ready", {}))
            await _serve_commands(conn, {"unary": unary, "bulk": bulk})
        finally:
            await asyncio.wait_for(p2p.shutdown(), CHILD_STOP_GRACE / 2)

    _run_fast_loop(main())


def _recv_exactly(sock: socket.socket, num_bytes: int) -> bytes | None:
    """``num_bytes`` bytes, or ``None`` at a clean EOF before the first byte."""
    data = bytearray()
    while len(data) < num_bytes:
        got = sock.recv(num_bytes - len(data))
        if not got:
            if data:
                raise ConnectionError("connection ended in the middle of a header")
            return None
        data += got
    return bytes(data)


def _raw_server(conn: Connection, options: dict[str, Any]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(CHILD_LIFETIME)
        conn.send(("ready", {"port": server.getsockname()[1]}))
        buffer = memoryview(bytearray(4 * MIB))
        for _ in range(MAX_RAW_CLIENTS):  # one connection per client process, in turn
            sock, _ = server.accept()
            with sock:
                _raw_serve_connection(sock, buffer)


def _raw_serve_connection(sock: socket.socket, buffer: memoryview) -> None:
    sock.settimeout(BULK_TIMEOUT)
    for _ in range(MAX_RAW_TRANSFERS):
        header = _recv_exactly(sock, 8)
        if header is None:
            return
        remaining = int.from_bytes(header, "big")
        while remaining:
            got = sock.recv_into(buffer[: min(remaining, len(buffer))])
            if not got:
                raise ConnectionError("client left in the middle of a transfer")
            remaining -= got
        sock.sendall(b"\x01")


def _raw_client(conn: Connection, options: dict[str, Any]) -> None:
    sock = socket.create_connection(("127.0.0.1", options["port"]), timeout=CALL_TIMEOUT)
    sock.settimeout(BULK_TIMEOUT)

    async def bulk(o: dict[str, Any]) -> float:
        data = memoryview(_bulk_array(o["bytes"])).cast("B")
        start = time.perf_counter()
        sock.sendall(len(data).to_bytes(8, "big"))
        sock.sendall(data)
        if sock.recv(1) != b"\x01":
            raise BenchError("raw TCP server did not acknowledge")
        return time.perf_counter() - start

    async def main() -> None:
        conn.send(("ready", {}))
        await _serve_commands(conn, {"bulk": bulk})

    with sock:
        asyncio.run(main())


ROLES: dict[str, Callable[[Connection, dict[str, Any]], None]] = {
    "ours_server": _ours_server,
    "ours_client": _ours_client,
    "hivemind_server": _hivemind_server,
    "hivemind_client": _hivemind_client,
    "raw_server": _raw_server,
    "raw_client": _raw_client,
}
