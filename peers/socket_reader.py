"""TCP streams whose reader can hand its bytes straight to a callback.

The handshake (multistream, Noise, muxer selection) reads with ``await reader.read()``
like any asyncio stream. Afterwards a connection only ever feeds what arrives to its
Noise and yamux state machines, so :meth:`SocketReader.divert` makes the reader pass
each chunk to a callback as the transport delivers it: no copy into the reader's buffer
and out again, no task wake-up per read (less CPU per all-reduce round:
docs/benchmarks.md, "Figures behind constants"). Backpressure then comes from yamux's
per-stream windows, which bound what a remote may send before we consume it.

Diverted, the transport reads into a buffer reused for every read (asyncio's
``BufferedProtocol``, which uvloop and the standard loops both honour), and the callback
gets a view of the bytes just read: no ``bytes`` object is made and filled per read.
The callback must be done with the view when it returns. One buffer serves every
connection of a thread: a loop runs one read callback at a time, so 1024 connections
cost 256 KiB, not 256 MiB.

:func:`open_connection` and :func:`start_server` are asyncio's, building a
:class:`SocketReader` instead of a plain ``StreamReader``.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, SupportsIndex, cast

from peers.pnet import protect, writing_transport

Sink = Callable[[bytes | memoryview], None]
End = Callable[[BaseException | None], None]

#: Bytes one read may deliver once diverted (uvloop suggests the same size).
READ_BUFFER_BYTES = 256 * 1024

_per_thread = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read buffer (its event loop's), made on first use."""
    buffer: memoryview | None = getattr(_per_thread, "read_buffer", None)
    if buffer is None:
        buffer = _per_thread.read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))
    return buffer


class SocketReader(asyncio.StreamReader):
    """A ``StreamReader`` that can stop buffering and call ``sink`` with each chunk."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit=limit)
        self._sink: Sink | None = None
        self._end: End | None = None
        self._ended = False

    @property
    def diverted(self) -> bool:
        return self._sink is not None

    def divert(self, sink: Sink, end: End) -> None:
        """From now on call ``sink(data)`` for every chunk received (first with what is
        buffered) and ``end(error)`` once when the stream ends (``None`` at EOF)."""
        if self._sink is not None:
            raise RuntimeError("the reader is already diverted")
        # StreamReader's own buffer and state, not in its typed interface (the base class
        # has kept these names since Python 3.4; tests/peers/test_socket_reader.py checks
        # them on the Python that runs the tests).
        base: Any = self
        buffered = bytes(base._buffer)
        base._buffer.clear()
        self._sink, self._end = sink, end
        transport: asyncio.Transport | None = base._transport
        if transport is not None and not transport.is_closing():
            transport.set_protocol(_Diverted(transport.get_protocol(), self))
        base._maybe_resume_transport()  # it may have paused reading on a full buffer
        if buffered:
            sink(buffered)
        error = self.exception()
        if error is not None or base._eof:
            self._finish(error)

    def _deliver(self, data: memoryview) -> None:
        if self._sink is not None and not self._ended:
            self._sink(data)

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        if self._sink is None:
            super().feed_data(data)
        elif not self._ended:
            self._sink(cast(bytes, data))  # the transport delivers bytes

    def feed_eof(self) -> None:
        super().feed_eof()
        self._finish(None)

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        self._finish(exc)

    def _finish(self, error: BaseException | None) -> None:
        if self._end is not None and not self._ended:
            self._ended = True
            self._end(error)


class _Diverted(asyncio.BufferedProtocol):
    """The transport's protocol once its reader is diverted: reads land in the thread's
    read buffer and go to the reader's sink as views; everything else (end of stream, lost
    connection, write flow control for ``StreamWriter.drain``) goes to the original
    ``StreamReaderProtocol`` as before."""

    def __init__(self, original: asyncio.BaseProtocol, reader: SocketReader) -> None:
        self._original: Any = original
        self._reader = reader
        self._buffer = _read_buffer()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self._reader._deliver(self._buffer[:nbytes])

    def eof_received(self) -> bool | None:
        result: bool | None = self._original.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self._original.connection_lost(exc)

    def pause_writing(self) -> None:
        self._original.pause_writing()

    def resume_writing(self) -> None:
        self._original.resume_writing()


async def open_connection(
    host: str,
    port: int,
    *,
    limit: int,
    local_addr: tuple[str, int] | None = None,
    swarm_key: bytes | None = None,
) -> tuple[SocketReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` with a :class:`SocketReader`; with ``swarm_key``,
    every byte encrypted with it (:mod:`peers.pnet`).

    With ``local_addr``, the connection leaves from that address and port, which a
    listener of ours also holds (both set ``SO_REUSEPORT``): a NAT then maps the
    connection to the mapping our listen port already has, which is what lets observed
    addresses name a port that reaches us, and what TCP hole punching needs (libp2p
    DCUtR spec). If the kernel cannot give that port for this destination (a connection
    to the same endpoint still in TIME_WAIT), the dial leaves from an ephemeral port.
    """
    loop = asyncio.get_running_loop()
    reader = SocketReader(limit)
    protocol = asyncio.StreamReaderProtocol(reader)
    sock = None
    if local_addr is not None:
        try:
            sock = await _connect_from(host, port, local_addr)
        except OSError as e:
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise
    outer = protect(swarm_key, protocol)
    if sock is not None:
        transport, _ = await loop.create_connection(lambda: outer, sock=sock)
    else:
        transport, _ = await loop.create_connection(lambda: outer, host, port)
    return reader, asyncio.StreamWriter(writing_transport(transport), protocol, reader, loop)


async def _connect_from(host: str, port: int, local_addr: tuple[str, int]) -> socket.socket:
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in local_addr[0] else socket.AF_INET
    infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(errno.EADDRNOTAVAIL, f"no {family.name} address for {host}")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(local_addr)
        sock.setblocking(False)
        await loop.sock_connect(sock, infos[0][4])
    except BaseException:
        sock.close()
        raise
    return sock


def can_reuse_port() -> bool:
    """Whether this platform lets a listener and outbound connections share a port."""
    return hasattr(socket, "SO_REUSEPORT")


async def start_server(
    on_connection: Callable[[SocketReader, asyncio.StreamWriter], Awaitable[None]],
    host: str | None,
    port: int,
    *,
    limit: int,
    reuse_port: bool = False,
    swarm_key: bytes | None = None,
) -> asyncio.Server:
    """``asyncio.start_server`` with a :class:`SocketReader` per connection; with
    ``swarm_key``, every byte encrypted with it (:mod:`peers.pnet`).

    ``reuse_port`` sets ``SO_REUSEPORT`` so outbound connections can leave from the
    listen port (see :func:`open_connection`). A fixed port that another socket
    holds is still refused: the port is first bound without the option, so two
    processes never share a listen port by accident.
    """
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.BaseProtocol:
        reader = SocketReader(limit)
        callback: Any = on_connection  # StreamReaderProtocol's callback type is loose
        return protect(swarm_key, asyncio.StreamReaderProtocol(reader, callback))

    if reuse_port and port:
        family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host or "", port))  # OSError(EADDRINUSE) if someone holds it
    return await loop.create_server(factory, host, port, reuse_port=reuse_port or None)
