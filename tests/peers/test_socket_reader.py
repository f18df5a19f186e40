"""SocketReader: read during a handshake, then hand every byte to a callback."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any

from peers.socket_reader import SocketReader, open_connection, start_server

Run = Callable[[Coroutine[Any, Any, Any]], Any]
LIMIT = 64 * 1024


def test_the_base_class_still_has_the_state_divert_relies_on() -> None:
    async def main() -> None:
        reader = SocketReader(LIMIT)
        base: Any = reader
        assert isinstance(base._buffer, bytearray) and base._eof is False
        assert callable(base._maybe_resume_transport)

    asyncio.run(main())


def test_divert_passes_buffered_then_live_bytes_in_order_after_a_paused_read(
    arun: Run,
) -> None:
    payload = os.urandom(20 * LIMIT)  # far past the limit: the reader pauses the socket

    async def serve(reader: SocketReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await start_server(serve, "127.0.0.1", 0, limit=LIMIT)
        async with server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await open_connection("127.0.0.1", port, limit=LIMIT)
            head = await reader.readexactly(10)  # the "handshake"
            await asyncio.sleep(0.2)  # the buffer fills past the limit; reading pauses
            received: list[bytes] = []
            ended: asyncio.Future[BaseException | None] = asyncio.Future()
            reader.divert(received.append, ended.set_result)
            async with asyncio.timeout(10):
                assert await ended is None
            assert head + b"".join(received) == payload
            assert reader.diverted
            writer.close()

    arun(main())
