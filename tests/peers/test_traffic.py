"""Bytes by protocol and unary call latencies (``peers.traffic``): counted by a real
peer pair as calls go, failures included, and bounded in the protocols they name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from peers import Peer
from peers.errors import RemoteError
from peers.rpc import CallContext
from peers.traffic import LATENCY_BUCKETS, MAX_PROTOCOLS, OTHER, TrafficBook

ECHO = "/test/traffic/echo/1.0.0"
FAIL = "/test/traffic/fail/1.0.0"
STREAM = "/test/traffic/stream/1.0.0"


def test_the_histogram_is_cumulative_and_names_are_bounded() -> None:
    book = TrafficBook()
    for seconds in (0.0005, 0.001, 0.02, 100.0):
        book.call_ended("/p", seconds, failed=seconds > 50)
    calls = book.snapshot().calls["/p"]
    assert calls.count == 4 and calls.failures == 1
    assert calls.sum_seconds == pytest.approx(100.0215)
    assert calls.bucket_counts[0] == 2  # <= 1 ms, the bound included
    assert calls.bucket_counts[LATENCY_BUCKETS.index(0.025)] == 3
    assert calls.bucket_counts[-2] == 3 and calls.bucket_counts[-1] == 4  # 60 s, +Inf
    for i in range(MAX_PROTOCOLS + 10):
        book.sent(f"/p/{i}", 1)
    protocols = book.snapshot().protocols
    assert len(protocols) == MAX_PROTOCOLS + 1 and protocols[OTHER].bytes_sent == 10


def test_a_peer_counts_bytes_by_protocol_and_its_calls_with_their_failures() -> None:
    async def echo(request: bytes, context: CallContext) -> bytes:
        return request

    async def fail(request: bytes, context: CallContext) -> bytes:
        raise ValueError("no")

    async def main() -> None:
        async with Peer() as server, Peer() as client:
            server.add_unary_handler(ECHO, echo, bytes)
            server.add_unary_handler(FAIL, fail, bytes)
            address = f"{server.listen_addrs[0]}/p2p/{server.peer_id}"
            for _ in range(3):
                assert await client.call_unary(address, ECHO, b"x" * 10_000, bytes) == b"x" * 10_000
            with pytest.raises(RemoteError):
                await client.call_unary(address, FAIL, b"y", bytes)
            mine = client.statistics().traffic
            theirs = server.statistics().traffic
            assert mine.protocols[ECHO].bytes_sent >= 30_000
            assert mine.protocols[ECHO].bytes_received >= 30_000
            assert theirs.protocols[ECHO].bytes_received >= 30_000
            assert theirs.protocols[ECHO].bytes_sent >= 30_000
            assert mine.calls[ECHO].count == 3 and mine.calls[ECHO].failures == 0
            assert mine.calls[FAIL].count == 1 and mine.calls[FAIL].failures == 1
            assert ECHO not in theirs.calls  # it served them; it called no one

    asyncio.run(main())


def test_streaming_calls_are_timed_to_the_end_of_their_responses() -> None:
    """Finished and failed streaming calls are counted by protocol; one the caller
    closes early is not, and its stream is reset at once (the server's handler ends)."""
    ended = asyncio.Event()

    async def count_to(requests: AsyncIterator[int], context: CallContext) -> AsyncIterator[int]:
        try:
            async for n in requests:
                for i in range(n):
                    yield i
        finally:
            ended.set()

    async def fails(requests: AsyncIterator[int], context: CallContext) -> AsyncIterator[int]:
        async for _ in requests:
            raise ValueError("no")
        yield 0

    async def main() -> None:
        async with Peer() as server, Peer() as client:
            server.add_stream_handler(STREAM, count_to, int)
            server.add_stream_handler(FAIL, fails, int)
            address = f"{server.listen_addrs[0]}/p2p/{server.peer_id}"
            for _ in range(2):
                assert [x async for x in client.call_stream(address, STREAM, [3], int)] == [0, 1, 2]
            with pytest.raises(RemoteError):
                _ = [x async for x in client.call_stream(address, FAIL, [1], int)]
            ended.clear()
            early = client.call_stream(address, STREAM, [1_000_000], int)
            assert await anext(early) == 0
            await early.aclose()
            await asyncio.wait_for(ended.wait(), 10)  # the reset reached the handler
            streams = client.statistics().traffic.stream_calls
            assert streams[STREAM].count == 2 and streams[STREAM].failures == 0
            assert streams[FAIL].count == 1 and streams[FAIL].failures == 1
            assert STREAM not in client.statistics().traffic.calls  # unary ones apart

    asyncio.run(main())
