"""Unsigned varints (multiformats unsigned-varint, as used by libp2p framing and protobuf).

Pure functions. The multiformats spec caps varints at 9 bytes (63 bits); a longer
prefix is the sender's fault.
"""

from __future__ import annotations

from peers.errors import RemoteProtocolError

#: multiformats unsigned-varint spec: "the maximum varint length is 9 bytes" (63 bits).
MAX_VARINT_BYTES = 9


class VarintError(RemoteProtocolError):
    """A varint is longer than the spec allows or not minimally encoded."""


def encode_uvarint(value: int) -> bytes:
    """Encode a non-negative integer; raises ``ValueError`` for a negative or 2^63+ value."""
    if value < 0 or value >= 1 << 63:
        raise ValueError(f"uvarint out of range: {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_uvarint(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[int, int] | None:
    """Decode a varint at ``offset``.

    Returns ``(value, new_offset)``, or ``None`` when ``data`` ends before the varint does.
    Raises :class:`VarintError` for a varint longer than 9 bytes or a non-minimal one.
    """
    value = 0
    shift = 0
    end = len(data)
    for i in range(MAX_VARINT_BYTES):
        pos = offset + i
        if pos >= end:
            return None
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise VarintError("varint is not minimally encoded")
            return value, pos + 1
        shift += 7
    raise VarintError(f"varint longer than {MAX_VARINT_BYTES} bytes")
