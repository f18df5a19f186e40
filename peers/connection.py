"""An established libp2p connection: Noise-encrypted TCP carrying a yamux session.

This is the asyncio shell around the pure machines: :class:`peers.noise.NoiseTransport`
encrypts, :class:`peers.yamux.YamuxSession` multiplexes. The connection only moves bytes
between them and the socket, wakes the streams that are waiting, and owns the tasks
that serve inbound streams (CONTRIBUTING.md, "Every task has an owner").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import cast

from multiaddr import Multiaddr

from peers.errors import (
    ConnectionClosed,
    LocalProtocolError,
    ProtocolNotSupported,
    RemoteProtocolError,
    StreamReset,
    raisable_copy,
)
from peers.identity import PeerID, PublicKey
from peers.multistream import MultistreamDialer
from peers.noise import AESGCM_NOISE, TAG_BYTES, NoiseError, NoiseTransport
from peers.socket_reader import SocketReader
from peers.socket_writer import SocketWriter
from peers.traffic import TrafficBook
from peers.yamux import HEADER_BYTES as YAMUX_HEADER_BYTES
from peers.yamux import (
    MAX_HELD_RESETS,
    VIEW_FRAME_BYTES,
    DataReceived,
    GoAwayReceived,
    SendWindowUpdated,
    StreamEnded,
    StreamOpened,
    StreamRejected,
    YamuxError,
    YamuxSession,
    YamuxStatistics,
)
from peers.yamux import StreamReset as YamuxStreamReset

logger = logging.getLogger(__name__)

#: Most bytes handed to yamux and Noise at once when writing: one Data frame's payload
#: in one frame of our AES-GCM Noise (a multiple of /noise's 64 KiB frames' payloads
#: would not fit ours exactly; this leaves /noise one short frame per 2 MiB).
SEND_PIECE_BYTES = AESGCM_NOISE.max_frame_bytes - TAG_BYTES - YAMUX_HEADER_BYTES
#: Writes smaller than this are sent at the end of the loop iteration, coalesced with
#: whatever else the connection queues meanwhile; larger ones go out at once. Yamux
#: copies exactly the frames below it, so a frame that keeps views of a writer's buffers
#: is always encrypted before the write returns (the writer may then reuse them).
SMALL_WRITE_BYTES = VIEW_FRAME_BYTES


def _first_bytes(views: list[memoryview], limit: int) -> list[memoryview]:
    """The views covering the first ``limit`` bytes of ``views`` (the last one cut)."""
    out: list[memoryview] = []
    for view in views:
        if len(view) >= limit:
            out.append(view[:limit] if len(view) > limit else view)
            return out
        out.append(view)
        limit -= len(view)
    return out


def _drop_front(views: list[memoryview], num_bytes: int) -> None:
    """Remove the first ``num_bytes`` bytes of ``views``, in place."""
    while num_bytes:
        first = views[0]
        if len(first) > num_bytes:
            views[0] = first[num_bytes:]
            return
        num_bytes -= len(first)
        del views[0]


class Stream:
    """One yamux stream: an ordered, flow-controlled byte pipe with half-close.

    ``read`` returns ``b""`` at the remote's end of stream and raises
    :class:`peers.errors.StreamReset` if the remote reset it or the connection broke.
    """

    def __init__(self, connection: Connection, stream_id: int, *, outbound: bool) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.outbound = outbound
        self.protocol: str | None = None
        self._chunks: list[bytes | memoryview] = []
        self._unread: bytes = b""  # pushed back after negotiation; already acknowledged
        self._chunk_offset = 0
        self._buffered_bytes = 0
        self._eof = False
        self._error: ConnectionClosed | None = None
        self._write_closed = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._failed = asyncio.Event()
        self._fail_callbacks: list[Callable[[], None]] = []
        self._dialer: MultistreamDialer | None = None
        self._prefix = b""  # negotiation bytes of ours not yet written (see defer_write)

    @property
    def buffered_bytes(self) -> int:
        """Bytes received and not read yet (pushed back ones not included)."""
        return self._buffered_bytes

    @property
    def has_buffered_data(self) -> bool:
        """Whether a ``read`` would return data without waiting."""
        return bool(self._buffered_bytes or self._unread)

    @property
    def remote_peer_id(self) -> PeerID:
        return self.connection.remote_peer_id

    # --- called by the connection ------------------------------------------------

    def _feed(self, data: bytes | memoryview) -> None:
        if self.protocol is not None:
            self.connection._traffic.received(self.protocol, len(data))
        self._chunks.append(data)
        self._buffered_bytes += len(data)
        self._readable.set()

    def _feed_eof(self) -> None:
        self._eof = True
        self._readable.set()

    def _fail(self, error: ConnectionClosed) -> None:
        if self._error is None:
            self._error = error
        self._readable.set()
        self._writable.set()
        self._failed.set()
        callbacks, self._fail_callbacks = self._fail_callbacks, []
        for callback in callbacks:
            callback()

    def remove_on_failure(self, callback: Callable[[], None]) -> None:
        """Undo :meth:`on_failure` (no-op if it already ran)."""
        if callback in self._fail_callbacks:
            self._fail_callbacks.remove(callback)

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the stream is reset or its connection breaks."""
        if self._error is not None:
            callback()
        else:
            self._fail_callbacks.append(callback)

    def unread(self, data: bytes) -> None:
        """Put bytes back in front of the stream (read past a protocol negotiation)."""
        self._unread = data + self._unread

    def defer_write(self, data: bytes) -> None:
        """Send ``data`` ahead of the next write or close, or before a read has to wait
        (so a remote waiting for it is never left waiting): a protocol answer rides
        with the handler's reply instead of costing a frame, a syscall and a wake-up
        of the remote of its own."""
        self._prefix += data

    def _wake_writer(self) -> None:
        self._writable.set()

    # --- reading -----------------------------------------------------------------

    async def read(self, max_bytes: int = -1) -> bytes:
        """Up to ``max_bytes`` (all buffered if -1) once some are there; ``b""`` at EOF.

        On a lazily negotiated stream, the first read first checks the remote accepted
        the protocol: :class:`ProtocolNotSupported` (and the stream is reset) if not.
        """
        if self._dialer is not None:
            await self._finish_negotiation()
        return await self._read_raw(max_bytes)

    def begin_lazy_negotiation(self, dialer: MultistreamDialer) -> None:
        """Negotiate ``dialer``'s single proposal lazily (as go-libp2p's lazy multistream
        does, saving a round trip): the proposal goes out with the first write (or
        close, or read), and the remote's answer is checked on the first read."""
        self._dialer = dialer
        self._prefix = dialer.initial_bytes()

    async def _finish_negotiation(self) -> None:
        dialer = self._dialer
        assert dialer is not None
        if self._prefix:
            await self.write_many(())
        done = False
        try:
            while dialer.selected is None:
                data = await self._read_raw(1024)
                if not data:
                    raise ProtocolNotSupported("remote closed the stream while negotiating")
                if dialer.receive_data(data):
                    raise LocalProtocolError("a lazy negotiation has no second proposal")
            done = True
        finally:
            self._dialer = None
            if not done:
                self.reset()
        if dialer.leftover:
            self.unread(dialer.leftover)

    async def read_chunks(self, max_bytes: int) -> list[bytes | memoryview]:
        """As :meth:`read`, but the pieces as they arrived, not joined: whole pieces
        while fewer than ``max_bytes`` are taken (the last may pass it), acknowledged at once;
        ``[]`` at EOF. For parsers that take pieces anyway (one wake-up and one window
        update per batch of received frames instead of per frame). Large pieces are
        views of received frames, not copies (writable where the frame was decrypted
        into a buffer of its own: nothing else refers to it)."""
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        if self._dialer is not None or self._unread:
            data = await self.read(max_bytes)
            return [data] if data else []
        if not await self._wait_readable():
            return []
        chunks: list[bytes | memoryview] = []
        total = 0
        while self._chunks and total < max_bytes:
            # Whole pieces, the last one too: a frame that arrived in one piece is parsed
            # as one (a view, not a copy), however it lies against max_bytes.
            piece = self._take(len(self._chunks[0]) - self._chunk_offset)
            chunks.append(piece)
            total += len(piece)
        self.connection._consumed(self.stream_id, total)
        return chunks

    async def _wait_readable(self) -> bool:
        """Wait until data is buffered (True) or the stream ended (False); raises the
        stream's error once nothing buffered is left to deliver. Deferred bytes of ours
        go out first: the remote may be waiting for them before it sends."""
        if not self._buffered_bytes and self._prefix and self._error is None:
            await self.write_many(())  # ConnectionClosed if it cannot go: so could the read
        while not self._buffered_bytes:
            if self._error is not None:
                raise self._error.fresh()
            if self._eof:
                return False
            self._readable.clear()
            await self._readable.wait()
        return True

    async def _read_raw(self, max_bytes: int) -> bytes:
        if self._unread:
            cut = len(self._unread) if max_bytes < 0 else max_bytes
            data, self._unread = self._unread[:cut], self._unread[cut:]
            return data
        if not await self._wait_readable():
            return b""
        # Data that arrived before a reset is still delivered (e.g. a multistream "na"
        # the remote sent just before resetting); the reset is raised once it is read.
        piece = self._take(max_bytes)
        self.connection._consumed(self.stream_id, len(piece))
        return piece if isinstance(piece, bytes) else piece.tobytes()

    def _take(self, max_bytes: int) -> bytes | memoryview:
        first = self._chunks[0]
        data: bytes | memoryview
        if self._chunk_offset == 0 and (max_bytes < 0 or max_bytes >= len(first)):
            if max_bytes < 0 and len(self._chunks) > 1:
                data = b"".join(self._chunks)
                self._chunks.clear()
            else:
                data = self._chunks.pop(0)
        else:
            end = len(first) if max_bytes < 0 else min(len(first), self._chunk_offset + max_bytes)
            data = first[self._chunk_offset : end]
            if end == len(first):
                self._chunks.pop(0)
                self._chunk_offset = 0
            else:
                self._chunk_offset = end
        self._buffered_bytes -= len(data)
        return data

    async def readexactly(self, num_bytes: int) -> bytes:
        """Exactly ``num_bytes``; raises :class:`asyncio.IncompleteReadError` at early EOF."""
        parts: list[bytes] = []
        remaining = num_bytes
        while remaining:
            data = await self.read(remaining)
            if not data:
                raise asyncio.IncompleteReadError(b"".join(parts), num_bytes)
            parts.append(data)
            remaining -= len(data)
        return b"".join(parts)

    # --- writing -----------------------------------------------------------------

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """Send all of ``data``, waiting for the remote's window and the socket."""
        await self.write_many((data,))

    async def write_many(self, buffers: Iterable[bytes | bytearray | memoryview]) -> None:
        """Send the buffers in order, as if concatenated, without concatenating large ones.

        Small buffers (a frame's length prefix and msgpack head) are joined first so
        they travel as one yamux frame.
        """
        buffers = list(buffers)
        if self._prefix:
            buffers.insert(0, self._prefix)
            self._prefix = b""
        if len(buffers) > 1 and sum(len(b) for b in buffers) < SMALL_WRITE_BYTES:
            buffers = [b"".join(buffers)]
        views = [memoryview(data).cast("B") for data in buffers if len(data)]
        if self.protocol is not None:
            self.connection._traffic.sent(self.protocol, sum(len(v) for v in views))
        while views:
            if self._error is not None:
                raise self._error.fresh()
            if self._write_closed:
                raise ConnectionClosed("stream was closed for writing", by_us=True)
            sent = self.connection._send(self.stream_id, _first_bytes(views, SEND_PIECE_BYTES))
            _drop_front(views, sent)
            if views and not sent:
                self._writable.clear()
                await self._writable.wait()
        await self.connection._drain()

    async def close(self) -> None:
        """Half-close: we send no more; the remote may still send until it closes."""
        if self._write_closed or self._error is not None:
            return
        if self._prefix:
            await self.write_many(())
        self._write_closed = True
        self.connection._close_stream(self.stream_id)
        with contextlib.suppress(ConnectionClosed, ConnectionError):
            await self.connection._drain()

    def reset(self) -> None:
        """Abort the stream both ways; the remote sees a reset."""
        if self._error is None:
            self._fail(StreamReset("stream was reset by us", by_us=True))
            self.connection._reset_stream(self.stream_id)

    async def wait_failed(self) -> ConnectionClosed:
        """Wait until the stream is reset (by either side) or its connection breaks."""
        await self._failed.wait()
        assert self._error is not None
        return self._error

    @property
    def is_reset(self) -> bool:
        return isinstance(self._error, StreamReset)


StreamHandler = Callable[[Stream], Awaitable[None]]


#: Where ``struct tcp_info`` keeps ``tcpi_rtt`` (microseconds): after 8 one-byte fields
#: and 15 four-byte ones, in every Linux since 2.6.
_TCPI_RTT_OFFSET = 68


def tcp_round_trip_seconds(sock: socket.socket) -> float | None:
    """``sock``'s smoothed round-trip time by the kernel's TCP (Linux ``TCP_INFO``),
    ``None`` where it cannot be read or is not measured yet."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or sock.type != socket.SOCK_STREAM:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, option, _TCPI_RTT_OFFSET + 4)
    except OSError:
        return None
    if len(info) < _TCPI_RTT_OFFSET + 4:
        return None
    (micros,) = struct.unpack_from("I", info, _TCPI_RTT_OFFSET)
    return micros / 1e6 if micros > 0 else None


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    remote_peer_id: PeerID
    remote_address: Multiaddr
    outbound: bool


class Connection:
    """A secured, multiplexed connection to one remote peer."""

    def __init__(
        self,
        *,
        reader: SocketReader,
        writer: asyncio.StreamWriter,
        transport: NoiseTransport,
        security_protocol: str,
        session: YamuxSession,
        remote_peer_id: PeerID,
        remote_public_key: PublicKey,
        remote_address: Multiaddr,
        outbound: bool,
        initial_plaintext: bytes,
        on_inbound_stream: Callable[[Stream], Awaitable[None]],
        traffic: TrafficBook | None = None,
        keepalive: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """``keepalive``: (interval, timeout) seconds of :meth:`_keep_alive`; an
        interval of 0, none."""
        self._reader = reader
        self._writer = writer
        self._socket_writer = SocketWriter(writer)
        self._transport = transport
        #: The secure channel's multistream id: which Noise cipher the two sides agreed on.
        self.security_protocol = security_protocol
        self._session = session
        self.remote_peer_id = remote_peer_id
        self.remote_public_key = remote_public_key
        self.remote_address = remote_address
        self.outbound = outbound
        #: Whether the connection runs through a circuit relay (inside one of the relay
        #: connection's streams) rather than directly over TCP.
        self.relayed = False
        self._initial_plaintext = initial_plaintext
        self._on_inbound_stream = on_inbound_stream
        self._traffic = traffic if traffic is not None else TrafficBook()
        self._streams: dict[int, Stream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed: ConnectionClosed | None = None
        #: When a stream last opened or ended (monotonic): idle time counts from it.
        self._streams_changed_at = time.monotonic()
        self._closed_event = asyncio.Event()
        self._flush_scheduled = False
        self._releasing: asyncio.Task[None] | None = None  # held replies, once drained
        self._reading_paused = False
        self._keepalive = keepalive
        self._last_received = time.monotonic()  # any bytes at all from the remote

    @property
    def is_closed(self) -> bool:
        return self._closed is not None

    @property
    def closed_by_us(self) -> bool:
        """Closed, and by this side (``close()``, a keepalive or protocol failure of
        ours), not by the remote or the network."""
        return self._closed is not None and self._closed.by_us

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def idle_seconds(self, now: float) -> float | None:
        """Seconds since the last stream ended (or the connection opened), ``None``
        while a stream is open. ``now``: ``time.monotonic()``."""
        if self._streams:
            return None
        return max(0.0, now - self._streams_changed_at)

    def round_trip_seconds(self) -> float | None:
        """The kernel's smoothed round-trip time of this connection's TCP socket
        (``TCP_INFO``'s ``tcpi_rtt``), ``None`` where there is none to read: a relayed
        connection, a platform without ``TCP_INFO``, a closed socket. Measured by TCP
        itself on every acknowledged segment, so it costs nothing to ask."""
        if self.relayed or self.is_closed:
            return None
        sock = self._writer.get_extra_info("socket")
        return tcp_round_trip_seconds(sock) if sock is not None else None

    def session_statistics(self) -> YamuxStatistics:
        """Counters of the yamux session: streams, and bytes each way."""
        return self._session.statistics()

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    # --- lifecycle ---------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it closes; owns every inbound stream's task."""
        reason: ConnectionClosed = ConnectionClosed("connection closed by remote")
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                try:
                    if self._initial_plaintext:
                        self._handle_plaintext(self._initial_plaintext)
                        self._flush()
                    ended: asyncio.Future[BaseException | None] = (
                        asyncio.get_running_loop().create_future()
                    )

                    def receive(data: bytes | memoryview) -> None:
                        if ended.done():
                            return
                        self._last_received = time.monotonic()
                        self._session.hold_replies(self._backlogged())
                        try:
                            for plaintext in self._transport.receive_frames(data):
                                self._handle_plaintext(plaintext)
                        except Exception as e:  # judged in run(), below
                            ended.set_result(e)
                            return
                        # Soon, not now: acks and window updates then leave together
                        # with what the streams woken by this data answer meanwhile.
                        self._flush_soon()
                        if self._session.holds_replies:
                            self._release_when_drained()

                    def end(error: BaseException | None) -> None:
                        if not ended.done():
                            ended.set_result(error)

                    if self._closed is None:
                        self._reader.divert(receive, end)
                        if self._keepalive[0] > 0:
                            keeping = group.create_task(self._keep_alive(*self._keepalive))
                            self._tasks.add(keeping)  # (cancelled with the connection)
                        error = await ended
                        if error is not None:  # the future keeps the original
                            raise raisable_copy(error) from None
                except (NoiseError, YamuxError, RemoteProtocolError) as e:
                    logger.info("closing connection to %s: %s", self.remote_peer_id, e)
                    reason = ConnectionClosed(f"remote broke the protocol: {e}")
                    self._flush_quietly()
                except (ConnectionError, OSError) as e:
                    reason = ConnectionClosed(f"connection broke: {e}")
                finally:
                    self._shutdown(self._closed or reason)
        finally:
            self._closed_event.set()

    async def _keep_alive(self, interval: float, timeout: float) -> None:
        """Ping the remote once nothing came from it for ``interval`` seconds, and close
        the connection if nothing at all comes back within ``timeout``: the path died
        without a word (a NAT mapping dropped, a cable pulled), and TCP would retransmit
        into it for many minutes while every call on it timed out. Closed, the next call
        dials afresh. Runs as long as the connection; each turn sleeps."""
        nonce = 0
        while self._closed is None:
            quiet = time.monotonic() - self._last_received
            if quiet < interval:
                await asyncio.sleep(interval - quiet)
                continue
            pinged_at = time.monotonic()
            nonce = (nonce + 1) % (1 << 32)
            with contextlib.suppress(YamuxError):
                self._session.ping(nonce)
            self._flush_quietly()
            await asyncio.sleep(timeout)
            if self._closed is None and self._last_received < pinged_at:
                logger.info(
                    "closing the connection to %s: nothing from it for %.0f s, not even "
                    "an answer to a ping",
                    self.remote_peer_id,
                    time.monotonic() - self._last_received,
                )
                self._shutdown(
                    ConnectionClosed(
                        f"{self.remote_peer_id} did not answer a keepalive ping in "
                        f"{timeout:g} s: the path to it died"
                    )
                )
                self._writer.transport.abort()  # what is buffered for it will never go
                return

    def _backlogged(self) -> bool:
        """Whether our writes to the remote wait (above the transport's high-water mark):
        it reads slower than we write, or not at all."""
        transport = self._writer.transport
        return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]

    def _release_when_drained(self) -> None:
        """Held replies (:meth:`YamuxSession.hold_replies`) go out once our writes have
        drained; past :data:`MAX_HELD_RESETS` refused streams, we stop reading until then:
        a remote that provokes replies it does not read costs us a bounded buffer."""
        if self._session.num_held_resets > MAX_HELD_RESETS and not self._reading_paused:
            logger.info(
                "%s does not read the replies it provokes: reading from it paused",
                self.remote_peer_id,
            )
            self._reading_paused = True
            cast(asyncio.Transport, self._writer.transport).pause_reading()
        if self._releasing is None:
            self._releasing = self._group.create_task(self._release_held_replies())
            self._tasks.add(self._releasing)  # (cancelled with the connection)
            self._releasing.add_done_callback(self._tasks.discard)

    async def _release_held_replies(self) -> None:
        try:
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.drain()  # returns below the transport's low-water mark
            if self._closed is None:
                self._session.hold_replies(False)
                self._flush_quietly()
                if self._reading_paused:
                    self._reading_paused = False
                    cast(asyncio.Transport, self._writer.transport).resume_reading()
        finally:
            self._releasing = None

    def close(self) -> None:
        """Close now: every stream fails with ConnectionClosed(by_us=True)."""
        if self._closed is None:
            with contextlib.suppress(YamuxError):
                self._session.go_away(0)
            self._flush_quietly()
            self._shutdown(ConnectionClosed("connection closed by us", by_us=True))

    def _shutdown(self, reason: ConnectionClosed) -> None:
        if self._closed is None:
            self._closed = reason
        for stream in self._streams.values():
            stream._fail(StreamReset(str(reason), by_us=reason.by_us))
        self._streams.clear()
        for task in self._tasks:
            task.cancel()
        self._writer.close()
        # Wakes the reader loop if close() was called from outside it.
        self._reader.feed_eof()

    # --- events from the session -------------------------------------------------

    def _handle_plaintext(self, plaintext: bytes | memoryview) -> None:
        # Each plaintext is a fresh buffer of the Noise layer's: bulk payloads stay views.
        for event in self._session.receive_data(plaintext, owned=True):
            if isinstance(event, DataReceived):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream._feed(event.data)
            elif isinstance(event, SendWindowUpdated):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream._wake_writer()
            elif isinstance(event, StreamOpened):
                stream = Stream(self, event.stream_id, outbound=False)
                self._streams[event.stream_id] = stream
                self._streams_changed_at = time.monotonic()
                task = self._group.create_task(self._serve_inbound(stream))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(event, StreamEnded):
                stream = self._streams.get(event.stream_id)
                if stream is not None:
                    stream._feed_eof()
                    self._forget_if_done(stream)
            elif isinstance(event, YamuxStreamReset):
                stream = self._streams.pop(event.stream_id, None)
                if stream is not None:
                    self._streams_changed_at = time.monotonic()
                    stream._fail(StreamReset("stream was reset by the remote"))
            elif isinstance(event, StreamRejected):
                logger.info(
                    "refused a stream from %s: stream limit reached or closing",
                    self.remote_peer_id,
                )
            elif isinstance(event, GoAwayReceived):
                self._closed = ConnectionClosed(f"remote went away (code {event.code})")

    async def _serve_inbound(self, stream: Stream) -> None:
        try:
            await self._on_inbound_stream(stream)
        except ConnectionClosed as e:  # the remote reset it or left mid-request: theirs
            logger.info("handler for %s ended: %r", stream.protocol, e)
            stream.reset()
        except Exception as e:  # a handler's failure costs only its stream
            logger.warning("handler for %s failed: %r", stream.protocol, e)
            stream.reset()
        finally:
            self._forget_if_done(stream)

    # --- called by streams --------------------------------------------------------

    def _flush(self) -> None:
        self._flush_scheduled = False
        frames = self._session.frames_to_send()
        if frames and not self._writer.is_closing():
            self._socket_writer.writelines(self._transport.encrypt_frames(frames))

    def _flush_quietly(self) -> None:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            self._flush()

    def _flush_soon(self) -> None:
        """Flush at the end of this loop iteration, so a stream's SYN, protocol
        proposal, request and FIN (or a reply and its FIN) share one Noise frame and one
        syscall instead of four."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_quietly)

    async def _drain(self) -> None:
        if self._closed is not None:
            raise self._closed.fresh()
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise ConnectionClosed(f"connection broke: {e}") from e

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed.fresh()

    def open_stream_raw(self) -> Stream:
        """A new outbound stream (no protocol negotiated yet)."""
        self._check_open()
        stream_id = self._session.open_stream()
        stream = Stream(self, stream_id, outbound=True)
        self._streams[stream_id] = stream
        self._streams_changed_at = time.monotonic()
        self._flush_soon()
        return stream

    def _send(self, stream_id: int, pieces: list[memoryview]) -> int:
        self._check_open()
        try:
            sent = self._session.send_pieces(stream_id, pieces)
        except YamuxError as e:
            raise StreamReset(f"stream is gone: {e}") from e
        if sent < SMALL_WRITE_BYTES:
            self._flush_soon()
        else:  # bulk: keep the pipe full and the queue short
            self._flush()
        return sent

    def _consumed(self, stream_id: int, num_bytes: int) -> None:
        if self._closed is None and num_bytes:
            with contextlib.suppress(YamuxError):
                self._session.acknowledge_received(stream_id, num_bytes)
            self._flush_soon()

    def _close_stream(self, stream_id: int) -> None:
        self._check_open()
        with contextlib.suppress(YamuxError):
            self._session.close_stream(stream_id)
        self._flush_soon()
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._forget_if_done(stream)

    def _reset_stream(self, stream_id: int) -> None:
        if self._streams.pop(stream_id, None) is not None:
            self._streams_changed_at = time.monotonic()
        if self._closed is None:
            with contextlib.suppress(YamuxError):
                self._session.reset_stream(stream_id)
            self._flush_soon()

    def _forget_if_done(self, stream: Stream) -> None:
        if (stream._write_closed and stream._eof) or stream._error is not None:
            if self._streams.get(stream.stream_id) is stream:
                del self._streams[stream.stream_id]
                self._streams_changed_at = time.monotonic()
