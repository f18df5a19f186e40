"""A strict, typed view of one decoded protobuf message, for the libp2p control messages
(circuit relay, AutoNAT, DCUtR, signed envelopes).

:func:`peers.protobuf.decode_fields` gives the fields in wire order; :class:`Fields`
indexes them and answers "the one value of field N" or "every value of repeated field
N, at most M of them". Where plain protobuf lets a later copy of a singular field
override an earlier one, we refuse the message: a canonical encoder (go-libp2p's,
rust-libp2p's, ours) never repeats a singular field, and refusing keeps a message
meaning one thing to every parser, which matters most for signed payloads. Unknown
fields are skipped, as protobuf requires, so newer peers can add fields.
"""

from __future__ import annotations

from collections.abc import Sequence

from peers.protobuf import ProtobufError, decode_fields

#: Largest value a ``uint32`` field may hold; a varint past it is malformed, not wrapped
#: (go's protobuf runtime would silently truncate it).
MAX_UINT32 = (1 << 32) - 1


class Fields:
    """The decoded fields of one message; every accessor raises :class:`ProtobufError`."""

    __slots__ = ("_values",)

    def __init__(self, data: bytes) -> None:
        values: dict[int, list[int | bytes]] = {}
        for number, value in decode_fields(data):
            values.setdefault(number, []).append(value)
        self._values = values

    def _one(self, number: int) -> int | bytes | None:
        found = self._values.get(number)
        if not found:
            return None
        if len(found) > 1:
            raise ProtobufError(f"field {number} appears {len(found)} times, it is not repeated")
        return found[0]

    def optional_int(self, number: int) -> int | None:
        """The varint value of singular field ``number``, or ``None`` if absent."""
        value = self._one(number)
        if isinstance(value, bytes):
            raise ProtobufError(f"field {number} should be a varint")
        return value

    def optional_uint32(self, number: int) -> int | None:
        """Like :meth:`optional_int`, refusing a value that does not fit 32 bits."""
        value = self.optional_int(number)
        if value is not None and value > MAX_UINT32:
            raise ProtobufError(f"field {number} does not fit a uint32: {value}")
        return value

    def optional_bytes(self, number: int) -> bytes | None:
        """The length-delimited value of singular field ``number``, or ``None`` if absent."""
        value = self._one(number)
        if isinstance(value, int):
            raise ProtobufError(f"field {number} should be length-delimited")
        return value

    def repeated_bytes(self, number: int, max_count: int) -> Sequence[bytes]:
        """Every value of repeated length-delimited field ``number``; more than
        ``max_count`` of them is malformed (checked before the caller parses any)."""
        found = self._values.get(number, [])
        if len(found) > max_count:
            raise ProtobufError(f"field {number} repeats {len(found)} times, at most {max_count}")
        out: list[bytes] = []
        for value in found:
            if isinstance(value, int):
                raise ProtobufError(f"field {number} should be length-delimited")
            out.append(value)
        return out
