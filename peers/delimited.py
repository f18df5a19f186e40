"""Unsigned-varint length-prefixed messages on a stream, read without reading past them.

libp2p's small control protocols (circuit relay v2, AutoNAT, DCUtR) frame each protobuf
with its length as an unsigned varint. A relayed stream turns into a raw connection
right after its last control message, so a reader must not take a byte beyond it: the
prefix is read byte by byte (at most a few bytes), then exactly the message.
"""

from __future__ import annotations

import asyncio

from peers.connection import Stream
from peers.errors import LimitExceeded, RemoteProtocolError
from peers.varint import encode_uvarint

#: Bytes of a length prefix we read before giving up: 10 encode any 64-bit length, and
#: every bound we pass is far smaller.
_MAX_PREFIX_BYTES = 10


def encode_delimited(message: bytes) -> bytes:
    return encode_uvarint(len(message)) + message


async def read_delimited(stream: Stream, max_bytes: int) -> bytes:
    """The next message; :class:`LimitExceeded` if it announces more than ``max_bytes``,
    :class:`RemoteProtocolError` if the stream ends first. The caller bounds the wait."""
    length = 0
    for i in range(_MAX_PREFIX_BYTES):
        byte = await stream.read(1)
        if not byte:
            raise RemoteProtocolError("the stream ended before a whole message")
        length |= (byte[0] & 0x7F) << (7 * i)
        if length > max_bytes:
            raise LimitExceeded(f"a message of over {max_bytes} bytes was announced")
        if not byte[0] & 0x80:
            break
    else:
        raise RemoteProtocolError("a length prefix runs past 10 bytes")
    try:
        return await stream.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise RemoteProtocolError("the stream ended inside a message") from e
