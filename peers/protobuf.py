"""The few protobuf wire-format pieces libp2p's small messages need.

libp2p's key, Noise-payload and identify messages are tiny proto2/proto3 messages of
varint and length-delimited fields. Encoding them by hand (deterministically, in field
order, as the peer-id spec requires for keys) avoids a protoc build step. Decoding
skips unknown fields, as protobuf requires, and rejects malformed input.
"""

from __future__ import annotations

from collections.abc import Iterable

from peers.errors import RemoteProtocolError
from peers.varint import VarintError, decode_uvarint, encode_uvarint

WIRE_VARINT = 0
WIRE_FIXED64 = 1
WIRE_LENGTH_DELIMITED = 2
WIRE_FIXED32 = 5


class ProtobufError(RemoteProtocolError):
    """A protobuf message is malformed."""


Field = tuple[int, int | bytes]


def encode_fields(fields: Iterable[Field]) -> bytes:
    """Encode ``(field_number, value)`` pairs in the given order; ints as varints, bytes as
    length-delimited."""
    out = bytearray()
    for number, value in fields:
        if isinstance(value, int):
            out += encode_uvarint(number << 3 | WIRE_VARINT)
            out += encode_uvarint(value)
        else:
            out += encode_uvarint(number << 3 | WIRE_LENGTH_DELIMITED)
            out += encode_uvarint(len(value))
            out += value
    return bytes(out)


def decode_fields(data: bytes) -> list[Field]:
    """Decode a message into ``(field_number, value)`` pairs, in wire order.

    Fixed-width fields are returned as ints. Raises :class:`ProtobufError` on malformed input.
    """
    fields: list[Field] = []
    offset = 0
    try:
        while offset < len(data):
            decoded = decode_uvarint(data, offset)
            if decoded is None:
                raise ProtobufError("truncated field tag")
            tag, offset = decoded
            number, wire_type = tag >> 3, tag & 7
            if number == 0:
                raise ProtobufError("field number 0 is invalid")
            if wire_type == WIRE_VARINT:
                decoded = decode_uvarint(data, offset)
                if decoded is None:
                    raise ProtobufError("truncated varint field")
                value, offset = decoded
                fields.append((number, value))
            elif wire_type == WIRE_LENGTH_DELIMITED:
                decoded = decode_uvarint(data, offset)
                if decoded is None:
                    raise ProtobufError("truncated length")
                length, offset = decoded
                if offset + length > len(data):
                    raise ProtobufError("length-delimited field runs past the end")
                fields.append((number, bytes(data[offset : offset + length])))
                offset += length
            elif wire_type in (WIRE_FIXED64, WIRE_FIXED32):
                width = 8 if wire_type == WIRE_FIXED64 else 4
                if offset + width > len(data):
                    raise ProtobufError("truncated fixed-width field")
                fields.append((number, int.from_bytes(data[offset : offset + width], "little")))
                offset += width
            else:
                raise ProtobufError(f"unsupported wire type {wire_type}")
    except VarintError as e:
        raise ProtobufError(str(e)) from e
    return fields


def first_bytes(fields: list[Field], number: int) -> bytes | None:
    """The first length-delimited value of field ``number``, or ``None``."""
    for n, value in fields:
        if n == number:
            if not isinstance(value, bytes):
                raise ProtobufError(f"field {number} should be length-delimited")
            return value
    return None


def first_int(fields: list[Field], number: int) -> int | None:
    """The first varint value of field ``number``, or ``None``."""
    for n, value in fields:
        if n == number:
            if not isinstance(value, int):
                raise ProtobufError(f"field {number} should be a varint")
            return value
    return None


def all_bytes(fields: list[Field], number: int) -> list[bytes]:
    """Every length-delimited value of repeated field ``number``."""
    return [v for n, v in fields if n == number and isinstance(v, bytes)]
