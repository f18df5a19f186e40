"""Finding 8 of the security issue: a remote that provokes replies and never reads
them. Each yamux ping we answer with a pong, each stream opened past the limit with an
RST: 12 bytes queued for each 12 received. A remote that sent a million pings and read
none of our answers made us buffer 11.9 MB of pongs, and more for every ping after.
Now, while our writes to it are backlogged (and past 4096 replies between two writes),
pongs coalesce into the latest and RSTs wait, and past ``MAX_HELD_RESETS`` of them we
stop reading it until it reads: the buffer stays bounded (62 KB for the same million),
the connection lives on, and the peer keeps serving everyone else."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import pytest

from peers import Peer
from peers.connection import Connection
from peers.yamux import MAX_HELD_RESETS, MAX_STREAMS, PongReceived, YamuxEvent
from tests.peers.test_hostile import (
    _SYN,
    RawConnection,
    assert_serves,
    raw_connection,
    run,
    victim_and_honest,
    wait_until,
    yamux_frame,
)

pytestmark = pytest.mark.timeout(120)

_DATA, _WINDOW_UPDATE, _PING = 0, 1, 2
_RST = 8
_HEADER = struct.Struct(">BBHII")
#: Frames the attacker sends: 12 MB, well past what the kernel's socket buffers hold.
NUM_FRAMES = 1_000_000
#: Largest write backlog we accept towards a remote that reads nothing (the transport's
#: 64 KiB high-water mark, plus what one read of its frames can add at once).
MAX_BACKLOG_BYTES = 1024 * 1024
#: Plaintext per Noise frame the attacker sends.
PIECE = 5000 * 12


def _connection_of(victim: Peer) -> Connection:
    (conn,) = [c for cs in victim._connections.values() for c in cs if not c.is_closed]
    return conn


def _backlog(conn: Connection) -> int:
    return conn._writer.transport.get_write_buffer_size()


async def _read_until(raw: RawConnection, wanted: YamuxEvent) -> None:
    """Read (and drop) the victim's frames until ``wanted`` comes."""
    async with asyncio.timeout(60):
        while wanted not in raw.events:
            raw.events.clear()
            assert await raw.receive(), "the victim closed the connection"


async def _read_resets_until(raw: RawConnection, last: int) -> None:
    """Read the victim's frames (by hand: the attacker's own session never opened the
    streams it refuses) until the RST of stream ``last`` comes."""
    pending = bytearray()
    async with asyncio.timeout(60):
        while True:
            data = await raw.reader.read(1 << 20)
            assert data, "the victim closed the connection"
            pending += raw.transport.receive_data(data)
            pos = 0
            while len(pending) - pos >= 12:
                _, kind, flags, stream_id, length = _HEADER.unpack_from(pending, pos)
                size = 12 + (length if kind == _DATA else 0)
                if len(pending) - pos < size:
                    break
                if kind == _WINDOW_UPDATE and flags & _RST and stream_id == last:
                    return
                pos += size
            del pending[:pos]


async def _send(raw: RawConnection, frames: bytes) -> None:
    for start in range(0, len(frames), PIECE):
        await raw.send_plaintext(frames[start : start + PIECE])


def test_pings_never_read_cost_a_bounded_buffer_and_the_latest_pong_arrives() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, honest), raw_connection(victim) as raw:
            pings = b"".join(yamux_frame(_PING, _SYN, 0, i) for i in range(NUM_FRAMES))
            await _send(raw, pings)
            conn = _connection_of(victim)
            await wait_until(
                lambda: conn.session_statistics().num_wire_bytes_received >= len(pings),
                timeout=60,
            )
            held = conn.session_statistics().num_replies_held
            print("backlog", _backlog(conn), "replies held", held)
            assert _backlog(conn) < MAX_BACKLOG_BYTES
            assert held > NUM_FRAMES // 2  # most pongs were coalesced, not queued
            assert not conn.is_closed
            await assert_serves(victim, honest)
            # Once it reads, the pong it waits for (its latest ping's) comes.
            await _read_until(raw, PongReceived(NUM_FRAMES - 1))

    run(main())


def test_refused_streams_never_read_pause_reading_until_the_remote_reads() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, honest), raw_connection(victim) as raw:
            # Every stream the victim allows, then a flood of SYNs it must refuse.
            syns = b"".join(
                yamux_frame(_WINDOW_UPDATE, _SYN, 2 * i + 1, 0)
                for i in range(MAX_STREAMS + NUM_FRAMES)
            )
            sender = asyncio.create_task(_send(raw, syns))
            conn = _connection_of(victim)
            try:
                await wait_until(lambda: conn._reading_paused, timeout=60)
                print("backlog", _backlog(conn), "held", conn._session.num_held_resets)
                assert _backlog(conn) < MAX_BACKLOG_BYTES
                assert MAX_HELD_RESETS < conn._session.num_held_resets < 64 * MAX_HELD_RESETS
                assert not conn.is_closed and not sender.done()  # the attacker is stuck
                await assert_serves(victim, honest)
                # Once it reads, the victim answers and reads on, to its last SYN.
                await _read_resets_until(raw, 2 * (MAX_STREAMS + NUM_FRAMES - 1) + 1)
                await asyncio.wait_for(sender, 30)
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                    await sender
                raw.writer.transport.abort()  # (unsent SYNs: closing would wait for them)

    run(main())
