"""A yamux stream used as a socket: what carries a connection through a circuit relay.

A relayed libp2p connection is a whole connection (Noise, then yamux) running inside one
stream of the connection to the relay (circuit relay v2 spec, "Once the stop handshake
completes, the stream is used as a raw connection"). Our :class:`Connection` and
:func:`upgrade` read and write a socket through asyncio's transports; rather than give
them a second code path, the relayed stream is bridged to one end of a
``socket.socketpair()`` and the connection runs on the other end exactly as on TCP.

The bridge costs a kernel copy each way, which a relayed path (bounded by the relay's
uplink, and replaced by a direct connection when hole punching succeeds) can afford.
Backpressure holds end to end: the bridge writes to the stream only as fast as the
remote's yamux window opens and drains the socket only as fast as it writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Coroutine
from typing import Any

from peers.connection import Stream
from peers.errors import ConnectionClosed
from peers.pnet import protect, writing_transport
from peers.socket_reader import SocketReader

#: Bytes the bridge moves per read from the socket side: a few of the connection's
#: Noise frames at once, so a bulk transfer costs few Python iterations per MB.
BRIDGE_READ_BYTES = 256 * 1024
#: Bytes the socket side buffers before the bridge stops reading it (backpressure).
BRIDGE_BUFFER_BYTES = 1024 * 1024
#: Seconds the stream's inbound direction may run on after the local side has closed
#: its end: long enough for the remote's goodbye (a yamux GoAway and its close), short
#: enough that a remote that never closes cannot hold the bridge.
CLOSE_GRACE_SECONDS = 5.0


async def stream_as_socket(
    stream: Stream, *, limit: int, swarm_key: bytes | None = None
) -> tuple[SocketReader, asyncio.StreamWriter, Coroutine[Any, Any, None]]:
    """A socket-backed reader and writer carrying ``stream``'s bytes, and the coroutine
    that moves them (the caller runs it in a task it owns, for the connection's life).

    The coroutine returns when both directions have ended; if the stream breaks, the
    socket is closed (the connection on it sees the end), and if the socket side ends
    first the stream is half-closed, then reset after :data:`CLOSE_GRACE_SECONDS`.
    Cancelling it resets the stream and closes the sockets. With ``swarm_key``, the
    connection on the socket is encrypted with it (:mod:`peers.pnet`), as on TCP.
    """
    ours, bridge = socket.socketpair()
    ours.setblocking(False)
    bridge.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        reader = SocketReader(limit)
        protocol = asyncio.StreamReaderProtocol(reader)
        outer = protect(swarm_key, protocol)
        transport, _ = await loop.create_unix_connection(lambda: outer, sock=ours)
        writer = asyncio.StreamWriter(writing_transport(transport), protocol, reader, loop)
        bridge_reader, bridge_writer = await asyncio.open_unix_connection(
            sock=bridge, limit=BRIDGE_BUFFER_BYTES
        )
    except BaseException:
        ours.close()
        bridge.close()
        raise
    return reader, writer, _bridge(stream, bridge_reader, bridge_writer)


async def _bridge(
    stream: Stream, sock_reader: asyncio.StreamReader, sock_writer: asyncio.StreamWriter
) -> None:
    async def socket_to_stream() -> None:
        while data := await sock_reader.read(BRIDGE_READ_BYTES):
            await stream.write(data)
        await stream.close()

    async def stream_to_socket() -> None:
        while data := await stream.read():
            sock_writer.write(data)
            await sock_writer.drain()
        if sock_writer.can_write_eof():
            sock_writer.write_eof()

    outbound = asyncio.ensure_future(socket_to_stream())
    inbound = asyncio.ensure_future(stream_to_socket())
    clean = False
    try:
        await asyncio.wait([outbound, inbound], return_when=asyncio.FIRST_COMPLETED)
        if _ended_well(outbound):
            # Our side closed its end: let the remote's last frames through, briefly.
            await asyncio.wait([inbound], timeout=CLOSE_GRACE_SECONDS)
        elif _ended_well(inbound):
            # The remote is done sending; the connection on our end closes on that EOF,
            # which ends the other direction.
            await asyncio.wait([outbound])
        clean = _ended_well(outbound) and _ended_well(inbound)
    finally:
        for task in (outbound, inbound):
            if not task.done():
                task.cancel()
        for task in (outbound, inbound):
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed, OSError):
                await task
        if not clean:
            stream.reset()
        sock_writer.close()


def _ended_well(task: asyncio.Future[None]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None
