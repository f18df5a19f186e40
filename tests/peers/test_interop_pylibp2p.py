"""Interop with py-libp2p (PyPI ``libp2p``), a second implementation nobody here wrote.

py-libp2p runs in its own process and its own virtual environment (``.venv-libp2p``:
its trio and protobuf pins may conflict with the main venv's), as
``interop/libp2p_node.py``, which reports what it does as JSON lines on stdout and
exits when we close its stdin. Both directions are checked: multistream-select, Noise
XX (``/noise``), yamux (``/yamux/1.0.0``) with payloads larger than one 256 KiB
window, identify and ping.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from peers import (
    KeyPair,
    Peer,
    PeerID,
    PeerIDMismatch,
    Stream,
    parse_multiaddr,
    run,
    split_peer_id,
)

REPO = Path(__file__).resolve().parents[2]
LIBP2P_PYTHON = REPO / ".venv-libp2p" / "bin" / "python"
NODE_SCRIPT = Path(__file__).resolve().parent / "interop" / "libp2p_node.py"

pytestmark = pytest.mark.skipif(
    not LIBP2P_PYTHON.exists(),
    reason=(
        f"{LIBP2P_PYTHON} not found; py-libp2p needs its own venv: "
        "python3 -m venv .venv-libp2p && .venv-libp2p/bin/pip install libp2p==0.8.1"
    ),
)

PROTOCOL = "/swarmtrain/interop-echo/1.0.0"
#: More than one yamux window (256 KiB) each way, so flow control must work both ways.
PAYLOAD_BYTES = 300_000
#: Seconds for the node to start (importing py-libp2p takes ~2 s on a quiet machine).
STARTUP_TIMEOUT_SECONDS = 60.0
#: Seconds for everything we ask of the node after it has started.
EXCHANGE_TIMEOUT_SECONDS = 60.0
#: Seconds the node lives at most; it exits sooner when we close its stdin.
NODE_MAX_SECONDS = 180.0
#: Seconds the node has to exit after we close its stdin before we kill it.
EXIT_TIMEOUT_SECONDS = 10.0


class Libp2pNode:
    """The py-libp2p child: its JSON events, and its stderr for failure messages."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path

    def stderr_tail(self) -> str:
        text = self.stderr_path.read_text(errors="replace")
        return text[-4000:]

    async def next_event(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        assert line, f"py-libp2p node exited early; its stderr:\n{self.stderr_tail()}"
        event: dict[str, Any] = json.loads(line)
        return event

    async def events_until(self, name: str) -> list[dict[str, Any]]:
        """Every event up to and including the first called ``name``."""
        events = [await self.next_event()]
        while events[-1]["event"] != name:
            events.append(await self.next_event())
        return events


@contextlib.asynccontextmanager
async def libp2p_node(*args: str, stderr_path: Path) -> AsyncIterator[Libp2pNode]:
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            str(LIBP2P_PYTHON),
            str(NODE_SCRIPT),
            "--max-seconds",
            str(NODE_MAX_SECONDS),
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    try:
        yield Libp2pNode(proc, stderr_path)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the node's lifeline: it exits at EOF
        try:
            async with asyncio.timeout(EXIT_TIMEOUT_SECONDS):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


def payload() -> bytes:
    return b"hello from swarmtrain " + os.urandom(PAYLOAD_BYTES) + b"\n"


async def echo_over(ours: Peer, remote: PeerID, data: bytes) -> bytes:
    """Send ``data`` on a new stream while reading the reply to EOF (the node echoes as it
    reads, so writing everything first would stall once our receive window fills)."""
    stream = await ours.new_stream(remote, PROTOCOL)

    async def send() -> None:
        await stream.write(data)
        await stream.close()

    chunks: list[bytes] = []
    async with asyncio.TaskGroup() as group:
        group.create_task(send())
        while chunk := await stream.read():
            chunks.append(chunk)
    return b"".join(chunks)


def test_we_dial_py_libp2p(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            libp2p_node(stderr_path=tmp_path / "node.stderr") as node,
            Peer() as ours,
        ):
            async with asyncio.timeout(STARTUP_TIMEOUT_SECONDS):
                listening = await node.next_event()
            assert listening["event"] == "listening", listening
            addr = parse_multiaddr(listening["addr"])
            transport, node_id = split_peer_id(addr)
            data = payload()
            async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
                remote = await ours.connect(addr)
                # our AESGCM Noise proposed first, refused, then libp2p's /noise
                conn = ours.connection_to(remote)
                assert conn is not None and conn.security_protocol == "/noise"
                info = await ours.identify(remote)
                rtts = [await ours.ping(remote) for _ in range(3)]
                reply = await echo_over(ours, remote, data)
                # A wrong /p2p part is refused after the Noise handshake.
                stranger = KeyPair.generate().peer_id
                with pytest.raises(PeerIDMismatch):
                    await ours.connect(f"{transport}/p2p/{stranger}")
            assert remote == node_id and str(remote) == listening["peer_id"]
            assert PROTOCOL in info.protocols, info
            assert "/ipfs/ping/1.0.0" in info.protocols, info
            assert info.agent_version.startswith("py-libp2p/"), info
            assert str(transport) in map(str, info.listen_addrs), info
            assert all(0 < r < 5 for r in rtts), rtts
            assert len(reply) == len(data)
            assert reply == data

    run(main())


def test_py_libp2p_dials_us(tmp_path: Path) -> None:
    async def main() -> None:
        async with Peer() as ours:
            served: list[bytes] = []

            async def echo(stream: Stream) -> None:
                chunks: list[bytes] = []
                while chunk := await stream.read():
                    chunks.append(chunk)
                served.append(b"".join(chunks))
                await stream.write(b"echo:" + served[-1])
                await stream.close()

            ours.set_stream_handler(PROTOCOL, echo)
            our_addr = ours.listen_addrs[0]
            async with libp2p_node(
                "--dial",
                str(our_addr),
                "--protocol",
                PROTOCOL,
                "--payload-bytes",
                str(PAYLOAD_BYTES),
                stderr_path=tmp_path / "node.stderr",
            ) as node:
                async with asyncio.timeout(STARTUP_TIMEOUT_SECONDS):
                    listening = await node.next_event()
                assert listening["event"] == "listening", listening
                async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
                    events = await node.events_until("done")
                node_id = PeerID.from_base58(listening["peer_id"])
                assert node_id in ours.connected_peers()
                conn = ours.connection_to(node_id)
                assert conn is not None and conn.security_protocol == "/noise"
                stderr = node.stderr_tail()
            errors = [e for e in events if e["event"] == "error"]
            assert not errors, f"{errors}\nnode stderr:\n{stderr}"
            by_name = {e["event"]: e for e in events}

            assert by_name["connect"]["peer_id"] == str(ours.peer_id)

            identify = by_name["identify"]
            assert identify["public_key_matches_peer_id"], identify
            assert PROTOCOL in identify["protocols"], identify
            assert "/ipfs/ping/1.0.0" in identify["protocols"], identify
            assert identify["agent_version"] == ours.config.agent_version
            assert str(split_peer_id(our_addr)[0]) in identify["listen_addrs"], identify

            echoed = by_name["echo"]
            assert echoed["sent_len"] == PAYLOAD_BYTES
            assert len(served) == 1 and len(served[0]) == PAYLOAD_BYTES
            assert hashlib.sha256(served[0]).hexdigest() == echoed["sent_sha256"]
            assert echoed["reply_len"] == PAYLOAD_BYTES + len(b"echo:")
            assert echoed["reply_sha256"] == hashlib.sha256(b"echo:" + served[0]).hexdigest()

            rtts_ms = by_name["ping"]["rtts_ms"]
            assert len(rtts_ms) == 3 and all(0 <= r < 5000 for r in rtts_ms), rtts_ms

    run(main())
