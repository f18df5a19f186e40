"""AutoNAT v1 wire messages (libp2p specs, autonat/autonat-v1.md, "RPC messages").

The client opens ``/libp2p/autonat/1.0.0``, sends one length-prefixed ``Message`` of
type DIAL listing addresses to dial back, and reads one DIAL_RESPONSE. Field numbers
(go-libp2p p2p/host/autonat/pb/autonat.proto)::

    Message      { type = 1, dial = 2, dialResponse = 3 }
    Dial         { peer = 1 }
    PeerInfo     { id = 1, addrs = 2 (repeated) }
    DialResponse { status = 1, statusText = 2, addr = 3 }

The schema is proto2 with every field optional, so a reader that trusts defaults
takes a missing ``type`` for DIAL and a missing ``status`` for OK (go-libp2p's getters
do). We require both: an answer that does not say it succeeded has not.
Decoding raises :class:`AutoNATProtocolError`, whose ``status`` (``E_BAD_REQUEST``) is
what a server answers a bad DIAL with, as go-libp2p does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from multiaddr import Multiaddr

from peers.binary_multiaddr import parse_binary_multiaddr
from peers.errors import IdentityError, LocalProtocolError, RemoteProtocolError
from peers.identity import PeerID
from peers.protobuf import Field, ProtobufError, encode_fields
from peers.protofields import Fields

AUTONAT_PROTOCOL_ID = "/libp2p/autonat/1.0.0"

#: Largest AutoNAT message (length prefix excluded): go-libp2p's ``maxMsgSize = 4096``
#: in p2p/host/autonat/svc.go; it refuses anything longer, so we send no more.
MAX_AUTONAT_MESSAGE_BYTES = 4096

#: Addresses in one DIAL. A peer lists its addresses once each (a dozen or two); the
#: server dials at most ``policy.MAX_DIAL_BACK_ADDRS`` of them, and this bounds the
#: multiaddr parsing one request can make us do.
MAX_DIAL_REQUEST_ADDRS = 64

#: Longest ``statusText`` (UTF-8 bytes). It is for logs only; go's are a few words
#: ("dial failed"), so a longer one is padding.
MAX_STATUS_TEXT_BYTES = 256


class MessageType(enum.IntEnum):
    """``Message.MessageType``."""

    DIAL = 0
    DIAL_RESPONSE = 1


class ResponseStatus(enum.IntEnum):
    """``Message.ResponseStatus``."""

    OK = 0
    E_DIAL_ERROR = 100
    E_DIAL_REFUSED = 101
    E_BAD_REQUEST = 200
    E_INTERNAL_ERROR = 300


class AutoNATProtocolError(RemoteProtocolError):
    """An AutoNAT message from the remote is malformed; ``status`` is what a server
    answers a bad request with."""

    def __init__(self, message: str, status: ResponseStatus = ResponseStatus.E_BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Dial:
    """A DIAL request: "dial me back on these addresses". ``peer_id`` is optional in the
    schema; a server checks it, when present, against the connection's peer."""

    peer_id: PeerID | None
    addrs: tuple[Multiaddr, ...] = ()


@dataclass(frozen=True, slots=True)
class DialResponse:
    """A DIAL_RESPONSE. With OK, ``addr`` is the address the server reached (SHOULD)."""

    status: ResponseStatus
    status_text: str = ""
    addr: Multiaddr | None = None


AutoNATMessage = Dial | DialResponse


def encode_autonat_message(msg: AutoNATMessage) -> bytes:
    """The protobuf body of ``msg``, fields in number order as go-libp2p writes them.

    Raises :class:`LocalProtocolError` for more than :data:`MAX_DIAL_REQUEST_ADDRS`
    addresses, a status text over :data:`MAX_STATUS_TEXT_BYTES`, or a message over
    :data:`MAX_AUTONAT_MESSAGE_BYTES`.
    """
    if isinstance(msg, Dial):
        if len(msg.addrs) > MAX_DIAL_REQUEST_ADDRS:
            raise LocalProtocolError(
                f"{len(msg.addrs)} addresses, at most {MAX_DIAL_REQUEST_ADDRS} travel"
            )
        peer: list[Field] = [] if msg.peer_id is None else [(1, msg.peer_id.to_bytes())]
        peer += [(2, addr.to_bytes()) for addr in msg.addrs]
        dial = encode_fields([(1, encode_fields(peer))])
        encoded = encode_fields([(1, int(MessageType.DIAL)), (2, dial)])
    else:
        text = msg.status_text.encode("utf-8")
        if len(text) > MAX_STATUS_TEXT_BYTES:
            raise LocalProtocolError(f"status text of {len(text)} bytes is too long")
        response: list[Field] = [(1, int(msg.status))]
        if text:
            response.append((2, text))
        if msg.addr is not None:
            response.append((3, msg.addr.to_bytes()))
        encoded = encode_fields([(1, int(MessageType.DIAL_RESPONSE)), (3, encode_fields(response))])
    if len(encoded) > MAX_AUTONAT_MESSAGE_BYTES:
        raise LocalProtocolError(
            f"AutoNAT message of {len(encoded)} bytes exceeds {MAX_AUTONAT_MESSAGE_BYTES}"
        )
    return encoded


def _decode_dial(data: bytes | None) -> Dial:
    peer_bytes = None if data is None else Fields(data).optional_bytes(1)
    if peer_bytes is None:
        raise AutoNATProtocolError("DIAL carries no peer info")
    fields = Fields(peer_bytes)
    raw_id = fields.optional_bytes(1)
    peer_id: PeerID | None = None
    if raw_id is not None:
        try:
            peer_id = PeerID(raw_id)
        except IdentityError as e:
            raise AutoNATProtocolError(f"DIAL peer id is not a PeerID: {e}") from e
    parsed = (
        parse_binary_multiaddr(raw) for raw in fields.repeated_bytes(2, MAX_DIAL_REQUEST_ADDRS)
    )
    return Dial(peer_id, tuple(addr for addr in parsed if addr is not None))


def _decode_response(data: bytes | None) -> DialResponse:
    if data is None:
        raise AutoNATProtocolError("DIAL_RESPONSE carries no dialResponse")
    fields = Fields(data)
    status_value = fields.optional_int(1)
    if status_value is None:
        raise AutoNATProtocolError("DIAL_RESPONSE has no status")
    try:
        status = ResponseStatus(status_value)
    except ValueError as e:
        raise AutoNATProtocolError(f"unknown response status {status_value}") from e
    text = fields.optional_bytes(2) or b""
    if len(text) > MAX_STATUS_TEXT_BYTES:
        raise AutoNATProtocolError(f"status text of {len(text)} bytes is too long")
    raw_addr = fields.optional_bytes(3)
    return DialResponse(
        status=status,
        # proto2 strings are not checked for UTF-8 by go; the text is only for logs.
        status_text=text.decode("utf-8", errors="replace"),
        addr=None if raw_addr is None else parse_binary_multiaddr(raw_addr),
    )


def decode_autonat_message(data: bytes) -> AutoNATMessage:
    """Decode and validate one AutoNAT message body.

    Raises :class:`AutoNATProtocolError` (``E_BAD_REQUEST``) when it is over
    :data:`MAX_AUTONAT_MESSAGE_BYTES`, not protobuf, has no or an unknown type, a DIAL
    without peer info or with a peer id that is no PeerID or more than
    :data:`MAX_DIAL_REQUEST_ADDRS` addresses, a DIAL_RESPONSE without its body or status
    or with an unknown status or an overlong status text, or a singular field twice.
    Addresses that do not parse are dropped (an unreadable ``addr`` reads as ``None``).
    """
    if len(data) > MAX_AUTONAT_MESSAGE_BYTES:
        raise AutoNATProtocolError(
            f"AutoNAT message of {len(data)} bytes exceeds {MAX_AUTONAT_MESSAGE_BYTES}"
        )
    try:
        fields = Fields(data)
        type_value = fields.optional_int(1)
        if type_value is None:
            raise AutoNATProtocolError("AutoNAT message has no type")
        try:
            msg_type = MessageType(type_value)
        except ValueError as e:
            raise AutoNATProtocolError(f"unknown AutoNAT message type {type_value}") from e
        if msg_type is MessageType.DIAL:
            return _decode_dial(fields.optional_bytes(2))
        return _decode_response(fields.optional_bytes(3))
    except ProtobufError as e:
        raise AutoNATProtocolError(f"malformed AutoNAT message: {e}") from e
