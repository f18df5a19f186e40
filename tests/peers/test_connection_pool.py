"""Several connections to one peer (``Peer.new_pooled_stream``) and TCP's own round-trip
figure (``Peer.round_trip``): what the all-reduce uses on long fat pipes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from peers import DialError, LimitExceeded, Peer, PeerConfig, PeersError
from peers.connection import Stream

Run = Callable[[Coroutine[Any, Any, Any]], Any]

ECHO_PROTOCOL = "/test/raw-echo/1.0.0"


def install_echo(peer: Peer) -> None:
    async def echo(stream: Stream) -> None:
        while data := await stream.read(65536):
            await stream.write(data)
        await stream.close()

    peer.set_stream_handler(ECHO_PROTOCOL, echo)


async def _echo_on(stream: Any, payload: bytes) -> bytes:
    await stream.write(payload)
    await stream.close()
    received = b""
    while chunk := await stream.read():
        received += chunk
    return received


def test_a_pooled_stream_runs_on_a_further_connection_kept_for_the_next_one(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as a, Peer() as b:
            install_echo(b)
            a.add_addresses(b.peer_id, b.listen_addrs)
            first = await a.new_stream(b.peer_id, ECHO_PROTOCOL)
            assert await _echo_on(first, b"first") == b"first"
            rtt = a.round_trip(b.peer_id)
            assert rtt is not None and 0 < rtt < 1.0  # loopback: TCP measured it
            # Two at once dial one further connection, not two.
            second, third = await asyncio.gather(
                a.new_pooled_stream(b.peer_id, ECHO_PROTOCOL, 1),
                a.new_pooled_stream(b.peer_id, ECHO_PROTOCOL, 1),
            )
            assert await _echo_on(second, b"second") == b"second"
            assert await _echo_on(third, b"third") == b"third"
            conns = a.direct_connections(b.peer_id)
            assert len(conns) == 2
            assert conns[0] is a.connection_to(b.peer_id)
            # The further connection carried both pooled streams' echoes.
            assert conns[1].session_statistics().num_data_bytes_received >= len(b"secondthird")
            assert a.statistics().num_connections == 2
            with pytest.raises(ValueError, match="connection index"):
                await a.new_pooled_stream(b.peer_id, ECHO_PROTOCOL, 0)
            with pytest.raises(LimitExceeded, match="max_connections_per_peer"):
                await a.new_pooled_stream(
                    b.peer_id, ECHO_PROTOCOL, a.config.max_connections_per_peer
                )

    arun(main())


def test_connect_pooled_dials_the_connection_a_later_pooled_stream_opens_on(arun: Run) -> None:
    """``connect_pooled`` makes the further connection and opens no stream (a silent
    stream could meet the remote's deadline for its first bytes); the pooled stream
    opened later runs on that connection without another dial."""

    async def main() -> None:
        async with Peer() as a, Peer() as b:
            install_echo(b)
            a.add_addresses(b.peer_id, b.listen_addrs)
            await a.connect(b.listen_addrs[0])
            await a.connect_pooled(b.peer_id, 1)
            await a.connect_pooled(b.peer_id, 1)  # there already: nothing dialed
            conns = a.direct_connections(b.peer_id)
            assert len(conns) == 2
            assert conns[1].session_statistics().num_data_bytes_received == 0
            stream = await a.new_pooled_stream(b.peer_id, ECHO_PROTOCOL, 1)
            assert await _echo_on(stream, b"pooled") == b"pooled"
            assert a.direct_connections(b.peer_id) == conns
            assert conns[1].session_statistics().num_data_bytes_received >= len(b"pooled")
            with pytest.raises(ValueError, match="connection index"):
                await a.connect_pooled(b.peer_id, 0)
            with pytest.raises(LimitExceeded, match="max_connections_per_peer"):
                await a.connect_pooled(b.peer_id, a.config.max_connections_per_peer)

    arun(main())


def test_a_peer_that_cannot_be_dialed_again_is_not_tried_again(arun: Run) -> None:
    """A peer that dialed us and listens nowhere (behind a NAT, a client): a further
    connection cannot be made; the error says so, the first connection keeps serving,
    and the next ask fails at once instead of dialing again."""

    async def main() -> None:
        async with Peer() as server, Peer(PeerConfig(listen_addrs=())) as client:
            install_echo(client)
            await client.connect(server.listen_addrs[0])
            with pytest.raises(DialError, match="no further connection"):
                await server.new_pooled_stream(client.peer_id, ECHO_PROTOCOL, 1)
            with pytest.raises(DialError, match="could not be dialed again lately"):
                await server.new_pooled_stream(client.peer_id, ECHO_PROTOCOL, 1)
            stream = await server.new_stream(client.peer_id, ECHO_PROTOCOL)
            assert await _echo_on(stream, b"still here") == b"still here"
            assert server.statistics().num_connections == 1

    arun(main())


def test_a_peer_refusing_more_connections_fails_the_pooled_stream_alone(arun: Run) -> None:
    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            b = await stack.enter_async_context(Peer(PeerConfig(max_connections_per_peer=1)))
            a = await stack.enter_async_context(Peer())
            install_echo(b)
            a.add_addresses(b.peer_id, b.listen_addrs)
            await a.new_stream(b.peer_id, ECHO_PROTOCOL)
            # It takes the handshake, then closes the connection: the stream fails.
            with pytest.raises(PeersError):
                stream = await a.new_pooled_stream(b.peer_id, ECHO_PROTOCOL, 1)
                await _echo_on(stream, b"x")
            stream = await a.new_stream(b.peer_id, ECHO_PROTOCOL)
            assert await _echo_on(stream, b"ok") == b"ok"
            # Remembered as a failed dial once that connection is gone: the next ask
            # (an all-reduce's next round) fails at once, and dials nothing.
            for _ in range(100):  # bounded: 5 s
                if len(a.direct_connections(b.peer_id)) == 1:
                    break
                await asyncio.sleep(0.05)
            refused = b.statistics().num_inbound_connections_refused
            with pytest.raises(DialError, match="could not be dialed again lately"):
                await a.connect_pooled(b.peer_id, 1)
            assert b.statistics().num_inbound_connections_refused == refused
            assert len(a.direct_connections(b.peer_id)) == 1

    arun(main())
