"""SocketReader: read during a handshake, then hand every byte to a callback."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

from peers.runtime import run as run_on_best_loop
from peers.socket_reader import READ_BUFFER_BYTES, SocketReader, open_connection, start_server

Run = Callable[[Coroutine[Any, Any, Any]], Any]
LIMIT = 64 * 1024
#: The loop the library picks (uvloop here) and asyncio's own: both honour the
#: BufferedProtocol a diverted reader switches its transport to.
LOOPS = pytest.mark.parametrize(
    "arun", [run_on_best_loop, asyncio.run], ids=["best-loop", "asyncio-loop"]
)
Serve = Callable[[SocketReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def serving(serve: Serve) -> AsyncIterator[int]:
    """A loopback server running ``serve`` per connection; yields its port."""
    server = await start_server(serve, "127.0.0.1", 0, limit=LIMIT)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def dial(port: int) -> tuple[SocketReader, asyncio.StreamWriter]:
    return await open_connection("127.0.0.1", port, limit=LIMIT)


def divert(
    reader: SocketReader, sink: Callable[[bytes | memoryview], None]
) -> asyncio.Future[BaseException | None]:
    """Divert ``reader`` into ``sink``; the future ends with what ended the stream."""
    ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    reader.divert(sink, ended.set_result)
    return ended


def test_the_base_class_still_has_the_state_divert_relies_on() -> None:
    async def main() -> None:
        reader = SocketReader(LIMIT)
        base: Any = reader
        assert isinstance(base._buffer, bytearray) and base._eof is False
        assert callable(base._maybe_resume_transport)

    asyncio.run(main())


@LOOPS
def test_divert_passes_buffered_then_live_bytes_in_order_after_a_paused_read(
    arun: Run,
) -> None:
    payload = os.urandom(20 * LIMIT)  # far past the limit: the reader pauses the socket

    async def serve(reader: SocketReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with serving(serve) as port:
            reader, writer = await dial(port)
            head = await reader.readexactly(10)  # the "handshake"
            await asyncio.sleep(0.2)  # the buffer fills past the limit; reading pauses
            received: list[bytes] = []
            ended = divert(reader, lambda data: received.append(bytes(data)))
            async with asyncio.timeout(10):
                assert await ended is None
            assert head + b"".join(received) == payload
            assert reader.diverted
            writer.close()

    arun(main())


@LOOPS
def test_diverted_reads_are_views_of_one_buffer_per_thread(arun: Run) -> None:
    payload = os.urandom(8 * READ_BUFFER_BYTES)

    async def serve(reader: SocketReader, writer: asyncio.StreamWriter) -> None:
        for start in range(0, len(payload), 100_000):  # many writes, many reads
            writer.write(payload[start : start + 100_000])
            await writer.drain()
        writer.close()

    async def main() -> None:
        async with serving(serve) as port:
            owners: set[int] = set()
            kinds: set[type] = set()
            writers = []
            received = [bytearray(), bytearray()]  # two connections, one thread
            ends: list[asyncio.Future[BaseException | None]] = []
            for into in received:
                reader, writer = await dial(port)
                writers.append(writer)

                def sink(data: bytes | memoryview, into: bytearray = into) -> None:
                    kinds.add(type(data))
                    if isinstance(data, memoryview):
                        owners.add(id(data.obj))
                        assert len(data) <= READ_BUFFER_BYTES
                    into.extend(data)  # copied now: the view is only valid in the call

                ends.append(divert(reader, sink))
            async with asyncio.timeout(10):
                assert await asyncio.gather(*ends) == [None, None]
            assert received == [payload, payload]
            # views only, all of one buffer: the thread's, shared by its connections
            assert kinds == {memoryview} and len(owners) == 1
            for writer in writers:
                writer.close()

    arun(main())


@LOOPS
def test_a_diverted_connections_writer_still_waits_for_a_slow_reader(arun: Run) -> None:
    """``drain`` relies on the transport pausing and resuming writing through its
    protocol: the diverted protocol passes that on."""
    payload = os.urandom(32 << 20)  # far past the socket buffers: writing must pause
    started = asyncio.Event()

    async def serve(reader: SocketReader, writer: asyncio.StreamWriter) -> None:
        await started.wait()  # reads nothing before: the writer fills every buffer
        got = 0
        while got < len(payload):
            chunk = await reader.read(1 << 20)
            assert chunk
            got += len(chunk)
        writer.write(b"done")
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with serving(serve) as port:
            reader, writer = await dial(port)
            received = bytearray()
            ended = divert(reader, received.extend)
            writer.write(payload)
            assert writer.transport.get_write_buffer_size() > 0  # not all of it went out
            draining = asyncio.ensure_future(writer.drain())
            await asyncio.sleep(0.2)
            assert not draining.done()  # paused: nobody reads on the other side yet
            started.set()
            async with asyncio.timeout(20):
                await draining  # resumed once the reader has taken enough
                assert await ended is None
            assert received == b"done"
            writer.close()

    arun(main())


@LOOPS
def test_a_reset_after_divert_ends_with_the_error(arun: Run) -> None:
    async def serve(reader: SocketReader, writer: asyncio.StreamWriter) -> None:
        transport: Any = writer.transport
        transport.pause_reading()  # the client's bytes stay in the kernel, unread
        writer.write(b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(0.2)
        transport.abort()  # closing with unread data sends RST, not FIN

    async def main() -> None:
        async with serving(serve) as port:
            reader, writer = await dial(port)
            writer.write(b"never read")
            received = bytearray()
            ended = divert(reader, received.extend)
            async with asyncio.timeout(10):
                error = await ended
            assert received == b"x" * 1000
            assert isinstance(error, ConnectionResetError)
            writer.close()

    arun(main())
