"""A py-libp2p node for interop tests, run with ``.venv-libp2p/bin/python`` (never imported).

py-libp2p (PyPI ``libp2p``) lives in its own virtual environment: it pins trio and
protobuf versions that may conflict with the main venv's. So this script is the only
code that imports it, and it talks to the test through a pipe:

* stdout carries one JSON object per line (``{"event": ...}``), nothing else;
* stdin is a lifeline: when the test closes it (or dies), the node exits;
* SIGTERM and ``--max-seconds`` also end it, and a watchdog thread hard-exits if a
  graceful shutdown does not finish in time.

The node listens on ``/ip4/127.0.0.1/tcp/0`` with Noise (``/noise``) and yamux
(``/yamux/1.0.0``) only, the pair swarmtrain's ``peers`` speaks, and serves ping,
identify and an echo protocol (every byte read is written back; EOF closes the stream).

With ``--dial ADDR`` it then dials ADDR (ending in ``/p2p/ID``), identifies the remote,
sends ``--payload-bytes`` bytes on ``--protocol`` and reads the reply to EOF, then pings
the remote. Each step reports an event, or an ``error`` event naming the step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.ping import PingService
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL_ID
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.utils.varint import read_length_prefixed_protobuf

ECHO_PROTOCOL = TProtocol("/swarmtrain/interop-echo/1.0.0")
LISTEN_ADDR = "/ip4/127.0.0.1/tcp/0"
#: Bytes asked of a stream per read; py-libp2p's yamux returns what is buffered.
READ_CHUNK_BYTES = 64 * 1024
#: Seconds the watchdog grants a graceful shutdown after the deadline.
SHUTDOWN_GRACE_SECONDS = 10.0
#: Seconds each dial-side step may take.
STEP_TIMEOUT_SECONDS = 12.0


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def payload_of(num_bytes: int) -> bytes:
    """A recognisable payload: a header line, a byte pattern, a final newline (so a
    handler that reads to a newline, as the go-libp2p interop test's does, also works)."""
    head = b"hello from py-libp2p "
    body_len = max(0, num_bytes - len(head) - 1)
    body = bytes(i % 251 for i in range(body_len))
    return head + body + b"\n"


async def read_to_eof(stream: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        try:
            chunk = await stream.read(READ_CHUNK_BYTES)
        except StreamEOF:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def serve_echo(stream: Any) -> None:
    """Write back every chunk as it arrives (so both directions need flow control once
    the payload exceeds a yamux window), then half-close at the remote's EOF."""
    try:
        while True:
            try:
                chunk = await stream.read(READ_CHUNK_BYTES)
            except StreamEOF:
                break
            if not chunk:
                break
            await stream.write(chunk)
        await stream.close()
    except Exception as e:  # report, and reset: the remote sees the failure
        emit("error", step="serve_echo", error=repr(e))
        await stream.reset()


async def identify_remote(host: Any, peer_id: ID) -> dict[str, Any]:
    stream = await host.new_stream(peer_id, [IDENTIFY_PROTOCOL_ID])
    try:
        data = await read_length_prefixed_protobuf(stream, use_varint_format=True)
    finally:
        await stream.close()
    msg = Identify()
    msg.ParseFromString(data)
    key_matches = ID.from_pubkey(deserialize_public_key(msg.public_key)) == peer_id
    return {
        "protocols": list(msg.protocols),
        "agent_version": msg.agent_version,
        "protocol_version": msg.protocol_version,
        "listen_addrs": [str(multiaddr.Multiaddr(a)) for a in msg.listen_addrs],
        "observed_addr": str(multiaddr.Multiaddr(msg.observed_addr)) if msg.observed_addr else None,
        "public_key_matches_peer_id": key_matches,
    }


async def echo_remote(host: Any, peer_id: ID, protocol: str, num_bytes: int) -> dict[str, Any]:
    payload = payload_of(num_bytes)
    stream = await host.new_stream(peer_id, [TProtocol(protocol)])
    replies: list[bytes] = []

    async def collect() -> None:
        replies.append(await read_to_eof(stream))

    # Read while writing: a remote that echoes as it reads would otherwise stall once
    # our receive window is full and its send blocks.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(collect)
        await stream.write(payload)
        await stream.close_write()
    reply = replies[0]
    await stream.close()
    return {
        "protocol": protocol,
        "sent_len": len(payload),
        "sent_sha256": hashlib.sha256(payload).hexdigest(),
        "reply_len": len(reply),
        "reply_sha256": hashlib.sha256(reply).hexdigest(),
        "reply_head": reply[:64].decode("latin-1"),
    }


async def dial(host: Any, target: str, protocol: str, num_bytes: int, num_pings: int) -> None:
    info = info_from_p2p_addr(multiaddr.Multiaddr(target))
    steps = [
        ("connect", lambda: connect(host, info)),
        ("identify", lambda: identify_remote(host, info.peer_id)),
        ("echo", lambda: echo_remote(host, info.peer_id, protocol, num_bytes)),
        ("ping", lambda: ping(host, info.peer_id, num_pings)),
    ]
    for name, step in steps:
        try:
            with trio.fail_after(STEP_TIMEOUT_SECONDS):
                fields = await step()
        except Exception as e:  # report the step that failed, go on with the others
            emit("error", step=name, error=repr(e))
            if name == "connect":
                break
        else:
            emit(name, **fields)
    emit("done")


async def connect(host: Any, info: Any) -> dict[str, Any]:
    """Dial; report the PeerID the secured connection authenticated (py-libp2p's Noise
    checks it against the one in the address)."""
    await host.connect(info)
    conn = host.get_network().get_connections(info.peer_id)[0]
    return {"peer_id": str(conn.muxed_conn.peer_id)}


async def ping(host: Any, peer_id: ID, num_pings: int) -> dict[str, Any]:
    rtts_ms = await PingService(host).ping(peer_id, ping_amt=num_pings)
    return {"rtts_ms": rtts_ms}


async def watch_lifelines(cancel_scope: trio.CancelScope) -> None:
    """Cancel everything at SIGTERM or when stdin reaches EOF."""

    async def on_sigterm() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                emit("exiting", reason=f"signal {signum}")
                cancel_scope.cancel()
                return

    async def on_stdin_eof() -> None:
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async with stdin:
            while await stdin.receive_some(4096):
                pass
        emit("exiting", reason="stdin closed")
        cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_sigterm)
        nursery.start_soon(on_stdin_eof)


async def main(args: argparse.Namespace) -> None:
    key_pair = create_new_key_pair()
    host = new_host(
        key_pair=key_pair,
        sec_opt={
            NOISE_PROTOCOL_ID: NoiseTransport(
                key_pair, noise_privkey=create_new_x25519_key_pair().private_key
            )
        },
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},
    )
    host.set_stream_handler(ECHO_PROTOCOL, serve_echo)
    with trio.move_on_after(args.max_seconds) as deadline:
        async with host.run(listen_addrs=[multiaddr.Multiaddr(LISTEN_ADDR)]):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_lifelines, nursery.cancel_scope)
                addrs = [str(a) for a in host.get_addrs() if "/ip4/127.0.0.1/" in str(a)]
                emit(
                    "listening",
                    peer_id=str(host.get_id()),
                    addr=addrs[0],
                    security=str(NOISE_PROTOCOL_ID),
                    muxer=YAMUX_PROTOCOL_ID,
                    libp2p_version=_libp2p_version(),
                )
                if args.dial:
                    await dial(host, args.dial, args.protocol, args.payload_bytes, args.num_pings)
                # Keep serving (and the connection open) until told to stop.
                await trio.sleep_forever()
    if deadline.cancelled_caught:
        emit("exiting", reason=f"--max-seconds {args.max_seconds} elapsed")


def _libp2p_version() -> str:
    from importlib.metadata import version

    return version("libp2p")


def start_watchdog(max_seconds: float) -> None:
    """Hard-exit if the trio run has not ended by the deadline plus a grace period (a
    graceful shutdown that hangs must not outlive the test)."""

    def expire() -> None:
        time.sleep(max_seconds + SHUTDOWN_GRACE_SECONDS)
        print(json.dumps({"event": "exiting", "reason": "watchdog"}), flush=True)
        os._exit(3)

    threading.Thread(target=expire, daemon=True).start()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dial", help="multiaddr (with /p2p/ID) of a peer to exercise")
    parser.add_argument("--protocol", default=ECHO_PROTOCOL, help="protocol to echo over")
    parser.add_argument("--payload-bytes", type=int, default=300_000)
    parser.add_argument("--num-pings", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    start_watchdog(arguments.max_seconds)
    trio.run(main, arguments)
