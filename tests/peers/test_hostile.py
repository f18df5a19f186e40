"""Hostile input against a real listening Peer on 127.0.0.1
(CONTRIBUTING.md, "Bound everything a peer controls" and "How tests are organised").

Each test sends one kind of bad input to a *victim* Peer and checks three things: the
victim refuses it clearly (an error frame, a reset stream, a closed socket), it keeps
nothing from it (its statistics return to where they were, and traced memory stays flat
over many attempts), and it still answers an honest peer afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from peers import (
    CallContext,
    ConnectionClosed,
    DialError,
    KeyPair,
    LimitExceeded,
    Peer,
    PeerConfig,
    ProtocolNotSupported,
    RemoteError,
    StreamReset,
    run,
)
from peers.addresses import tcp_target
from peers.connection import Stream
from peers.echo import ECHO_PROTOCOL_ID, ECHO_STREAM_PROTOCOL_ID, install_echo
from peers.multistream import MULTISTREAM_PROTOCOL_ID, MultistreamDialer, encode_message
from peers.noise import (
    AESGCM_NOISE,
    CHACHAPOLY_NOISE,
    NOISE_PROTOCOL_ID,
    NoiseCipher,
    NoiseHandshake,
    NoiseTransport,
)
from peers.rpc import FramedStream
from peers.serialization import MAX_FRAME_BYTES, pack
from peers.upgrade import upgrade
from peers.varint import encode_uvarint
from peers.yamux import (
    GO_AWAY_PROTOCOL_ERROR,
    INITIAL_WINDOW_BYTES,
    DataReceived,
    GoAwayReceived,
    PongReceived,
    YamuxEvent,
    YamuxSession,
)

pytestmark = pytest.mark.timeout(60)

#: Bound on every single wait: generous for a loaded 2-core CI machine, yet a hang
#: still fails in seconds.
WAIT_SECONDS = 5.0
#: Traced memory that may remain after a loop of bad inputs. What legitimately stays is
#: bounded and small (yamux remembers up to 1024 closed stream ids: ~70 KiB at most; we
#: measure ~2-25 KiB). One leaked Connection is ~8 KiB, so 100 leaked attempts break it.
MAX_GROWTH_BYTES = 256 * 1024
#: A protocol nobody serves.
UNKNOWN_PROTOCOL_ID = "/hostile/unknown/1.0.0"
#: A test service whose handler never reads, so its stream's window fills up.
SINK_PROTOCOL_ID = "/hostile/sink/1.0.0"
#: A unary echo with a small frame bound, to probe the bound's exact edge.
SMALL_ECHO_PROTOCOL_ID = "/hostile/small-echo/1.0.0"
SMALL_FRAME_BYTES = 1024

# yamux spec.md "Framing", laid out by hand: version, type, flags, stream id, length.
_YAMUX_HEADER = struct.Struct(">BBHII")
_DATA, _PING = 0, 2
_SYN = 1


# --- helpers ----------------------------------------------------------------------


async def wait_until(condition: Callable[[], bool], timeout: float = WAIT_SECONDS) -> None:
    """Poll ``condition`` until it holds; TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        # The conditions are counters with no event to wait on; a bounded poll is fine.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def assert_serves(victim: Peer, honest: Peer) -> None:
    """The victim still answers an honest unary call and a ping."""
    async with asyncio.timeout(WAIT_SECONDS):
        reply = await honest.call_unary(victim.listen_addrs[0], ECHO_PROTOCOL_ID, "still here", str)
        assert reply == "still here"
        await honest.ping(victim.peer_id)


async def traced_growth(attempt: Callable[[], Awaitable[None]], repeats: int) -> int:
    """Bytes allocated during ``repeats`` attempts (after a warm-up) and still held after."""
    for _ in range(3):  # fill caches (functools.cache, interned names, logger setup)
        await attempt()
    gc.collect()
    already_tracing = tracemalloc.is_tracing()
    if not already_tracing:
        tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(repeats):
            await attempt()
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        if not already_tracing:
            tracemalloc.stop()
    print(f"traced growth: {after - before} bytes over {repeats} attempts")
    return after - before


def port_of(peer: Peer) -> int:
    return tcp_target(peer.listen_addrs[0]).port


@contextlib.asynccontextmanager
async def raw_tcp(victim: Peer) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A plain TCP connection to the victim, speaking nothing unless told to."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(victim))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the victim sends until it closes the socket (bounded wait)."""
    data = bytearray()
    async with asyncio.timeout(WAIT_SECONDS):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionError:  # it closed with some of our bytes unread: RST
                break
            if not chunk:
                break
            data += chunk
    return bytes(data)


def yamux_frame(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    return _YAMUX_HEADER.pack(0, kind, flags, stream_id, length)


@dataclass
class RawConnection:
    """An authenticated connection whose yamux side we drive by hand."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    transport: NoiseTransport
    session: YamuxSession
    events: list[YamuxEvent]

    async def send_plaintext(self, plaintext: bytes) -> None:
        self.writer.write(self.transport.encrypt(plaintext))
        await self.writer.drain()

    async def flush(self) -> None:
        await self.send_plaintext(self.session.data_to_send())

    async def receive(self) -> bool:
        """Read one chunk into ``events``; False once the victim closed the socket."""
        try:
            data = await self.reader.read(65536)
        except ConnectionError:
            return False
        if not data:
            return False
        plaintext = self.transport.receive_data(data)
        if plaintext:
            self.events += self.session.receive_data(plaintext)
        return True

    async def wait_for(self, wanted: Callable[[YamuxEvent], bool]) -> YamuxEvent:
        async with asyncio.timeout(WAIT_SECONDS):
            while True:
                for event in self.events:
                    if wanted(event):
                        return event
                if not await self.receive():
                    raise AssertionError(f"victim closed the connection; events: {self.events}")

    async def read_until_closed(self) -> None:
        async with asyncio.timeout(WAIT_SECONDS):
            while await self.receive():
                pass


@contextlib.asynccontextmanager
async def raw_connection(
    victim: Peer, cipher: NoiseCipher = AESGCM_NOISE
) -> AsyncIterator[RawConnection]:
    """TCP + multistream + Noise (``cipher``) + multistream as usual, then a hand-driven
    yamux."""
    async with raw_tcp(victim) as (reader, writer):
        async with asyncio.timeout(WAIT_SECONDS):
            upgraded = await upgrade(
                reader,
                writer,
                identity=KeyPair.generate(),
                outbound=True,
                expected_peer_id=victim.peer_id,
                ciphers=(cipher,),
            )
        session = YamuxSession(is_client=True)
        events = session.receive_data(upgraded.leftover_plaintext)
        yield RawConnection(reader, writer, upgraded.transport, session, events)


def handshake_prefix() -> bytes:
    """multistream for /noise and Noise message 1, pipelined as go-libp2p does."""
    initiator = NoiseHandshake(initiator=True, identity=KeyPair.generate())
    return (
        encode_message(MULTISTREAM_PROTOCOL_ID)
        + encode_message(NOISE_PROTOCOL_ID)
        + initiator.write_message()
    )


@contextlib.asynccontextmanager
async def victim_and_honest(config: PeerConfig | None = None) -> AsyncIterator[tuple[Peer, Peer]]:
    async with Peer(config) as victim, Peer() as honest:
        install_echo(victim)
        yield victim, honest


# --- 1, 2: bad handshakes -----------------------------------------------------------


def test_garbage_instead_of_a_handshake_is_cut_off() -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)

    async def main() -> None:
        async with victim_and_honest() as (victim, honest):

            async def attempt() -> None:
                failures = victim.statistics().num_handshake_failures
                async with raw_tcp(victim) as (reader, writer):
                    # More than one whole multistream message (1024 bytes at most), so
                    # the victim has enough to decide: it can only be garbage.
                    writer.write(rng.randbytes(2048))
                    received = await read_until_closed(reader)
                # At most its own multistream header came back, nothing else.
                assert encode_message(MULTISTREAM_PROTOCOL_ID).startswith(received)
                await wait_until(lambda: victim.statistics().num_handshake_failures == failures + 1)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            assert victim.statistics().num_connections == 0
            await assert_serves(victim, honest)

    run(main())


def test_bad_noise_handshake_messages_are_refused() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, honest):
            # Message 1 of a length no X25519 key has.
            failures = victim.statistics().num_handshake_failures
            async with raw_tcp(victim) as (reader, writer):
                writer.write(
                    encode_message(MULTISTREAM_PROTOCOL_ID)
                    + encode_message(NOISE_PROTOCOL_ID)
                    + b"\x00\x0a"
                    + os.urandom(10)
                )
                await read_until_closed(reader)
            await wait_until(lambda: victim.statistics().num_handshake_failures == failures + 1)

            # A real message 1, then a forged message 3 (pipelined: the victim reads it
            # after sending message 2): its MAC cannot check out.
            async with raw_tcp(victim) as (reader, writer):
                writer.write(handshake_prefix() + b"\x00\x60" + os.urandom(0x60))
                await read_until_closed(reader)
            await wait_until(lambda: victim.statistics().num_handshake_failures == failures + 2)
            await assert_serves(victim, honest)

    run(main())


def test_truncated_handshake_then_close_leaves_nothing_behind() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, honest):

            async def attempt() -> None:
                failures = victim.statistics().num_handshake_failures
                async with raw_tcp(victim) as (_, writer):
                    writer.write(handshake_prefix())
                    await writer.drain()
                await wait_until(lambda: victim.statistics().num_handshake_failures == failures + 1)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            assert victim.statistics().num_connections == 0
            await assert_serves(victim, honest)

    run(main())


def test_slowloris_connections_are_cut_at_the_handshake_timeout() -> None:
    config = PeerConfig(handshake_timeout=0.5)

    async def main() -> None:
        async with victim_and_honest(config) as (victim, honest):
            async with raw_tcp(victim) as (silent, _), raw_tcp(victim) as (stalled, writer):
                # One says nothing; the other stops after Noise message 1.
                writer.write(handshake_prefix())
                # Holding both does not keep an honest peer out.
                await assert_serves(victim, honest)
                await read_until_closed(silent)
                await read_until_closed(stalled)
            assert victim.statistics().num_handshake_failures == 2
            assert victim.statistics().num_connections == 1  # the honest one
            await assert_serves(victim, honest)

    run(main())


# --- 3, 4: malformed and oversized RPC frames ----------------------------------------

#: (name, bytes sent on a unary call, whether we half-close after them, the remote error).
_MALFORMED_FRAMES = [
    ("length-2^63-1", encode_uvarint(2**63 - 1), False, "LimitExceeded"),  # the 9-byte max
    ("length-2^63", b"\x80" * 9 + b"\x01", False, "SerializationError"),  # needs 10 bytes
    ("ten-0xff", b"\xff" * 10, False, "SerializationError"),
    ("non-minimal-length", b"\x80\x00", False, "SerializationError"),
    # A frame body is uvarint(len(head)) + msgpack head + raw array bytes.
    ("not-msgpack", b"\x04\x03\xc1\xc1\xc1", False, "SerializationError"),  # 0xc1: never used
    ("head-past-frame", b"\x02\x05\x05", False, "SerializationError"),
    ("unclaimed-raw-bytes", b"\x04\x01\x05\x00\x00", False, "SerializationError"),
    ("not-an-array", b"\x02\x01\x05", False, "RemoteProtocolError"),
    ("cut-mid-frame", b"\x64" + bytes(10), True, "RemoteProtocolError"),
]


async def send_raw_call(attacker: Peer, victim: Peer, protocol: str, payload: bytes) -> Stream:
    stream = await attacker.new_stream(victim.peer_id, protocol)
    await stream.write(payload)
    return stream


async def expect_error_frame(stream: Stream, remote_type: str) -> None:
    """The victim answers with an error frame of ``remote_type``, then ends the stream."""
    framed = FramedStream(stream)
    async with asyncio.timeout(WAIT_SECONDS):
        frame = await framed.read_frame()
        assert frame is not None and frame[0] == 1, frame
        assert frame[1] == remote_type, frame
        with pytest.raises(StreamReset):  # and then it resets the stream
            await framed.read_frame()


@pytest.mark.parametrize(
    ("payload", "close", "remote_type"),
    [pytest.param(*case[1:], id=case[0]) for case in _MALFORMED_FRAMES],
)
def test_malformed_frame_on_a_unary_call_gets_an_error_frame(
    payload: bytes, close: bool, remote_type: str
) -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])
            stream = await send_raw_call(attacker, victim, ECHO_PROTOCOL_ID, payload)
            if close:
                await stream.close()
            await expect_error_frame(stream, remote_type)
            await wait_until(lambda: victim.statistics().num_streams == 0)
            # The connection is only the stream's cost: the same one still serves.
            connection = attacker.connection_to(victim.peer_id)
            await assert_serves(victim, attacker)
            assert attacker.connection_to(victim.peer_id) is connection

    run(main())


def test_malformed_first_frame_on_a_streaming_call_gets_an_error_frame() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])
            for payload, remote_type in (
                (encode_uvarint(2**63 - 1), "LimitExceeded"),
                (b"\xff" * 10, "SerializationError"),
            ):
                stream = await send_raw_call(attacker, victim, ECHO_STREAM_PROTOCOL_ID, payload)
                await expect_error_frame(stream, remote_type)
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, attacker)

    run(main())


def test_malformed_frames_leave_no_memory_or_streams_behind() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])

            async def attempt() -> None:
                for _, payload, close, remote_type in _MALFORMED_FRAMES:
                    stream = await send_raw_call(attacker, victim, ECHO_PROTOCOL_ID, payload)
                    if close:
                        await stream.close()
                    await expect_error_frame(stream, remote_type)
                await wait_until(lambda: victim.statistics().num_streams == 0)

            growth = await traced_growth(attempt, repeats=20)
            assert growth < MAX_GROWTH_BYTES, growth
            assert victim.statistics().num_connections == 1
            await assert_serves(victim, attacker)

    run(main())


def _container_bomb(outer: int, inner: int) -> bytes:
    """A frame whose msgpack head is ``outer`` arrays of ``inner`` empty arrays: one byte
    each on the wire, 64 bytes each as Python lists."""
    inner_array = b"\xdd" + inner.to_bytes(4, "big") + b"\x90" * inner
    head = b"\xdd" + outer.to_bytes(4, "big") + inner_array * outer
    body = encode_uvarint(len(head)) + head
    return encode_uvarint(len(body)) + body


@pytest.mark.parametrize(
    ("outer", "inner"),
    [(64, 8192), (1, 16_000_000)],
    ids=["512k-empty-lists", "one-16M-element-header"],
)
def test_a_frame_of_empty_containers_is_refused_not_expanded(outer: int, inner: int) -> None:
    """msgpack spends a byte on an empty list that costs Python 64: a 16 MiB frame of
    them became 1.2 GiB of objects and seconds of the event loop. Now a value holding
    more than MAX_VALUE_ITEMS items is a SerializationError: an error frame, nothing
    else lost."""

    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])
            payload = _container_bomb(outer, inner)
            stream = await send_raw_call(attacker, victim, ECHO_PROTOCOL_ID, payload)
            await expect_error_frame(stream, "SerializationError")
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, attacker)

    run(main())


@pytest.mark.parametrize("announced", [MAX_FRAME_BYTES + 1, 2**30], ids=["limit+1", "1GiB"])
def test_oversized_frame_is_refused_before_its_body_arrives(announced: int) -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])

            async def attempt() -> None:
                # Only the length goes out: an answer within the wait proves the victim
                # did not wait to buffer the announced body.
                prefix = encode_uvarint(announced)
                stream = await send_raw_call(attacker, victim, ECHO_PROTOCOL_ID, prefix)
                await expect_error_frame(stream, "LimitExceeded")
                await wait_until(lambda: victim.statistics().num_streams == 0)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            await assert_serves(victim, attacker)

    run(main())


def test_frame_bound_is_exact() -> None:
    def request_of_size(num_bytes: int) -> tuple[bytes, str]:
        """A call's first frame, ``[0, text]``, packed to exactly ``num_bytes``."""
        for length in range(num_bytes):
            text = "x" * length
            body = pack([0, text])
            if len(body) == num_bytes:
                return encode_uvarint(len(body)) + body, text
        raise AssertionError(f"no request packs to {num_bytes} bytes")

    async def echo(request: str, context: CallContext) -> str:
        return request

    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            victim.add_unary_handler(
                SMALL_ECHO_PROTOCOL_ID, echo, str, max_frame_bytes=SMALL_FRAME_BYTES
            )
            await attacker.connect(victim.listen_addrs[0])
            frame, text = request_of_size(SMALL_FRAME_BYTES)
            stream = await send_raw_call(attacker, victim, SMALL_ECHO_PROTOCOL_ID, frame)
            await stream.close()
            async with asyncio.timeout(WAIT_SECONDS):
                assert await FramedStream(stream).read_frame() == [0, text]

            frame, _ = request_of_size(SMALL_FRAME_BYTES + 1)
            stream = await send_raw_call(attacker, victim, SMALL_ECHO_PROTOCOL_ID, frame)
            await expect_error_frame(stream, "LimitExceeded")
            with pytest.raises(RemoteError, match="LimitExceeded"):
                async with asyncio.timeout(WAIT_SECONDS):
                    await attacker.call_unary(
                        victim.peer_id, SMALL_ECHO_PROTOCOL_ID, "x" * SMALL_FRAME_BYTES, str
                    )
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, attacker)

    run(main())


def test_hostile_server_cannot_make_a_caller_buffer_a_huge_response() -> None:
    async def announce_huge(stream: Stream) -> None:
        await stream.write(encode_uvarint(2**62))
        await stream.wait_failed()

    async def main() -> None:
        async with victim_and_honest() as (server, caller):
            server.set_stream_handler("/hostile/huge-answer/1.0.0", announce_huge)
            with pytest.raises(LimitExceeded):
                async with asyncio.timeout(WAIT_SECONDS):
                    await caller.call_unary(
                        server.listen_addrs[0], "/hostile/huge-answer/1.0.0", "hi", str
                    )
            await wait_until(lambda: server.statistics().num_streams == 0)
            await assert_serves(server, caller)

    run(main())


# --- 5, 6: streams ------------------------------------------------------------------


def test_unknown_protocol_costs_only_the_stream(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])
            connection = attacker.connection_to(victim.peer_id)

            async def attempt() -> None:
                async with asyncio.timeout(WAIT_SECONDS):
                    # One proposal is negotiated lazily: the refusal arrives on first read.
                    stream = await attacker.new_stream(victim.peer_id, UNKNOWN_PROTOCOL_ID)
                    with pytest.raises(ProtocolNotSupported):
                        await stream.read()
                    with pytest.raises(ProtocolNotSupported):  # several: at once
                        await attacker.new_stream(victim.peer_id, [UNKNOWN_PROTOCOL_ID, "/x/1"])
                await wait_until(lambda: victim.statistics().num_streams == 0)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            await assert_serves(victim, attacker)
            assert attacker.connection_to(victim.peer_id) is connection
            # A dialer resetting after our "na" is ordinary: no warning per stream, or
            # any remote could flood our log.
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    run(main())


def test_too_many_protocol_proposals_reset_the_stream() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])
            refused = victim.statistics().num_streams_refused
            proposals = [f"/hostile/unknown/{i}" for i in range(100)]
            async with asyncio.timeout(WAIT_SECONDS):
                with pytest.raises(StreamReset):
                    await attacker.new_stream(victim.peer_id, proposals)
            assert victim.statistics().num_streams_refused == refused + 1
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, attacker)

    run(main())


async def negotiate(stream: Stream, protocol: str) -> None:
    """multistream-select by hand on a raw stream."""
    dialer = MultistreamDialer([protocol])
    await stream.write(dialer.initial_bytes())
    while dialer.selected is None:
        data = await stream.read(1024)
        assert data, "victim ended the stream while negotiating"
        reply = dialer.receive_data(data)
        if reply:
            await stream.write(reply)
    assert not dialer.leftover


def test_streams_beyond_the_limit_are_reset() -> None:
    max_streams = 4
    num_extra = 3

    async def main() -> None:
        config = PeerConfig(max_streams_per_connection=max_streams)
        async with victim_and_honest(config) as (victim, attacker):
            await attacker.connect(victim.listen_addrs[0])
            connection = attacker.connection_to(victim.peer_id)
            assert connection is not None
            streams = [connection.open_stream_raw() for _ in range(max_streams + num_extra)]
            async with asyncio.timeout(WAIT_SECONDS):
                for extra in streams[max_streams:]:
                    assert isinstance(await extra.wait_failed(), StreamReset)
                    with pytest.raises(StreamReset, match="by the remote") as raised:
                        await extra.read()
                    # A copy is raised, not the kept error: the kept one would gather
                    # every raiser's frames (a cycle holding whatever they reference).
                    kept = await extra.wait_failed()
                    assert raised.value is not kept and kept.__traceback__ is None
                # The ones within the limit work: each negotiates ping and pings.
                for stream in streams[:max_streams]:
                    await negotiate(stream, "/ipfs/ping/1.0.0")
                    payload = os.urandom(32)
                    await stream.write(payload)
                    assert await stream.readexactly(32) == payload
                    await stream.close()
                    assert await stream.read() == b""
            victim_connection = victim.connection_to(attacker.peer_id)
            assert victim_connection is not None
            # White-box: the victim's yamux session refused exactly the extras.
            assert victim_connection._session.statistics().num_streams_rejected == num_extra
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, attacker)
            assert attacker.connection_to(victim.peer_id) is connection

    run(main())


# --- 7, 8: connections ----------------------------------------------------------------


def test_connections_per_ip_are_bounded() -> None:
    max_per_ip = 3

    async def main() -> None:
        config = PeerConfig(max_connections_per_ip=max_per_ip)
        async with victim_and_honest(config) as (victim, honest):
            header = encode_message(MULTISTREAM_PROTOCOL_ID)
            async with contextlib.AsyncExitStack() as holders:
                for _ in range(max_per_ip):
                    reader, _ = await holders.enter_async_context(raw_tcp(victim))
                    # Its multistream header shows the victim took this one on.
                    async with asyncio.timeout(WAIT_SECONDS):
                        assert await reader.readexactly(len(header)) == header
                for i in range(5):
                    async with raw_tcp(victim) as (reader, _):
                        assert await read_until_closed(reader) == b""  # not a byte
                    assert victim.statistics().num_inbound_connections_refused == i + 1
                # An honest peer from the same IP is turned away too, clearly.
                with pytest.raises(DialError):
                    async with asyncio.timeout(WAIT_SECONDS):
                        await honest.connect(victim.listen_addrs[0])
            # Once the holders are gone, their slots are free again.
            await wait_until(lambda: victim.statistics().num_handshake_failures == max_per_ip)
            await assert_serves(victim, honest)
            assert victim.statistics().num_connections == 1

    run(main())


def test_idle_connections_make_room_for_a_newcomer_when_every_slot_is_taken() -> None:
    """Connections that went quiet are the first to go when all are taken; one with a
    stream open stays. Before, a peer whose slots were held by idle connections turned
    every newcomer away for as long as the holders liked."""
    busy_protocol = "/hostile/busy/1.0.0"

    async def main() -> None:
        config = PeerConfig(max_connections=4, idle_connection_seconds=0.2)
        async with victim_and_honest(config) as (victim, honest), Peer() as busy:
            release = asyncio.Event()

            async def hold(stream: Stream) -> None:
                await release.wait()

            victim.set_stream_handler(busy_protocol, hold)
            stream = await busy.new_stream(victim.listen_addrs[0], busy_protocol)
            async with contextlib.AsyncExitStack() as holders:
                for _ in range(3):  # whole upgrades under fresh identities, then silence
                    reader, writer = await holders.enter_async_context(raw_tcp(victim))
                    await upgrade(reader, writer, identity=KeyPair.generate(), outbound=True)
                await wait_until(lambda: victim.statistics().num_connections == 4)
                await asyncio.sleep(0.3)  # the holders' silence: idle_connection_seconds
                async with asyncio.timeout(WAIT_SECONDS):
                    await honest.connect(victim.listen_addrs[0])
                await assert_serves(victim, honest)
                stats = victim.statistics()
                assert 1 <= stats.num_idle_closed <= 3, stats
                busy_conn = victim.connection_to(busy.peer_id)
                assert busy_conn is not None and not busy_conn.is_closed  # it had a stream
            release.set()
            await stream.close()

    run(main())


def test_a_newcomer_its_source_checks_refuse_closes_no_idle_connection() -> None:
    """Idle connections make room only for someone who gets in: a flooder refused for
    its address must not clear them out."""

    async def main() -> None:
        config = PeerConfig(
            max_connections=3, max_connections_per_ip=3, idle_connection_seconds=0.1
        )
        async with victim_and_honest(config) as (victim, honest):
            async with contextlib.AsyncExitStack() as holders:
                for _ in range(3):
                    reader, writer = await holders.enter_async_context(raw_tcp(victim))
                    await upgrade(reader, writer, identity=KeyPair.generate(), outbound=True)
                await wait_until(lambda: victim.statistics().num_connections == 3)
                await asyncio.sleep(0.2)  # the holders' silence: idle_connection_seconds
                with pytest.raises(DialError):  # a fourth from the same address
                    async with asyncio.timeout(WAIT_SECONDS):
                        await honest.connect(victim.listen_addrs[0])
                stats = victim.statistics()
                assert stats.num_idle_closed == 0 and stats.num_connections == 3, stats

    run(main())


def test_calls_in_flight_are_bounded_per_peer_and_cost_no_one_else() -> None:
    from peers.rpc import MAX_CALLS_IN_FLIGHT_PER_PEER, calls_in_flight

    slow_protocol = "/hostile/slow/1.0.0"

    async def main() -> None:
        async with victim_and_honest() as (victim, honest), Peer() as greedy:
            release = asyncio.Event()

            async def slow(request: str, context: CallContext) -> str:
                await release.wait()
                return request

            victim.add_unary_handler(slow_protocol, slow, str)
            addr = victim.listen_addrs[0]
            await greedy.connect(addr)
            calls = [
                asyncio.ensure_future(greedy.call_unary(addr, slow_protocol, str(i), str))
                for i in range(MAX_CALLS_IN_FLIGHT_PER_PEER + 5)
            ]
            await wait_until(
                lambda: (
                    calls_in_flight(victim).get(greedy.peer_id) == MAX_CALLS_IN_FLIGHT_PER_PEER
                    and sum(c.done() for c in calls) == 5
                )
            )
            refused = [c for c in calls if c.done()]
            for call in refused:
                with pytest.raises(RemoteError, match="calls of yours are in flight"):
                    call.result()
            await assert_serves(victim, honest)  # another peer is not touched
            release.set()
            async with asyncio.timeout(WAIT_SECONDS):
                answers = await asyncio.gather(*(c for c in calls if c not in refused))
            assert len(answers) == MAX_CALLS_IN_FLIGHT_PER_PEER
            await wait_until(lambda: greedy.peer_id not in calls_in_flight(victim))

    run(main())


def test_second_connection_from_the_same_identity_is_refused() -> None:
    async def main() -> None:
        identity = KeyPair.generate()
        config = PeerConfig(max_connections_per_peer=1)
        async with (
            victim_and_honest(config) as (victim, first),
            Peer(PeerConfig(identity=identity)) as original,
            Peer(PeerConfig(identity=identity)) as twin,
        ):
            await assert_serves(victim, original)
            kept = victim.connection_to(identity.peer_id)

            async def attempt() -> None:
                refused = victim.statistics().num_inbound_connections_refused
                async with asyncio.timeout(WAIT_SECONDS):
                    # The twin's handshake succeeds (it proves the identity), then the
                    # victim drops the connection: the calls on it fail.
                    with pytest.raises(ConnectionClosed):
                        await twin.call_unary(victim.listen_addrs[0], ECHO_PROTOCOL_ID, "x", str)
                await wait_until(
                    lambda: victim.statistics().num_inbound_connections_refused > refused
                )
                await wait_until(lambda: twin.connection_to(victim.peer_id) is None)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            assert victim.connection_to(identity.peer_id) is kept
            await assert_serves(victim, original)
            await assert_serves(victim, first)
            assert victim.statistics().num_connections == 2

    run(main())


# --- 9, 10: a dishonest yamux and a broken Noise transport ---------------------------


def test_data_beyond_the_window_closes_the_connection() -> None:
    async def main() -> None:
        async with victim_and_honest() as (victim, honest):

            async def attempt() -> None:
                async with raw_connection(victim) as raw:
                    stream_id = raw.session.open_stream()
                    # One Data header announcing more than the whole initial window.
                    violation = yamux_frame(_DATA, 0, stream_id, INITIAL_WINDOW_BYTES + 1)
                    await raw.send_plaintext(raw.session.data_to_send() + violation)
                    await raw.wait_for(lambda e: e == GoAwayReceived(GO_AWAY_PROTOCOL_ERROR))
                    await raw.read_until_closed()
                await wait_until(lambda: victim.statistics().num_connections == 0)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            await assert_serves(victim, honest)

    run(main())


def test_a_full_window_is_buffered_and_one_byte_more_closes_the_connection() -> None:
    async def never_read(stream: Stream) -> None:
        await stream.wait_failed()

    async def main() -> None:
        async with victim_and_honest() as (victim, honest):
            victim.set_stream_handler(SINK_PROTOCOL_ID, never_read)
            async with raw_connection(victim) as raw:
                stream_id = raw.session.open_stream()
                dialer = MultistreamDialer([SINK_PROTOCOL_ID])
                raw.session.send_data(stream_id, dialer.initial_bytes())
                await raw.flush()
                while dialer.selected is None:
                    event = await raw.wait_for(lambda e: isinstance(e, DataReceived))
                    raw.events.remove(event)
                    assert isinstance(event, DataReceived)
                    dialer.receive_data(bytes(event.data))
                # Exactly the rest of the window: allowed, and the victim buffers it.
                credit = raw.session.send_window(stream_id)
                assert raw.session.send_data(stream_id, bytes(credit)) == credit
                raw.session.ping(7)
                await raw.flush()
                await raw.wait_for(lambda e: e == PongReceived(7))
                assert victim.statistics().num_connections == 1
                # One byte more than the window: the victim hangs up on us.
                await raw.send_plaintext(yamux_frame(_DATA, 0, stream_id, 1) + b"\x00")
                await raw.wait_for(lambda e: e == GoAwayReceived(GO_AWAY_PROTOCOL_ERROR))
                await raw.read_until_closed()
            await wait_until(lambda: victim.statistics().num_connections == 0)
            await assert_serves(victim, honest)

    run(main())


@pytest.mark.parametrize(
    ("kind", "cipher"),
    [
        (kind, cipher)
        for kind in ("garbage", "shorter-than-tag", "oversized", "replayed")
        for cipher in (AESGCM_NOISE, CHACHAPOLY_NOISE)
        # A 2-byte prefix cannot announce more than /noise's limit.
        if kind != "oversized" or cipher.max_frame_bytes < 256**cipher.frame_prefix.size - 1
    ],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_bad_noise_frame_after_the_handshake_closes_the_connection(
    kind: str, cipher: NoiseCipher
) -> None:
    """Each cipher's own framing (2-byte prefixes for /noise, 4-byte for ours)."""
    prefix = cipher.frame_prefix.pack

    async def main() -> None:
        async with victim_and_honest() as (victim, honest):

            async def attempt() -> None:
                async with raw_connection(victim, cipher) as raw:
                    if kind == "garbage":
                        raw.writer.write(prefix(0x30) + os.urandom(0x30))
                    elif kind == "shorter-than-tag":
                        raw.writer.write(prefix(5) + os.urandom(5))
                    elif kind == "oversized":  # refused on the prefix: nothing is buffered
                        raw.writer.write(prefix(cipher.max_frame_bytes + 1) + os.urandom(64))
                    else:
                        frame = raw.transport.encrypt(yamux_frame(_PING, _SYN, 0, 1))
                        raw.writer.write(frame)
                        await raw.wait_for(lambda e: e == PongReceived(1))
                        raw.writer.write(frame)  # same bytes, but the nonce has moved on
                    await raw.read_until_closed()
                await wait_until(lambda: victim.statistics().num_connections == 0)

            growth = await traced_growth(attempt, repeats=100)
            assert growth < MAX_GROWTH_BYTES, growth
            await assert_serves(victim, honest)

    run(main())


SILENT_PROTOCOL_ID = "/swarmtrain/test/silent/1.0.0"


def test_a_call_that_never_sends_its_request_is_refused_after_the_first_frame_timeout() -> None:
    """A caller that opens a stream and sends nothing held it and a handler task for the
    connection's whole life; now the handler refuses it (error frame, reset)."""

    async def echo(request: str, context: CallContext) -> str:
        return request

    async def main() -> None:
        async with victim_and_honest() as (victim, attacker):
            victim.add_unary_handler(SILENT_PROTOCOL_ID, echo, str, first_frame_timeout=0.5)
            await attacker.connect(victim.listen_addrs[0])
            stream = await send_raw_call(attacker, victim, SILENT_PROTOCOL_ID, b"")
            await expect_error_frame(stream, "RemoteProtocolError")
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, attacker)

    run(main())


def test_a_handler_runs_at_most_its_bound_whatever_deadline_the_caller_sent() -> None:
    """With no deadline from the caller, a handler ran for as long as it liked; now
    ``max_handler_seconds`` bounds it and the caller hears a TimeoutError."""
    cancelled = asyncio.Event()

    async def forever(request: str, context: CallContext) -> str:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return request

    async def main() -> None:
        async with victim_and_honest() as (victim, caller):
            victim.add_unary_handler(SILENT_PROTOCOL_ID, forever, str, max_handler_seconds=0.5)
            await caller.connect(victim.listen_addrs[0])
            with pytest.raises(RemoteError, match="TimeoutError"):
                async with asyncio.timeout(WAIT_SECONDS):
                    await caller.call_unary(victim.peer_id, SILENT_PROTOCOL_ID, "x", str)
            assert cancelled.is_set()
            await wait_until(lambda: victim.statistics().num_streams == 0)
            await assert_serves(victim, caller)

    run(main())
