"""DCUtR wire messages (libp2p specs, relay/DCUtR.md, "RPC messages").

Over a relayed connection, the inbound peer opens ``/libp2p/dcutr`` and sends CONNECT
with its observed addresses; the other answers CONNECT with its own; the first sends
SYNC and both dial at once. Each message is one length-prefixed ``HolePunch`` protobuf
(go-libp2p p2p/protocol/holepunch/pb/holepunch.proto, proto2)::

    HolePunch { required Type type = 1 (CONNECT = 100, SYNC = 300);
                repeated bytes ObsAddrs = 2 }

Decoding raises :class:`HolePunchProtocolError`; the protocol has no status codes, so
the reader resets the stream.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from multiaddr import Multiaddr

from peers.addresses import is_circuit
from peers.binary_multiaddr import parse_binary_multiaddr
from peers.errors import LocalProtocolError, RemoteProtocolError
from peers.protobuf import ProtobufError, encode_fields
from peers.protofields import Fields

DCUTR_PROTOCOL_ID = "/libp2p/dcutr"

#: Largest message (length prefix excluded): the spec says implementations "SHOULD
#: refuse encoded RPC messages ... larger than 4 KiB", and go-libp2p's ``maxMsgSize``
#: is 4 KiB; so we send no more and accept no more.
MAX_HOLE_PUNCH_MESSAGE_BYTES = 4096

#: Addresses in one CONNECT. A peer sends its observed (and predicted) public addresses,
#: a few per transport and IP family; 64 realistic addresses already fill the 4 KiB bound,
#: and the count bounds the parsing (and later the dials) one message can cause.
MAX_HOLE_PUNCH_ADDRS = 64


class HolePunchType(enum.IntEnum):
    """``HolePunch.Type``."""

    CONNECT = 100
    SYNC = 300


class HolePunchProtocolError(RemoteProtocolError):
    """A DCUtR message from the remote is malformed or too large."""


@dataclass(frozen=True, slots=True)
class HolePunch:
    """One DCUtR message; ``addrs`` (``ObsAddrs``) is what CONNECT carries, SYNC none."""

    type: HolePunchType
    addrs: tuple[Multiaddr, ...] = ()


def encode_hole_punch(msg: HolePunch) -> bytes:
    """The protobuf body of ``msg``. Raises :class:`LocalProtocolError` for more than
    :data:`MAX_HOLE_PUNCH_ADDRS` addresses or a message over
    :data:`MAX_HOLE_PUNCH_MESSAGE_BYTES`."""
    if len(msg.addrs) > MAX_HOLE_PUNCH_ADDRS:
        raise LocalProtocolError(
            f"{len(msg.addrs)} addresses, at most {MAX_HOLE_PUNCH_ADDRS} travel"
        )
    encoded = encode_fields([(1, int(msg.type)), *((2, addr.to_bytes()) for addr in msg.addrs)])
    if len(encoded) > MAX_HOLE_PUNCH_MESSAGE_BYTES:
        raise LocalProtocolError(
            f"DCUtR message of {len(encoded)} bytes exceeds {MAX_HOLE_PUNCH_MESSAGE_BYTES}"
        )
    return encoded


def decode_hole_punch(data: bytes) -> HolePunch:
    """Decode and validate one DCUtR message body.

    Raises :class:`HolePunchProtocolError` when it is over
    :data:`MAX_HOLE_PUNCH_MESSAGE_BYTES`, not protobuf, lacks its (required) type or has
    an unknown one, or carries more than :data:`MAX_HOLE_PUNCH_ADDRS` addresses.
    Addresses that do not parse are dropped, as go-libp2p drops them; relayed ones are
    kept here (see :func:`direct_addresses`).
    """
    if len(data) > MAX_HOLE_PUNCH_MESSAGE_BYTES:
        raise HolePunchProtocolError(
            f"DCUtR message of {len(data)} bytes exceeds {MAX_HOLE_PUNCH_MESSAGE_BYTES}"
        )
    try:
        fields = Fields(data)
        type_value = fields.optional_int(1)
        raw_addrs = fields.repeated_bytes(2, MAX_HOLE_PUNCH_ADDRS)
    except ProtobufError as e:
        raise HolePunchProtocolError(f"malformed DCUtR message: {e}") from e
    if type_value is None:
        raise HolePunchProtocolError("DCUtR message has no type")
    try:
        msg_type = HolePunchType(type_value)
    except ValueError as e:
        raise HolePunchProtocolError(f"unknown DCUtR message type {type_value}") from e
    addrs = (parse_binary_multiaddr(raw) for raw in raw_addrs)
    return HolePunch(msg_type, tuple(addr for addr in addrs if addr is not None))


def direct_addresses(addrs: Iterable[Multiaddr]) -> list[Multiaddr]:
    """``addrs`` without relayed ones: hole punching dials only direct addresses (go-libp2p
    drops ``/p2p-circuit`` addresses from a CONNECT before dialing)."""
    return [addr for addr in addrs if not is_circuit(addr)]
