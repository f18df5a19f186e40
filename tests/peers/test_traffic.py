"""Bytes by protocol and unary call latencies (``peers.traffic``): counted by a real
peer pair as calls go, failures included, and bounded in the protocols they name."""

from __future__ import annotations

import asyncio

import pytest

from peers import Peer
from peers.errors import RemoteError
from peers.rpc import CallContext
from peers.traffic import LATENCY_BUCKETS, MAX_PROTOCOLS, OTHER, TrafficBook

ECHO = "/test/traffic/echo/1.0.0"
FAIL = "/test/traffic/fail/1.0.0"


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
