"""multistream-select 1.0 (libp2p connections spec, "Protocol Negotiation").

Every message is an unsigned-varint length prefix, then the UTF-8 text, then ``\\n``.
Both sides send the header ``/multistream/1.0.0``; the dialer proposes a protocol id,
the listener echoes it to accept or answers ``na``. The dialer may pipeline the header
and its first proposal ("optimistic" negotiation, as go-libp2p does).

Pure: :class:`MultistreamDialer` and :class:`MultistreamListener` take bytes in and give
bytes out; the caller moves them. Anything left in the buffer after negotiation (data
the remote sent right behind its last message) is handed back in ``leftover``.
"""

from __future__ import annotations

from collections.abc import Collection

from peers.errors import HandshakeError, LocalProtocolError, ProtocolNotSupported
from peers.varint import VarintError, decode_uvarint, encode_uvarint

MULTISTREAM_PROTOCOL_ID = "/multistream/1.0.0"
#: The spec bounds a message at 1024 bytes (protocol ids are short); a longer length
#: prefix is the remote's fault and ends the negotiation.
MAX_MESSAGE_BYTES = 1024
#: How many proposals a dialer may make before we give up on it; bounds the work a
#: remote can make us do on one stream.
MAX_PROPOSALS = 32
_NA = "na"
#: The header's length prefix: anything else where the header belongs is refused at
#: once, rather than waited for (a peer of a private network, or another protocol,
#: sends noise that may announce a long message that never comes).
_HEADER_BYTES = len(MULTISTREAM_PROTOCOL_ID) + 1


def encode_message(text: str) -> bytes:
    body = text.encode() + b"\n"
    if len(body) > MAX_MESSAGE_BYTES:
        raise LocalProtocolError(f"multistream message too long: {text[:40]!r}...")
    return encode_uvarint(len(body)) + body


class _MessageReader:
    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_message(self, *, header: bool = False) -> str | None:
        """The next whole message, or None until it has arrived; with ``header``, the
        message must be the header's length."""
        try:
            decoded = decode_uvarint(self._buffer)
        except VarintError as e:
            raise HandshakeError(f"multistream: bad length prefix: {e}") from e
        if decoded is None:
            return None
        length, start = decoded
        if header and length != _HEADER_BYTES:
            raise HandshakeError(
                f"multistream: expected the {MULTISTREAM_PROTOCOL_ID} header, got a "
                f"{length}-byte message"
            )
        if length > MAX_MESSAGE_BYTES:
            raise HandshakeError(
                f"multistream: message of {length} bytes exceeds {MAX_MESSAGE_BYTES}"
            )
        if len(self._buffer) < start + length:
            return None
        body = bytes(self._buffer[start : start + length])
        del self._buffer[: start + length]
        if not body.endswith(b"\n"):
            raise HandshakeError("multistream: message does not end with a newline")
        try:
            return body[:-1].decode()
        except UnicodeDecodeError as e:
            raise HandshakeError("multistream: message is not UTF-8") from e

    @property
    def has_input(self) -> bool:
        return bool(self._buffer)

    def take_rest(self) -> bytes:
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


class MultistreamDialer:
    """Proposes protocols one by one until the listener accepts one."""

    def __init__(self, protocols: list[str]) -> None:
        if not protocols:
            raise LocalProtocolError("nothing to propose")
        self._protocols = list(protocols)
        self._index = 0
        self._reader = _MessageReader()
        self._header_seen = False
        self.selected: str | None = None
        self.leftover = b""

    def initial_bytes(self) -> bytes:
        """The header and first proposal, sent together."""
        return encode_message(MULTISTREAM_PROTOCOL_ID) + encode_message(self._protocols[0])

    def receive_data(self, data: bytes) -> bytes:
        """Feed the listener's bytes; returns bytes to send (the next proposal, if any).

        Sets ``selected`` when accepted. Raises :class:`ProtocolNotSupported` when the
        listener refused every proposal, :class:`HandshakeError` on garbage.
        """
        self._reader.feed(data)
        out = b""
        while self.selected is None:
            message = self._reader.next_message(header=not self._header_seen)
            if message is None:
                break
            if not self._header_seen:
                if message != MULTISTREAM_PROTOCOL_ID:
                    raise HandshakeError(f"multistream: unexpected header {message[:64]!r}")
                self._header_seen = True
            elif message == self._protocols[self._index]:
                self.selected = message
                self.leftover = self._reader.take_rest()
            elif message == _NA:
                self._index += 1
                if self._index == len(self._protocols):
                    raise ProtocolNotSupported(
                        f"remote supports none of {', '.join(self._protocols)}"
                    )
                out += encode_message(self._protocols[self._index])
            else:
                raise HandshakeError(f"multistream: unexpected answer {message[:64]!r}")
        return out


class MultistreamListener:
    """Answers proposals, accepting the first one in ``supported``."""

    def __init__(self, supported: Collection[str]) -> None:
        self._supported = supported
        self._reader = _MessageReader()
        self._header_seen = False
        self._num_proposals = 0
        self.selected: str | None = None
        self.leftover = b""

    def initial_bytes(self) -> bytes:
        return encode_message(MULTISTREAM_PROTOCOL_ID)

    def receive_data(self, data: bytes) -> bytes:
        """Feed the dialer's bytes; returns the answers to send. Sets ``selected``."""
        self._reader.feed(data)
        out = b""
        while self.selected is None:
            message = self._reader.next_message(header=not self._header_seen)
            if message is None:
                break
            if not self._header_seen:
                if message != MULTISTREAM_PROTOCOL_ID:
                    raise HandshakeError(f"multistream: unexpected header {message[:64]!r}")
                self._header_seen = True
                continue
            self._num_proposals += 1
            if self._num_proposals > MAX_PROPOSALS:
                raise HandshakeError(f"multistream: more than {MAX_PROPOSALS} proposals")
            if message in self._supported:
                self.selected = message
                self.leftover = self._reader.take_rest()
                out += encode_message(message)
            else:
                # "ls" and anything unknown get "na": we do not list our protocols here
                # (identify does that, authenticated). Stop at a refusal: what follows
                # may be a lazy dialer's data for the refused protocol, not a proposal,
                # and the refusal must reach it before we judge those bytes.
                out += encode_message(_NA)
                break
        return out

    @property
    def has_pending_input(self) -> bool:
        """Bytes received but not yet parsed (call ``receive_data(b"")`` to go on)."""
        return self._reader.has_input
