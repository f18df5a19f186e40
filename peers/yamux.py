"""The yamux 1.0 session protocol as a pure state machine: no I/O, no clock.

Follows hashicorp/yamux spec.md ("Framing", "Message Flow", "Flow Control", "Session
termination") and the behaviour of go-yamux as go-libp2p runs it under the protocol id
``/yamux/1.0.0``. Bytes from the wire go into :meth:`YamuxSession.receive_data`, which returns
events; bytes for the wire come out of :meth:`YamuxSession.data_to_send`. The caller moves the
bytes and enforces deadlines.

A stream the remote opens is acknowledged (a Window Update with ACK) together with the
first frame we send on it, or with the next bytes the session sends at all, whichever
comes first, and at once if more than MAX_OWED_ACKS are owed: a request that opens a
stream and is answered by one reply then costs one write each way, not two. The ACK
stays a frame of its own rather than a flag on the data, FIN or RST frame (spec.md
allows either): py-libp2p 0.8.1 reads a FIN or RST that carries ACK as a bare ACK.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from peers.errors import LocalProtocolError, PeersError, RemoteProtocolError

YAMUX_PROTOCOL_ID = "/yamux/1.0.0"

# spec.md "Flow Control": every stream starts with a 256 KiB window in both directions.
INITIAL_WINDOW_BYTES = 256 * 1024
# Streams the remote may have open at once on one session (and, counted apart, we may): far
# more than one pair of peers needs for RPCs plus bulk transfers, yet it bounds the state a
# remote can make us keep. Extra SYNs are refused with RST, as go-yamux does.
MAX_STREAMS = 512
# Largest receive window one stream may grow to: go-yamux's (and go-libp2p's) default
# MaxStreamWindowSize; it keeps ~1 Gbit/s flowing at 130 ms RTT.
MAX_WINDOW_BYTES = 16 * 1024 * 1024
# Bytes a stream must have delivered to the application before it is granted the
# window the session's streams learned (a quarter of the initial window: one bulk frame).
WARM_AFTER_BYTES = INITIAL_WINDOW_BYTES // 4
# Window growth beyond the initial windows, summed over all streams of one session. Without
# it a remote could make the application buffer MAX_STREAMS * MAX_WINDOW_BYTES (8 GiB); with
# it, at most MAX_STREAMS * INITIAL_WINDOW_BYTES + this. Four streams at full size fit.
MAX_WINDOW_GROWTH_BYTES = 64 * 1024 * 1024
# Default payload of one outgoing Data frame: just under go-yamux's MaxMessageSize (64 KiB
# with the header), so a bulk stream never holds the wire long enough to delay other
# streams' small frames, and sized so header + payload fill exactly one libp2p Noise
# transport frame (65535 bytes less its 16-byte tag): each Data frame is encrypted whole,
# with no re-slicing. A connection under our AES-GCM Noise, whose frames hold 2 MiB, sets
# its own (``max_frame_payload_bytes``).
MAX_FRAME_PAYLOAD_BYTES = 65535 - 16 - 12  # less the tag and the header
#: A payload that is at least half of the buffer it was fed in is handed on as a view of
#: it instead of a copy, when that buffer is ``bytes`` (immutable, so the view stays
#: valid) or handed over (``receive_data(owned=True)``): for bulk transfers (one Noise
#: frame, one yamux frame) one memcpy less per byte received. Any other is copied, so a
#: view never keeps alive more than twice its own length (a remote could otherwise pin a
#: whole Noise frame with each 1-byte payload its window allows).
_NOT_SHAREABLE = 1 << 62
#: Outgoing Data frames this long keep views of the writer's buffers (see send_pieces);
#: shorter ones are copied, so a writer may reuse its buffer as soon as it returns.
VIEW_FRAME_BYTES = 16 * 1024
# Streams the remote opened that may wait for our ACK until we send something: go-yamux
# lets a dialer have 256 unacknowledged streams, then blocks it until one is.
MAX_OWED_ACKS = 128
# Refused streams whose RST may wait while the remote does not read what we send (see
# YamuxSession.hold_replies): past this many, the connection stops reading from it.
MAX_HELD_RESETS = 1024
# Pongs and RSTs queued between two frames_to_send: more are held as while the
# connection is backlogged (one read of the socket can hold a million pings).
MAX_QUEUED_REPLIES = 4096
# Closed remote stream ids we remember to catch a reused id. go-yamux takes an id before it
# sends the SYN, so two openers' SYNs may cross and "ids only grow" would misfire; an id
# reused after this many closes is merely a new stream, which max_streams still bounds.
MAX_REMEMBERED_CLOSED_IDS = 1024

# spec.md "Session termination": go-away codes.
GO_AWAY_NORMAL = 0
GO_AWAY_PROTOCOL_ERROR = 1
GO_AWAY_INTERNAL_ERROR = 2

# spec.md "Framing": version, type, flags, stream id, length; all big endian.
_HEADER = struct.Struct(">BBHII")
HEADER_BYTES = _HEADER_SIZE = _HEADER.size  # every frame starts with one header
_VERSION = 0
_DATA, _WINDOW_UPDATE, _PING, _GO_AWAY = 0, 1, 2, 3
_SYN, _ACK, _FIN, _RST = 1, 2, 4, 8
_MAX_U32 = 0xFFFF_FFFF
_Buffer: TypeAlias = bytes | bytearray | memoryview
#: A frame for the wire: ``bytes``, or a header and the pieces of its payload, to be sent
#: as if concatenated (never joined here: a bulk payload stays where the writer had it).
OutgoingFrame: TypeAlias = bytes | tuple[_Buffer, ...]


class YamuxError(PeersError):
    """Base of all yamux errors."""


class YamuxProtocolError(YamuxError, RemoteProtocolError):
    """The remote broke the protocol; the session is dead and a go-away is queued."""


class YamuxStreamError(YamuxError, LocalProtocolError):
    """Local misuse: an unknown or closed stream, or a session that is already dead."""


@dataclass(frozen=True, slots=True)
class StreamOpened:  # The remote opened a stream (SYN); our ACK goes with our next bytes.
    stream_id: int


@dataclass(frozen=True, slots=True)
class DataReceived:  # Stream payload; acknowledge_received its length once consumed.
    stream_id: int
    data: bytes | memoryview
    """A copy, or (see ``_NOT_SHAREABLE``) a view of the bytes that were fed: read-only
    if they were ``bytes``, writable if they were a handed-over buffer."""


@dataclass(frozen=True, slots=True)
class StreamEnded:  # The remote half-closed the stream (FIN): it will send no more data.
    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:  # The remote reset the stream (RST); it is forgotten.
    stream_id: int


@dataclass(frozen=True, slots=True)
class SendWindowUpdated:  # The remote granted more send window on the stream.
    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamRejected:  # We refused a remote SYN (stream bound, or our go-away); RST is queued.
    stream_id: int


@dataclass(frozen=True, slots=True)
class PingReceived:  # The remote pinged us; the pong is queued (or held: hold_replies).
    opaque: int


@dataclass(frozen=True, slots=True)
class PongReceived:  # The remote answered one of our pings.
    opaque: int


@dataclass(frozen=True, slots=True)
class GoAwayReceived:  # The remote will accept no new streams; code is one of GO_AWAY_*.
    code: int


YamuxEvent: TypeAlias = (
    StreamOpened
    | DataReceived
    | StreamEnded
    | StreamReset
    | SendWindowUpdated
    | StreamRejected
    | PingReceived
    | PongReceived
    | GoAwayReceived
)


@dataclass(frozen=True, slots=True, kw_only=True)
class YamuxStatistics:
    """A snapshot of one session's counters."""

    num_open_streams: int
    num_inbound_streams: int
    num_outbound_streams: int
    num_streams_rejected: int
    num_data_bytes_sent: int
    num_data_bytes_received: int
    num_wire_bytes_sent: int
    num_wire_bytes_received: int
    window_growth_bytes: int
    num_replies_held: int = 0
    """Pongs and RSTs the remote provoked while it did not read what we sent, held back
    (pongs coalesced into the latest) instead of queued."""


@dataclass(slots=True)
class _Stream:
    stream_id: int
    is_inbound: bool
    send_window: int = INITIAL_WINDOW_BYTES
    recv_window: int = INITIAL_WINDOW_BYTES  # the window size we grant now
    recv_credit: int = INITIAL_WINDOW_BYTES  # bytes the remote may still send
    num_unconsumed: int = 0  # announced by Data headers, not yet acknowledged by the app
    num_consumed_since_growth: int = 0
    local_closed: bool = False
    remote_closed: bool = False
    ack_pending: bool = False  # opened by the remote, not yet acknowledged
    warmed: bool = False  # granted the session's learned window already


def _data_frame(stream_id: int, pieces: list[_Buffer], num_bytes: int) -> OutgoingFrame:
    header = _HEADER.pack(_VERSION, _DATA, 0, stream_id, num_bytes)
    if num_bytes < VIEW_FRAME_BYTES:
        return header + b"".join(pieces)
    return (header, *pieces)


def _check_u32(name: str, value: int) -> None:
    if not 0 <= value <= _MAX_U32:
        raise ValueError(f"{name} must fit in 32 bits unsigned, got {value}")


class YamuxSession:
    """One side of a yamux session. ``is_client`` is True on the connection's dialer."""

    def __init__(
        self,
        *,
        is_client: bool,
        max_streams: int = MAX_STREAMS,
        max_window_bytes: int = MAX_WINDOW_BYTES,
        max_window_growth_bytes: int = MAX_WINDOW_GROWTH_BYTES,
        max_frame_payload_bytes: int = MAX_FRAME_PAYLOAD_BYTES,
    ) -> None:
        """Raises ValueError on a bound that makes no sense. ``max_frame_payload_bytes``
        bounds what we send in one Data frame; what we accept is bounded by the windows."""
        if not 1 <= max_frame_payload_bytes <= _MAX_U32:
            raise ValueError(
                f"max_frame_payload_bytes must be in [1, 4 GiB), got {max_frame_payload_bytes}"
            )
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        if not INITIAL_WINDOW_BYTES <= max_window_bytes <= _MAX_U32:
            raise ValueError(
                f"max_window_bytes must be in [256 KiB, 4 GiB), got {max_window_bytes}"
            )
        if max_window_growth_bytes < 0:
            raise ValueError(f"max_window_growth_bytes must be >= 0, got {max_window_growth_bytes}")
        self.is_client = is_client
        self._max_streams = max_streams
        self._max_window_bytes = max_window_bytes
        self._max_window_growth_bytes = max_window_growth_bytes
        self._max_frame_payload = max_frame_payload_bytes
        self._streams: dict[int, _Stream] = {}
        self._next_id = 1 if is_client else 2  # spec.md "StreamID Field": client odd, server even
        self._remote_parity = 0 if is_client else 1
        self._highest_remote_id = 0
        self._closed_remote_ids: set[int] = set()
        self._closed_remote_order: deque[int] = deque()
        self._num_inbound = 0
        self._num_outbound = 0
        self._window_growth_bytes = 0
        # The largest window a stream of this session grew to: a new stream is granted it
        # at once instead of doubling up from 256 KiB again (at a 200 ms round trip the
        # doubling took a second of every bulk transfer).
        self._learned_window = INITIAL_WINDOW_BYTES
        self._out: list[OutgoingFrame] = []
        self._unacked: dict[int, _Stream] = {}  # remote-opened streams awaiting our ACK
        self._header_buf = bytearray()
        self._fed_bytes = _NOT_SHAREABLE
        self._body_stream: _Stream | None = None  # None while a body is being discarded
        self._body_remaining = 0
        self._body_flags = 0
        self._local_go_away = False
        self._remote_go_away = False
        self._failed = False
        self._num_streams_rejected = 0
        self._num_data_bytes_sent = 0
        self._num_data_bytes_received = 0
        self._num_wire_bytes_sent = 0
        self._num_wire_bytes_received = 0
        self._holding = False
        self._num_replies_queued = 0  # since the last frames_to_send
        self._held_pong: int | None = None
        self._held_resets: list[int] = []
        self._num_replies_held = 0

    def receive_data(self, data: _Buffer, *, owned: bool = False) -> list[YamuxEvent]:
        """Feed bytes from the wire, split anywhere; return the events they complete, in order.

        ``owned``: the caller hands ``data`` over and nothing else will change it, so large
        payloads may be views of it (writable, if it is) rather than copies.

        Raises YamuxProtocolError if the remote broke the protocol: the session is then
        dead, and data_to_send() ends with a go-away carrying GO_AWAY_PROTOCOL_ERROR.
        Raises YamuxStreamError if the session is already dead.
        """
        self._check_alive()
        events: list[YamuxEvent] = []
        view = memoryview(data).cast("B")
        # What a view of it would keep alive (see _on_body); none unless it is immutable
        # or handed over.
        owner = view.obj
        shareable = owned or isinstance(owner, bytes)
        self._fed_bytes = len(owner) if shareable else _NOT_SHAREABLE  # type: ignore[arg-type]
        pos, end = 0, len(view)
        self._num_wire_bytes_received += end
        try:
            while pos < end:
                if self._body_remaining:
                    take = min(self._body_remaining, end - pos)
                    self._on_body(view[pos : pos + take], events)
                    pos += take
                elif self._header_buf or end - pos < _HEADER_SIZE:
                    take = min(_HEADER_SIZE - len(self._header_buf), end - pos)
                    self._header_buf += view[pos : pos + take]
                    pos += take
                    if len(self._header_buf) == _HEADER_SIZE:
                        header = _HEADER.unpack(self._header_buf)
                        self._header_buf.clear()
                        self._on_header(header, events)
                else:
                    self._on_header(_HEADER.unpack_from(view, pos), events)
                    pos += _HEADER_SIZE
        except YamuxProtocolError:
            self._fail()
            raise
        return events

    def _on_header(self, header: tuple[int, int, int, int, int], events: list[YamuxEvent]) -> None:
        version, kind, flags, stream_id, length = header
        if version != _VERSION:
            raise YamuxProtocolError(f"remote sent yamux version {version}; we speak {_VERSION}")
        if kind == _DATA or kind == _WINDOW_UPDATE:
            self._on_stream_frame(kind == _DATA, flags, stream_id, length, events)
        elif kind == _PING or kind == _GO_AWAY:
            if stream_id != 0:  # spec.md: "Both Ping and Go Away messages should always use 0"
                raise YamuxProtocolError(f"remote sent ping or go-away on stream {stream_id}")
            if kind == _GO_AWAY:
                self._remote_go_away = True
                events.append(GoAwayReceived(length))
            elif flags & _SYN:  # spec.md: SYN marks a ping, ACK its answer
                if self._holds_replies():
                    self._held_pong = length  # only the latest: the remote waits for that one
                    self._num_replies_held += 1
                else:
                    self._queue(_PING, _ACK, 0, length)
                    self._num_replies_queued += 1
                events.append(PingReceived(length))
            else:
                events.append(PongReceived(length))
        else:
            raise YamuxProtocolError(f"remote sent unknown frame type {kind}")

    def _on_stream_frame(
        self, is_data: bool, flags: int, stream_id: int, length: int, events: list[YamuxEvent]
    ) -> None:
        if stream_id == 0:
            raise YamuxProtocolError("remote sent a data or window update frame on stream 0")
        stream = self._streams.get(stream_id)
        if flags & _SYN:
            stream = self._on_syn(stream_id, events)
        elif stream is None and not self._was_used(stream_id):
            raise YamuxProtocolError(f"remote sent a frame for stream {stream_id}, never opened")
        if stream is None:  # rejected, or reset/closed earlier: a race, not an error
            self._discard(length if is_data else 0)
            return
        if flags & _RST:
            self._forget(stream)
            events.append(StreamReset(stream_id))
            self._discard(length if is_data else 0)
            return
        if is_data and length:
            if stream.remote_closed:
                raise YamuxProtocolError(f"remote sent data on stream {stream_id} after its FIN")
            if length > stream.recv_credit:  # checked before any of the body is taken in
                raise YamuxProtocolError(
                    f"remote sent {length} bytes on stream {stream_id} with a window of "
                    f"{stream.recv_credit}"
                )
            stream.recv_credit -= length
            stream.num_unconsumed += length
            self._body_stream, self._body_remaining, self._body_flags = stream, length, flags
            return  # FIN, if any, takes effect once the body is in
        if not is_data and length:
            stream.send_window += length
            if stream.send_window > _MAX_U32:  # go-yamux keeps windows in a uint32
                raise YamuxProtocolError(f"remote overflowed the send window of stream {stream_id}")
            if not stream.local_closed:
                events.append(SendWindowUpdated(stream_id))
        self._apply_fin(stream, flags, events)

    def _on_body(self, chunk: memoryview, events: list[YamuxEvent]) -> None:
        self._body_remaining -= len(chunk)
        stream = self._body_stream
        if stream is None:
            return
        self._num_data_bytes_received += len(chunk)
        shared = 2 * len(chunk) >= self._fed_bytes
        events.append(DataReceived(stream.stream_id, chunk if shared else chunk.tobytes()))
        if not self._body_remaining:
            self._body_stream = None
            self._apply_fin(stream, self._body_flags, events)

    def _on_syn(self, stream_id: int, events: list[YamuxEvent]) -> _Stream | None:
        if stream_id & 1 != self._remote_parity:
            raise YamuxProtocolError(f"remote opened stream {stream_id}, which has our parity")
        if stream_id in self._streams or stream_id in self._closed_remote_ids:
            raise YamuxProtocolError(f"remote reused stream id {stream_id}")
        self._highest_remote_id = max(self._highest_remote_id, stream_id)
        if self._num_inbound >= self._max_streams or self._local_go_away:
            if self._holds_replies():
                self._held_resets.append(stream_id)
                self._num_replies_held += 1
            else:
                self._queue(_WINDOW_UPDATE, _RST, stream_id, 0)
                self._num_replies_queued += 1
            self._remember_closed(stream_id)
            self._num_streams_rejected += 1
            events.append(StreamRejected(stream_id))
            return None
        stream = _Stream(stream_id, is_inbound=True)
        self._streams[stream_id] = stream
        self._num_inbound += 1
        stream.ack_pending = True
        self._unacked[stream_id] = stream
        if len(self._unacked) > MAX_OWED_ACKS:
            self._out += self._owed_acks()
        events.append(StreamOpened(stream_id))
        return stream

    def _apply_fin(self, stream: _Stream, flags: int, events: list[YamuxEvent]) -> None:
        if flags & _FIN and not stream.remote_closed:
            stream.remote_closed = True
            events.append(StreamEnded(stream.stream_id))
            if stream.local_closed:
                self._forget(stream)

    def _was_used(self, stream_id: int) -> bool:
        if stream_id & 1 == self._remote_parity:
            return stream_id <= self._highest_remote_id
        return stream_id < self._next_id

    def _discard(self, length: int) -> None:
        # Skipped as it arrives, never buffered, so its length needs no bound.
        self._body_stream, self._body_remaining = None, length

    def data_to_send(self) -> bytes:
        """Return and clear every byte queued for the wire."""
        return b"".join(
            piece
            for frame in self.frames_to_send()
            for piece in (frame if isinstance(frame, tuple) else (frame,))
        )

    def frames_to_send(self) -> list[OutgoingFrame]:
        """Return and clear the queued frames, one per frame (header included): ``bytes``,
        or a tuple of the header and the payload's pieces.

        The same bytes as :meth:`data_to_send` without joining them: a bulk writer hands
        each frame to the encryption layer as it is, instead of building one big buffer.
        """
        if self._unacked and self._out:  # the ACKs still owed go out now, ahead of it
            self._out[:0] = self._owed_acks()
        out = self._out
        self._out = []
        self._num_replies_queued = 0
        self._num_wire_bytes_sent += sum(
            sum(map(len, frame)) if isinstance(frame, tuple) else len(frame) for frame in out
        )
        return out

    def open_stream(self) -> int:
        """Queue a SYN for a new stream and return its id; data may follow at once.

        Raises YamuxStreamError after either side's go-away, past max_streams outbound
        streams, when stream ids run out, or when the session is dead.
        """
        self._check_alive()
        if self._local_go_away or self._remote_go_away:
            raise YamuxStreamError("cannot open a stream: a go-away was sent or received")
        if self._num_outbound >= self._max_streams:
            raise YamuxStreamError(f"cannot open more than {self._max_streams} streams")
        if self._next_id > _MAX_U32:
            raise YamuxStreamError("stream ids are exhausted; open a new connection")
        stream_id = self._next_id
        self._next_id += 2
        self._streams[stream_id] = _Stream(stream_id, is_inbound=False)
        self._num_outbound += 1
        self._queue(_WINDOW_UPDATE, _SYN, stream_id, 0)  # as go-yamux does
        return stream_id

    def send_data(self, stream_id: int, data: _Buffer) -> int:
        """Queue as much of ``data`` as the send window allows; return how many bytes.

        Returns 0 when the window is empty: wait for SendWindowUpdated. Raises
        YamuxStreamError if the stream is unknown, reset, or closed by us.
        """
        return self.send_pieces(stream_id, (data,))

    def send_pieces(self, stream_id: int, pieces: Sequence[_Buffer]) -> int:
        """As :meth:`send_data` for ``pieces`` concatenated, without concatenating them:
        a Data frame of at least VIEW_FRAME_BYTES holds views of the pieces it carries,
        so do not change them until :meth:`frames_to_send` has been taken and consumed.
        Smaller frames are copied."""
        stream = self._get(stream_id)
        if stream.local_closed:
            raise YamuxStreamError(f"stream {stream_id} is closed for sending")
        budget = stream.send_window
        if budget and stream.ack_pending and any(pieces):
            self._ack(stream)
        limit, out = self._max_frame_payload, self._out
        frame: list[_Buffer] = []
        frame_bytes = sent = 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            while view and sent < budget:
                take = min(len(view), budget - sent, limit - frame_bytes)
                frame.append(view[:take] if take < len(view) else view)
                frame_bytes += take
                sent += take
                view = view[take:]
                if frame_bytes == limit:
                    out.append(_data_frame(stream_id, frame, frame_bytes))
                    frame, frame_bytes = [], 0
            if sent == budget:
                break
        if frame_bytes:
            out.append(_data_frame(stream_id, frame, frame_bytes))
        stream.send_window -= sent
        self._num_data_bytes_sent += sent
        return sent

    def send_window(self, stream_id: int) -> int:
        """Bytes we may send now on the stream. Raises YamuxStreamError if it is unknown."""
        return self._get(stream_id).send_window

    def acknowledge_received(self, stream_id: int, num_bytes: int) -> None:
        """Say the application consumed ``num_bytes`` of the stream's data.

        Once half the window is consumed, queues a window update. A stream that keeps
        draining whole windows has its window doubled, up to max_window_bytes and within the
        session's growth budget (a clockless stand-in for go-yamux's RTT-based tuning). A
        forgotten stream is ignored. Raises YamuxStreamError if more is acknowledged than
        was received.
        """
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if num_bytes > stream.num_unconsumed:
            raise YamuxStreamError(
                f"acknowledged {num_bytes} bytes on stream {stream_id}, only "
                f"{stream.num_unconsumed} unacknowledged"
            )
        stream.num_unconsumed -= num_bytes
        stream.num_consumed_since_growth += num_bytes
        if stream.remote_closed:
            return
        # A stream that carries bulk data gets the session's learned window at once (a
        # question or an answer of a few KiB never takes the session's budget).
        warmed = self._warm(stream) if stream.num_consumed_since_growth >= WARM_AFTER_BYTES else 0
        delta = stream.recv_window - stream.recv_credit - stream.num_unconsumed
        if delta < stream.recv_window // 2 and not warmed:
            return
        if stream.num_consumed_since_growth >= stream.recv_window:
            growth = min(
                stream.recv_window,
                self._max_window_bytes - stream.recv_window,
                self._max_window_growth_bytes - self._window_growth_bytes,
            )
            if growth > 0:
                stream.recv_window += growth
                self._window_growth_bytes += growth
                self._learned_window = max(self._learned_window, stream.recv_window)
                delta += growth
            stream.num_consumed_since_growth = 0
        stream.recv_credit += delta
        self._ack(stream)
        self._queue(_WINDOW_UPDATE, 0, stream_id, delta)

    def _warm(self, stream: _Stream) -> int:
        """Raise a new stream's receive window to the session's learned one, within the
        growth budget, once; returns the bytes added (for its first window update)."""
        if stream.warmed:
            return 0
        stream.warmed = True
        grant = min(
            self._learned_window - stream.recv_window,
            self._max_window_growth_bytes - self._window_growth_bytes,
        )
        if grant <= 0:
            return 0
        stream.recv_window += grant
        self._window_growth_bytes += grant
        return grant

    def close_stream(self, stream_id: int) -> None:
        """Half-close: queue FIN. Idempotent. Raises YamuxStreamError if it is unknown."""
        stream = self._get(stream_id)
        if stream.local_closed:
            return
        stream.local_closed = True
        self._ack(stream)
        self._queue(_WINDOW_UPDATE, _FIN, stream_id, 0)
        if stream.remote_closed:
            self._forget(stream)

    def reset_stream(self, stream_id: int) -> None:
        """Queue RST and forget the stream. A no-op if it is already forgotten."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._ack(stream)
            self._queue(_WINDOW_UPDATE, _RST, stream_id, 0)
            self._forget(stream)

    def ping(self, opaque: int) -> None:
        """Queue a ping; the remote echoes ``opaque`` (PongReceived). Raises ValueError."""
        self._check_alive()
        _check_u32("opaque", opaque)
        self._queue(_PING, _SYN, 0, opaque)

    def hold_replies(self, holding: bool) -> None:
        """Hold back the replies the remote's own frames provoke, or release them.

        A remote that sends pings or refused SYNs and never reads our answers would make
        us queue 12 bytes for each 12 it sends, without end. While the connection's
        writes to it are backlogged, and past :data:`MAX_QUEUED_REPLIES` queued since
        the last :meth:`frames_to_send`, it holds them here instead: pongs coalesce into the
        one for the latest ping (the only one a pinger still waits for), RSTs pile up in
        :attr:`num_held_resets`, which the caller bounds (:data:`MAX_HELD_RESETS`: it stops
        reading). Releasing queues what is held, pong first."""
        self._holding = holding
        if holding:
            return
        if self._held_pong is not None:
            self._queue(_PING, _ACK, 0, self._held_pong)
            self._held_pong = None
        for stream_id in self._held_resets:
            self._queue(_WINDOW_UPDATE, _RST, stream_id, 0)
        self._held_resets.clear()

    def _holds_replies(self) -> bool:
        return self._holding or self._num_replies_queued >= MAX_QUEUED_REPLIES

    @property
    def num_held_resets(self) -> int:
        """RSTs held back by :meth:`hold_replies`."""
        return len(self._held_resets)

    @property
    def holds_replies(self) -> bool:
        """Whether a pong or an RST is held back."""
        return self._held_pong is not None or bool(self._held_resets)

    def go_away(self, code: int = GO_AWAY_NORMAL) -> None:
        """Queue a go-away: we accept no new streams. Open streams carry on. Idempotent."""
        _check_u32("code", code)
        if not self._local_go_away:
            self._local_go_away = True
            self._queue(_GO_AWAY, 0, 0, code)

    @property
    def is_closed(self) -> bool:
        """True after a protocol error, or once a go-away went either way and no streams remain."""
        go_away = self._local_go_away or self._remote_go_away
        return self._failed or (go_away and not self._streams)

    @property
    def remote_went_away(self) -> bool:
        """True once the remote sent go-away: open_stream will fail."""
        return self._remote_go_away

    def stream_ids(self) -> tuple[int, ...]:
        """Ids of the streams not yet forgotten (not reset, not closed both ways)."""
        return tuple(self._streams)

    def statistics(self) -> YamuxStatistics:
        return YamuxStatistics(
            num_open_streams=len(self._streams),
            num_inbound_streams=self._num_inbound,
            num_outbound_streams=self._num_outbound,
            num_streams_rejected=self._num_streams_rejected,
            num_data_bytes_sent=self._num_data_bytes_sent,
            num_data_bytes_received=self._num_data_bytes_received,
            num_wire_bytes_sent=self._num_wire_bytes_sent,
            num_wire_bytes_received=self._num_wire_bytes_received,
            window_growth_bytes=self._window_growth_bytes,
            num_replies_held=self._num_replies_held,
        )

    def _queue(self, kind: int, flags: int, stream_id: int, length: int) -> None:
        self._out.append(_HEADER.pack(_VERSION, kind, flags, stream_id, length))

    def _ack(self, stream: _Stream) -> None:
        """Queue ``stream``'s ACK if it still owes one."""
        if stream.ack_pending:
            stream.ack_pending = False
            del self._unacked[stream.stream_id]
            self._queue(_WINDOW_UPDATE, _ACK, stream.stream_id, 0)

    def _owed_acks(self) -> list[bytes]:
        """The frames of every ACK still owed; none is owed after. (A failed session owes
        none: ``_fail`` forgets them.)"""
        frames = [
            _HEADER.pack(_VERSION, _WINDOW_UPDATE, _ACK, stream_id, 0)
            for stream_id in self._unacked
        ]
        for stream in self._unacked.values():
            stream.ack_pending = False
        self._unacked.clear()
        return frames

    def _get(self, stream_id: int) -> _Stream:
        self._check_alive()
        stream = self._streams.get(stream_id)
        if stream is None:
            raise YamuxStreamError(
                f"stream {stream_id} is not open (never opened, reset, or closed)"
            )
        return stream

    def _check_alive(self) -> None:
        if self._failed:
            raise YamuxStreamError("the session is dead after a remote protocol error")

    def _forget(self, stream: _Stream) -> None:
        del self._streams[stream.stream_id]
        if stream.ack_pending:  # it ended before we sent anything: nothing to acknowledge
            del self._unacked[stream.stream_id]
        if stream.is_inbound:
            self._num_inbound -= 1
            self._remember_closed(stream.stream_id)
        else:
            self._num_outbound -= 1
        self._window_growth_bytes -= stream.recv_window - INITIAL_WINDOW_BYTES
        if self._body_stream is stream:  # reset locally mid-frame: drop the rest of the body
            self._body_stream = None

    def _remember_closed(self, stream_id: int) -> None:
        if len(self._closed_remote_order) == MAX_REMEMBERED_CLOSED_IDS:
            self._closed_remote_ids.discard(self._closed_remote_order.popleft())
        self._closed_remote_order.append(stream_id)
        self._closed_remote_ids.add(stream_id)

    def _fail(self) -> None:
        self._failed = True
        self._unacked.clear()
        self._held_pong = None
        self._held_resets.clear()
        self._local_go_away = True
        self._queue(_GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR)
        self._streams.clear()
        self._num_inbound = self._num_outbound = self._window_growth_bytes = 0
        self._body_stream, self._body_remaining = None, 0
        self._header_buf.clear()
