"""libp2p ping (``/ipfs/ping/1.0.0``): the dialer sends 32 random bytes, the listener
echoes them, repeatedly on one stream (libp2p ping spec)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from peers.errors import RemoteProtocolError
from peers.stream_api import StreamHost, StreamLike

PING_PROTOCOL_ID = "/ipfs/ping/1.0.0"
PING_PAYLOAD_BYTES = 32
#: Pings one stream may carry; an echo loop must end (the spec lets the dialer reuse the
#: stream, go-libp2p sends one per stream).
MAX_PINGS_PER_STREAM = 1000


async def _serve_ping(stream: StreamLike) -> None:
    for _ in range(MAX_PINGS_PER_STREAM):
        try:
            payload = await stream.readexactly(PING_PAYLOAD_BYTES)
        except asyncio.IncompleteReadError:
            break
        await stream.write(payload)
    await stream.close()


def install_ping(peer: StreamHost) -> None:
    peer.set_stream_handler(PING_PROTOCOL_ID, _serve_ping)


async def ping_once(stream: StreamLike, payload: bytes, clock: Callable[[], float]) -> float:
    """Send one ping on ``stream``; the round-trip time in seconds.

    Raises :class:`RemoteProtocolError` if the echo differs.
    """
    start = clock()
    await stream.write(payload)
    echo = await stream.readexactly(len(payload))
    elapsed = clock() - start
    if echo != payload:
        raise RemoteProtocolError("ping echo does not match what we sent")
    return elapsed
