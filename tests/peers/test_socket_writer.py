"""SocketWriter: try the socket with the GIL released, leave the rest to the transport."""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from peers.runtime import run as run_on_best_loop
from peers.socket_writer import IOV_MAX, Buffer, SocketWriter, unsent

Run = Callable[[Coroutine[Any, Any, Any]], Any]
SMALL_BUFFER = 64 * 1024
LOOPS = pytest.mark.parametrize(
    "arun", [run_on_best_loop, asyncio.run], ids=["best-loop", "asyncio-loop"]
)


def test_unsent_cuts_the_buffers_at_every_offset() -> None:
    wide = memoryview(array.array("i", [1, 2]))  # items of 4 bytes: cut by bytes, not items
    buffers: list[Buffer] = [b"abc", b"", b"de", memoryview(b"fghij"), wide]
    whole = b"".join(bytes(b) for b in buffers)
    for sent in range(len(whole) + 1):
        left = unsent(buffers, sent)
        assert b"".join(bytes(b) for b in left) == whole[sent:]
        assert all(len(b) for b in left[:1])  # never starts with an emptied buffer


Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def _pair() -> AsyncIterator[Pair]:
    """A loopback TCP connection: the accepted side's reader and writer, and the dialled
    side's writer (the one under test)."""
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put((reader, writer))
        await done.wait()  # the connection stays open until the test is done with it

    # small buffers on both ends, so a few MB is sure to overflow them whatever the
    # host's defaults (set before connecting: accepted sockets inherit the listener's)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    server = await asyncio.start_server(serve, sock=listener)
    async with server:
        port = server.sockets[0].getsockname()[1]
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        _, writer = await asyncio.open_connection(sock=sock)
        try:
            async with asyncio.timeout(10):
                remote_reader, remote_writer = await accepted.get()
            yield remote_reader, remote_writer, writer
        finally:
            done.set()
            writer.close()


@LOOPS
def test_bytes_arrive_in_order_through_both_paths(arun: Run) -> None:
    """Far more than the socket buffers hold, written with nobody reading: the first
    writes go to the socket directly, later ones (the transport now holding bytes) to
    the transport, and after a drain directly again; the reader gets every byte in
    order."""
    rounds = [[os.urandom(n) for n in (1, 700, 64 << 10, 3 << 20)] for _ in range(4)]
    expected = b"".join(b for pieces in rounds for b in pieces)

    async def main() -> None:
        async with _pair() as (reader, _, writer):
            out = SocketWriter(writer)
            assert out.direct
            for pieces in rounds[:2]:
                out.writelines(pieces)
            assert writer.transport.get_write_buffer_size() > 0  # the rest was queued
            direct_before = out.num_direct_bytes
            assert 0 < direct_before < len(expected)
            received = bytearray()

            async def read_all() -> None:
                while len(received) < len(expected):
                    chunk = await reader.read(1 << 20)
                    assert chunk
                    received.extend(chunk)

            async with asyncio.timeout(20):
                reading = asyncio.ensure_future(read_all())
                for pieces in rounds[2:]:
                    for _ in range(2000):  # the transport's buffer drains as the reader reads
                        if not writer.transport.get_write_buffer_size():
                            break
                        await asyncio.sleep(0.005)
                    assert not writer.transport.get_write_buffer_size()
                    out.writelines(pieces)  # the transport is empty: the socket first
                await reading
            assert received == expected
            assert out.num_direct_bytes > direct_before  # the socket took some again

    arun(main())


@LOOPS
def test_a_reset_connection_is_the_transports_to_report(arun: Run) -> None:
    """The remote resets: ``writelines`` raises nothing, the transport meets the error on
    its own write and closes, and the writer's ``drain`` reports it, as without the
    direct writes."""

    async def main() -> None:
        async with _pair() as (_, remote, writer):
            out = SocketWriter(writer)
            linger_zero = struct.pack("ii", 1, 0)
            remote.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, linger_zero
            )
            remote.transport.abort()  # with linger 0: the remote sends a reset
            for _ in range(200):  # bounded: the reset is met within a few writes
                if writer.transport.is_closing():
                    break
                out.writelines([b"x" * 65536])
                await asyncio.sleep(0.01)
            with pytest.raises(ConnectionError):
                async with asyncio.timeout(10):
                    await writer.drain()
            assert writer.transport.is_closing()

    arun(main())


@LOOPS
def test_a_pipe_gets_every_byte(arun: Run) -> None:
    """Under a pipe transport: uvloop names the pipe's descriptor as its socket, and
    ``writev`` takes it; asyncio's names none, and the transport writes."""

    async def main() -> None:
        read_fd, write_fd = os.pipe()
        loop = asyncio.get_running_loop()
        with os.fdopen(read_fd, "rb", buffering=0) as source:
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, os.fdopen(write_fd, "wb", buffering=0)
            )
            writer = asyncio.StreamWriter(transport, protocol, None, loop)
            out = SocketWriter(writer)
            out.writelines([b"ab", memoryview(b"cd"), bytearray(b"ef")])
            await writer.drain()
            assert out.num_direct_bytes == (6 if out.direct else 0)
            assert source.read(6) == b"abcdef"
            transport.close()

    arun(main())


def test_buffers_past_one_writev_go_to_the_transport_after_it() -> None:
    async def main() -> None:
        async with _pair() as (reader, _, writer):
            out = SocketWriter(writer)
            pieces = [bytes([i % 256]) for i in range(IOV_MAX + 3)]
            out.writelines(pieces)
            assert out.num_direct_bytes == IOV_MAX  # one writev's worth; the rest queued
            async with asyncio.timeout(10):
                got = await reader.readexactly(len(pieces))
            assert got == b"".join(pieces)

    run_on_best_loop(main())


@LOOPS
def test_views_of_wider_items_are_sent_as_their_bytes(arun: Run) -> None:
    numbers = array.array("i", range(1000))

    async def main() -> None:
        async with _pair() as (reader, _, writer):
            out = SocketWriter(writer)
            out.writelines([b"<", memoryview(numbers), b">"])
            async with asyncio.timeout(10):
                got = await reader.readexactly(2 + len(numbers) * numbers.itemsize)
            assert got == b"<" + numbers.tobytes() + b">"

    arun(main())
