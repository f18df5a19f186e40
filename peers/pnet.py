"""Private networks: every byte of a connection encrypted with a pre-shared swarm key.

libp2p's pnet (specs: ``pnet/Private-Networks-PSK-V1.md``; go-libp2p's ``p2p/net/pnet``):
before anything else on a raw connection, each side sends a random 24-byte nonce, and
from then on everything it writes is XORed with the XSalsa20 key stream of the shared
32-byte key and its own nonce; it decrypts what it reads with the other side's nonce.
A peer without the key sees noise where multistream-select should be, so the handshake
fails before Noise starts: strangers cannot open a single protocol, not even identify
or the DHT. The protection sits under the whole upgrade, on TCP and on relayed
connections alike (a relay must hold the key too: its connections are protected).

It adds no integrity (Noise does that inside) and keeps the key out of any handshake
message; what it adds is that a stranger cannot talk to us at all.

The key file is go-libp2p's format (``ipfs``' ``swarm.key``): the line
``/key/swarm/psk/1.0.0/``, an encoding line (``/base16/``, ``/base64/`` or ``/bin/``),
then the key. :func:`write_swarm_key` writes base16 with mode 0600.

How it is wired: :class:`ProtectedProtocol` sits between asyncio's transport and the
connection's ``StreamReaderProtocol``, decrypting what arrives (straight into the buffer
of a diverted reader, :mod:`peers.socket_reader`), and hands that protocol a
:class:`ProtectedTransport` that encrypts what is written. Everything above (the
upgrade, the connection, the socket writer) runs unchanged; the protected transport
hides the socket so nothing writes plaintext past it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import secrets
import struct
import threading
from collections.abc import Iterable
from typing import Any, cast

from peers.errors import PeersError

#: Bytes of a swarm key.
KEY_BYTES = 32
#: Bytes of the nonce each side sends first.
NONCE_BYTES = 24
#: The first line of a swarm key file.
KEY_FILE_HEADER = "/key/swarm/psk/1.0.0/"
#: Largest key file read (a key is 32 bytes; the file a few lines).
MAX_KEY_FILE_BYTES = 4096

#: Bytes one read of a protected connection may deliver (decrypted from there into the
#: reader's own buffer). One buffer per thread, as the reader's (:mod:`peers.socket_reader`).
READ_BUFFER_BYTES = 256 * 1024

_per_thread = threading.local()
_SIGMA = struct.unpack("<4I", b"expand 32-byte k")
_MASK = 0xFFFFFFFF


class SwarmKeyError(PeersError, ValueError):
    """A swarm key file that cannot be read or is not a 32-byte key."""


def new_swarm_key() -> bytes:
    """A fresh random 32-byte swarm key."""
    return secrets.token_bytes(KEY_BYTES)


def format_swarm_key(key: bytes) -> str:
    """``key`` as a key file's text (base16)."""
    _check_key(key)
    return f"{KEY_FILE_HEADER}\n/base16/\n{key.hex()}\n"


def parse_swarm_key(data: bytes) -> bytes:
    """The key in a key file's bytes; :class:`SwarmKeyError` naming what is wrong."""
    header, sep, rest = data.partition(b"\n")
    if header.strip().decode("ascii", "replace") != KEY_FILE_HEADER or not sep:
        raise SwarmKeyError(f"a swarm key file starts with the line {KEY_FILE_HEADER}")
    encoding, sep, body = rest.partition(b"\n")
    encoding_name = encoding.strip().decode("ascii", "replace")
    if encoding_name == "/bin/":
        key = body
    else:
        text = body.strip()
        try:
            if encoding_name == "/base16/":
                key = binascii.unhexlify(text)
            elif encoding_name == "/base64/":
                key = base64.b64decode(text, validate=True)
            else:
                raise SwarmKeyError(
                    f"unknown key encoding {encoding_name[:32]!r}: "
                    "expected /base16/, /base64/ or /bin/"
                )
        except (binascii.Error, ValueError) as e:
            if isinstance(e, SwarmKeyError):
                raise
            raise SwarmKeyError(f"the key is not valid {encoding_name.strip('/')}") from e
    _check_key(key)
    return key


def load_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """Read a key file; :class:`SwarmKeyError` for a missing, unreadable or bad one."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise SwarmKeyError(f"cannot read swarm key {path}: {e.strerror or e}") from e
    if len(data) > MAX_KEY_FILE_BYTES:
        raise SwarmKeyError(f"{path} is too large to be a swarm key file")
    try:
        return parse_swarm_key(data)
    except SwarmKeyError as e:
        raise SwarmKeyError(f"{path}: {e}") from None


def write_swarm_key(path: str | os.PathLike[str], key: bytes) -> None:
    """Write ``key`` to a new file readable by its owner only; refuses to overwrite."""
    text = format_swarm_key(key).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise SwarmKeyError(f"cannot create swarm key {path}: {e.strerror or e}") from e
    with os.fdopen(fd, "wb") as f:
        f.write(text)


def _check_key(key: object) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        size = len(key) if isinstance(key, bytes) else type(key).__name__
        raise SwarmKeyError(f"a swarm key is {KEY_BYTES} bytes, not {size}")


# --- XSalsa20 -----------------------------------------------------------------------


def _rotl(value: int, shift: int) -> int:
    return ((value << shift) | (value >> (32 - shift))) & _MASK


def hsalsa20(key: bytes, nonce: bytes) -> bytes:
    """HSalsa20 (Bernstein, "Extending the Salsa20 nonce"): the subkey of ``key``
    (32 bytes) for the first 16 bytes of an XSalsa20 nonce. Runs once per connection."""
    k = struct.unpack("<8I", key)
    n = struct.unpack("<4I", nonce)
    x = [_SIGMA[0], *k[:4], _SIGMA[1], *n, _SIGMA[2], *k[4:], _SIGMA[3]]
    for _ in range(10):  # 20 rounds: a column round and a row round each
        for a, b, c, d in ((0, 4, 8, 12), (5, 9, 13, 1), (10, 14, 2, 6), (15, 3, 7, 11)):
            x[b] ^= _rotl((x[a] + x[d]) & _MASK, 7)
            x[c] ^= _rotl((x[b] + x[a]) & _MASK, 9)
            x[d] ^= _rotl((x[c] + x[b]) & _MASK, 13)
            x[a] ^= _rotl((x[d] + x[c]) & _MASK, 18)
        for a, b, c, d in ((0, 1, 2, 3), (5, 6, 7, 4), (10, 11, 8, 9), (15, 12, 13, 14)):
            x[b] ^= _rotl((x[a] + x[d]) & _MASK, 7)
            x[c] ^= _rotl((x[b] + x[a]) & _MASK, 9)
            x[d] ^= _rotl((x[c] + x[b]) & _MASK, 13)
            x[a] ^= _rotl((x[d] + x[c]) & _MASK, 18)
    return struct.pack("<8I", *(x[i] for i in (0, 5, 10, 15, 6, 7, 8, 9)))


class XSalsa20:
    """The XSalsa20 key stream of ``key`` and a 24-byte ``nonce``, XORed into data in
    order: Salsa20 (pycryptodome's) keyed with HSalsa20's subkey and the nonce's last 8
    bytes."""

    def __init__(self, key: bytes, nonce: bytes) -> None:
        _check_key(key)
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"an XSalsa20 nonce is {NONCE_BYTES} bytes")
        # Imported here: pycryptodome's cipher modules are slow to load, and every peer's
        # start-up (a bootstrap peer's, the CLI's) paid for a feature that only private
        # swarms use (docs/benchmarks.md, the architecture issue's before and after).
        from Crypto.Cipher import Salsa20

        self._cipher = Salsa20.new(key=hsalsa20(key, nonce[:16]), nonce=nonce[16:])

    def xor(self, data: bytes | bytearray | memoryview) -> bytes:
        """``data`` XOR the next ``len(data)`` bytes of the stream."""
        out: bytes = self._cipher.encrypt(data)
        return out

    def xor_into(self, data: bytes | bytearray | memoryview, out: bytearray | memoryview) -> None:
        """As :meth:`xor`, written to ``out`` (same length; may be ``data`` itself)."""
        self._cipher.encrypt(data, output=out)


# --- the protected connection -------------------------------------------------------


def _read_buffer() -> memoryview:
    """This thread's buffer for encrypted reads, made on first use (not the reader's:
    decrypting moves the bytes from this buffer into that one)."""
    buffer: memoryview | None = getattr(_per_thread, "read_buffer", None)
    if buffer is None:
        buffer = _per_thread.read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))
    return buffer


class ProtectedTransport(asyncio.Transport):
    """The transport the protocols above see: writes are encrypted with our stream; the
    rest goes to the real transport. ``get_extra_info("socket")`` is None, so no one
    writes to the socket past the encryption (:class:`peers.socket_writer.SocketWriter`
    then writes through this transport)."""

    def __init__(self, real: asyncio.Transport, protocol: ProtectedProtocol) -> None:
        super().__init__()
        self._real = real
        self._protocol = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self._real.write(self._protocol.encrypt(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self._real.writelines([self._protocol.encrypt(d) for d in list_of_data if d])

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return default
        return self._real.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def close(self) -> None:
        self._real.close()

    def abort(self) -> None:
        self._real.abort()

    def can_write_eof(self) -> bool:
        return self._real.can_write_eof()

    def write_eof(self) -> None:
        self._real.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._real.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._real.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._real.set_write_buffer_limits(high, low)

    def is_reading(self) -> bool:
        return self._real.is_reading()

    def pause_reading(self) -> None:
        self._real.pause_reading()

    def resume_reading(self) -> None:
        self._real.resume_reading()

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol.inner

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol.inner = protocol


class ProtectedProtocol(asyncio.BufferedProtocol):
    """The real transport's protocol: sends our nonce first, takes the remote's from the
    first bytes read, then decrypts everything into ``inner`` (the connection's
    protocol: a plain ``Protocol`` gets bytes, a ``BufferedProtocol`` gets them in its
    own buffer, decrypted there in one pass)."""

    def __init__(self, key: bytes, inner: asyncio.BaseProtocol) -> None:
        _check_key(key)
        self._key = key
        self.inner: asyncio.BaseProtocol = inner
        self._buffer = _read_buffer()
        self._out: XSalsa20 | None = None
        self._in: XSalsa20 | None = None
        self._remote_nonce = b""
        self.transport: ProtectedTransport | None = None

    def encrypt(self, data: bytes | bytearray | memoryview) -> bytes:
        assert self._out is not None, "written before the connection was made"
        return self._out.xor(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        transport = cast(asyncio.Transport, transport)
        nonce = secrets.token_bytes(NONCE_BYTES)
        self._out = XSalsa20(self._key, nonce)
        transport.write(nonce)
        self.transport = ProtectedTransport(transport, self)
        self.inner.connection_made(self.transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        data = self._buffer[:nbytes]
        if self._in is None:
            wanted = NONCE_BYTES - len(self._remote_nonce)
            self._remote_nonce += bytes(data[:wanted])
            data = data[wanted:]
            if len(self._remote_nonce) < NONCE_BYTES:
                return
            self._in = XSalsa20(self._key, self._remote_nonce)
        inner: Any = self.inner
        if not isinstance(inner, asyncio.BufferedProtocol):
            if data:
                inner.data_received(self._in.xor(data))
            return
        while data:
            target = memoryview(inner.get_buffer(len(data)))
            size = min(len(target), len(data))
            if size == 0:
                raise RuntimeError("the reader's buffer is empty")
            self._in.xor_into(data[:size], target[:size])
            inner.buffer_updated(size)
            data = data[size:]

    def eof_received(self) -> bool | None:
        inner: Any = self.inner
        result: bool | None = inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def missing_key_hint(error: BaseException, have_key: bool) -> str:
    """What to add to a failed dial's message when we have no swarm key and the remote
    may have one: it then speaks noise where multistream should be, or hangs up."""
    text = str(error)
    if have_key or not ("handshake" in text or "multistream" in text):
        return ""
    return " (a private network's peer talks only to peers with its swarm key: --swarm-key PATH)"


def protect(key: bytes | None, inner: asyncio.BaseProtocol) -> asyncio.BaseProtocol:
    """The protocol to give a new connection's transport: ``inner`` itself without a
    key, else ``inner`` behind the swarm key's encryption."""
    return inner if key is None else ProtectedProtocol(key, inner)


def writing_transport(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """The transport a connection's ``StreamWriter`` must write through: the protected
    one when ``transport``'s protocol encrypts, else ``transport`` itself."""
    protocol = transport.get_protocol()
    if isinstance(protocol, ProtectedProtocol):
        assert protocol.transport is not None
        return protocol.transport
    return cast(asyncio.Transport, transport)
