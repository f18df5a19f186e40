"""Circuit relay v2 wire messages (libp2p specs, relay/circuit-v2.md, "Protobuf").

Two protocols share these types: ``hop`` (client <-> relay: RESERVE a slot, CONNECT to
a peer through the relay) and ``stop`` (relay -> the reserved peer: someone CONNECTs to
you). Each message is one unsigned-varint length-prefixed protobuf on the stream.

Field numbers (go-libp2p p2p/protocol/circuitv2/pb/circuit.proto)::

    HopMessage  { type = 1, peer = 2, reservation = 3, limit = 4, status = 5 }
    StopMessage { type = 1, peer = 2, limit = 3, status = 4 }
    Peer        { id = 1, addrs = 2 (repeated) }
    Reservation { expire = 1 (uint64), addrs = 2 (repeated), voucher = 3 }
    Limit       { duration = 1 (uint32 seconds), data = 2 (uint64 bytes) }

Decoding validates once, here, and raises :class:`RelayProtocolError` carrying the
status the spec has a relay or client answer with (``MALFORMED_MESSAGE`` for every
decoding failure, as go-libp2p answers). Which message type is *expected* at a point of
the exchange (``UNEXPECTED_MESSAGE``) is the caller's protocol logic, not decoding's.
Binary addresses that do not parse are dropped one by one, as go-libp2p drops them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from multiaddr import Multiaddr

from peers.binary_multiaddr import parse_binary_multiaddr
from peers.errors import IdentityError, LocalProtocolError, RemoteProtocolError
from peers.identity import PeerID
from peers.protobuf import Field, ProtobufError, encode_fields
from peers.protofields import MAX_UINT32, Fields

HOP_PROTOCOL_ID = "/libp2p/circuit/relay/0.2.0/hop"
STOP_PROTOCOL_ID = "/libp2p/circuit/relay/0.2.0/stop"

#: Largest hop or stop message (length prefix excluded). go-libp2p reads circuit
#: messages with a 4 KiB buffer (``maxMessageSize = 4096`` in circuitv2/relay and
#: circuitv2/client) and fails anything longer, so we never send more and accept no more.
MAX_CIRCUIT_MESSAGE_BYTES = 4096

#: Addresses in one ``Peer`` or ``Reservation``. A relay lists each public address it
#: has (TCP, QUIC, WebTransport, WebRTC, over IPv4 and IPv6: a dozen or two); 64
#: realistic addresses with their ``/p2p`` suffix already fill the 4 KiB message bound,
#: and the count bounds the multiaddr parsing a peer can make us do per message.
MAX_ADDRS_PER_PEER = 64

#: Largest value of a uint64 field we can read: unsigned varints are capped at 63 bits.
_MAX_UINT64_READABLE = (1 << 63) - 1


class Status(enum.IntEnum):
    """The spec's ``Status`` enum (its ``UNUSED = 0`` is not a status anyone sends)."""

    OK = 100
    RESERVATION_REFUSED = 200
    RESOURCE_LIMIT_EXCEEDED = 201
    PERMISSION_DENIED = 202
    CONNECTION_FAILED = 203
    NO_RESERVATION = 204
    MALFORMED_MESSAGE = 400
    UNEXPECTED_MESSAGE = 401


class HopType(enum.IntEnum):
    """``HopMessage.Type``."""

    RESERVE = 0
    CONNECT = 1
    STATUS = 2


class StopType(enum.IntEnum):
    """``StopMessage.Type``."""

    CONNECT = 0
    STATUS = 1


class RelayProtocolError(RemoteProtocolError):
    """A relay message from the remote is not allowed; ``status`` is the code to answer
    with before closing the stream (the spec's ``MALFORMED_MESSAGE`` unless said)."""

    def __init__(self, message: str, status: Status = Status.MALFORMED_MESSAGE) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """``Peer``: a PeerID and (optionally) addresses of it."""

    peer_id: PeerID
    addrs: tuple[Multiaddr, ...] = ()


@dataclass(frozen=True, slots=True)
class Reservation:
    """``Reservation``: what a relay grants a peer that reserved a slot."""

    #: When the reservation ends, Unix time in whole seconds (UTC).
    expire_unix_seconds: int
    #: The relay's public addresses, each ending in ``/p2p/<relay id>``; the reserving
    #: peer appends ``/p2p-circuit`` to build the addresses it advertises.
    addrs: tuple[Multiaddr, ...] = ()
    #: The reservation voucher, a signed envelope (see :mod:`peers.relay.voucher`);
    #: decoding does not verify it.
    voucher: bytes | None = None


@dataclass(frozen=True, slots=True)
class Limit:
    """``Limit``: what the relay allows one relayed connection; 0 means no limit."""

    #: Longest life of the relayed connection, seconds (a uint32 on the wire).
    duration_seconds: int = 0
    #: Most bytes relayed in each direction.
    data_bytes: int = 0


@dataclass(frozen=True, slots=True)
class HopMessage:
    """``HopMessage``. CONNECT carries ``peer`` (the target); STATUS carries ``status``,
    and in an OK answer to RESERVE a ``reservation``; ``limit`` absent means the relay
    applies none."""

    type: HopType
    peer: PeerInfo | None = None
    reservation: Reservation | None = None
    limit: Limit | None = None
    status: Status | None = None


@dataclass(frozen=True, slots=True)
class StopMessage:
    """``StopMessage``. CONNECT carries ``peer`` (the initiator) and the ``limit`` of the
    relayed connection; STATUS carries ``status``."""

    type: StopType
    peer: PeerInfo | None = None
    limit: Limit | None = None
    status: Status | None = None


# --- encoding ----------------------------------------------------------------------


def _encode_addrs(number: int, addrs: Sequence[Multiaddr]) -> list[Field]:
    if len(addrs) > MAX_ADDRS_PER_PEER:
        raise LocalProtocolError(f"{len(addrs)} addresses, at most {MAX_ADDRS_PER_PEER} travel")
    return [(number, addr.to_bytes()) for addr in addrs]


def _encode_peer(peer: PeerInfo) -> bytes:
    return encode_fields([(1, peer.peer_id.to_bytes()), *_encode_addrs(2, peer.addrs)])


def _encode_reservation(reservation: Reservation) -> bytes:
    if not 0 <= reservation.expire_unix_seconds <= _MAX_UINT64_READABLE:
        raise LocalProtocolError(f"reservation expiry {reservation.expire_unix_seconds} is invalid")
    fields: list[Field] = [(1, reservation.expire_unix_seconds)]
    fields += _encode_addrs(2, reservation.addrs)
    if reservation.voucher is not None:
        fields.append((3, reservation.voucher))
    return encode_fields(fields)


def _encode_limit(limit: Limit) -> bytes:
    if not 0 <= limit.duration_seconds <= MAX_UINT32:
        raise LocalProtocolError(f"limit duration {limit.duration_seconds} does not fit a uint32")
    if not 0 <= limit.data_bytes <= _MAX_UINT64_READABLE:
        raise LocalProtocolError(f"limit data {limit.data_bytes} is invalid")
    # go-libp2p sets both fields whenever it sends a Limit; so do we.
    return encode_fields([(1, limit.duration_seconds), (2, limit.data_bytes)])


def _finish(encoded: bytes) -> bytes:
    if len(encoded) > MAX_CIRCUIT_MESSAGE_BYTES:
        raise LocalProtocolError(
            f"circuit message of {len(encoded)} bytes exceeds {MAX_CIRCUIT_MESSAGE_BYTES}"
        )
    return encoded


def encode_hop_message(msg: HopMessage) -> bytes:
    """The protobuf body of ``msg`` (frame it with :func:`peers.serialization.encode_frame`).

    Raises :class:`LocalProtocolError` for a message the spec does not allow (CONNECT
    without a peer, STATUS without a status, values out of range, too many addresses)
    or one over :data:`MAX_CIRCUIT_MESSAGE_BYTES`: a go-libp2p peer would refuse it.
    """
    if msg.type is HopType.CONNECT and msg.peer is None:
        raise LocalProtocolError("a hop CONNECT names its target peer")
    if msg.type is HopType.STATUS and msg.status is None:
        raise LocalProtocolError("a hop STATUS carries a status")
    fields: list[Field] = [(1, int(msg.type))]
    if msg.peer is not None:
        fields.append((2, _encode_peer(msg.peer)))
    if msg.reservation is not None:
        fields.append((3, _encode_reservation(msg.reservation)))
    if msg.limit is not None:
        fields.append((4, _encode_limit(msg.limit)))
    if msg.status is not None:
        fields.append((5, int(msg.status)))
    return _finish(encode_fields(fields))


def encode_stop_message(msg: StopMessage) -> bytes:
    """The protobuf body of ``msg``; raises :class:`LocalProtocolError` as
    :func:`encode_hop_message` does."""
    if msg.type is StopType.CONNECT and msg.peer is None:
        raise LocalProtocolError("a stop CONNECT names the initiating peer")
    if msg.type is StopType.STATUS and msg.status is None:
        raise LocalProtocolError("a stop STATUS carries a status")
    fields: list[Field] = [(1, int(msg.type))]
    if msg.peer is not None:
        fields.append((2, _encode_peer(msg.peer)))
    if msg.limit is not None:
        fields.append((3, _encode_limit(msg.limit)))
    if msg.status is not None:
        fields.append((4, int(msg.status)))
    return _finish(encode_fields(fields))


# --- decoding ----------------------------------------------------------------------


def _decode_addrs(fields: Fields, number: int) -> tuple[Multiaddr, ...]:
    addrs = (
        parse_binary_multiaddr(raw) for raw in fields.repeated_bytes(number, MAX_ADDRS_PER_PEER)
    )
    return tuple(addr for addr in addrs if addr is not None)


def _decode_peer(data: bytes) -> PeerInfo:
    fields = Fields(data)
    raw_id = fields.optional_bytes(1)
    if raw_id is None:
        raise RelayProtocolError("Peer has no id")
    try:
        peer_id = PeerID(raw_id)
    except IdentityError as e:
        raise RelayProtocolError(f"Peer id is not a PeerID: {e}") from e
    return PeerInfo(peer_id, _decode_addrs(fields, 2))


def _decode_reservation(data: bytes) -> Reservation:
    fields = Fields(data)
    expire = fields.optional_int(1)
    if expire is None:
        raise RelayProtocolError("Reservation has no expire time")
    return Reservation(expire, _decode_addrs(fields, 2), fields.optional_bytes(3))


def _decode_limit(data: bytes) -> Limit:
    fields = Fields(data)
    return Limit(fields.optional_uint32(1) or 0, fields.optional_int(2) or 0)


def _decode_status(fields: Fields, number: int) -> Status | None:
    value = fields.optional_int(number)
    if value is None:
        return None
    try:
        return Status(value)
    except ValueError as e:
        raise RelayProtocolError(f"unknown status code {value}") from e


def _fields(data: bytes) -> Fields:
    if len(data) > MAX_CIRCUIT_MESSAGE_BYTES:
        raise RelayProtocolError(
            f"circuit message of {len(data)} bytes exceeds {MAX_CIRCUIT_MESSAGE_BYTES}"
        )
    return Fields(data)


def decode_hop_message(data: bytes) -> HopMessage:
    """Decode and validate one hop message body.

    Raises :class:`RelayProtocolError` (status ``MALFORMED_MESSAGE``) when it is over
    :data:`MAX_CIRCUIT_MESSAGE_BYTES`, not protobuf, lacks its type (go-libp2p would read
    a missing type as RESERVE; every implementation writes it), has an unknown type or
    status, a CONNECT without a peer, a STATUS without a status, a peer id that is no
    PeerID, a reservation without its expiry, a uint32 out of range, more than
    :data:`MAX_ADDRS_PER_PEER` addresses in one list, or a singular field twice.
    """
    try:
        fields = _fields(data)
        type_value = fields.optional_int(1)
        if type_value is None:
            raise RelayProtocolError("hop message has no type")
        try:
            msg_type = HopType(type_value)
        except ValueError as e:
            raise RelayProtocolError(f"unknown hop message type {type_value}") from e
        peer = fields.optional_bytes(2)
        reservation = fields.optional_bytes(3)
        limit = fields.optional_bytes(4)
        msg = HopMessage(
            type=msg_type,
            peer=None if peer is None else _decode_peer(peer),
            reservation=None if reservation is None else _decode_reservation(reservation),
            limit=None if limit is None else _decode_limit(limit),
            status=_decode_status(fields, 5),
        )
    except ProtobufError as e:
        raise RelayProtocolError(f"malformed hop message: {e}") from e
    if msg.type is HopType.CONNECT and msg.peer is None:
        raise RelayProtocolError("hop CONNECT without a target peer")
    if msg.type is HopType.STATUS and msg.status is None:
        raise RelayProtocolError("hop STATUS without a status")
    return msg


def decode_stop_message(data: bytes) -> StopMessage:
    """Decode and validate one stop message body; raises :class:`RelayProtocolError`
    (``MALFORMED_MESSAGE``) for the failures :func:`decode_hop_message` lists."""
    try:
        fields = _fields(data)
        type_value = fields.optional_int(1)
        if type_value is None:
            raise RelayProtocolError("stop message has no type")
        try:
            msg_type = StopType(type_value)
        except ValueError as e:
            raise RelayProtocolError(f"unknown stop message type {type_value}") from e
        peer = fields.optional_bytes(2)
        limit = fields.optional_bytes(3)
        msg = StopMessage(
            type=msg_type,
            peer=None if peer is None else _decode_peer(peer),
            limit=None if limit is None else _decode_limit(limit),
            status=_decode_status(fields, 4),
        )
    except ProtobufError as e:
        raise RelayProtocolError(f"malformed stop message: {e}") from e
    if msg.type is StopType.CONNECT and msg.peer is None:
        raise RelayProtocolError("stop CONNECT without the initiating peer")
    if msg.type is StopType.STATUS and msg.status is None:
        raise RelayProtocolError("stop STATUS without a status")
    return msg
