"""The reserved peer's side of circuit relay v2: the ``stop`` protocol.

A relay we hold a reservation with opens ``/libp2p/circuit/relay/0.2.0/stop`` to say
someone ``CONNECT``s to us through it; we answer OK and the stream carries the
connection that peer then opens (it is the security handshake's initiator). Only relays
we reserved with may do this: nobody else has a reason to, and a peer that cannot be
dialed should not be made to accept connections from anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from multiaddr import Multiaddr

from peers.connection import Stream
from peers.delimited import encode_delimited, read_delimited
from peers.errors import ConnectionClosed, PeersError
from peers.identity import PeerID
from peers.relay.hop import REQUEST_TIMEOUT_SECONDS
from peers.relay.messages import (
    MAX_CIRCUIT_MESSAGE_BYTES,
    STOP_PROTOCOL_ID,
    RelayProtocolError,
    Status,
    StopMessage,
    StopType,
    decode_stop_message,
    encode_stop_message,
)

if TYPE_CHECKING:
    from peers.host import Peer

logger = logging.getLogger(__name__)


def install_stop_handler(peer: Peer, is_our_relay: Callable[[PeerID], bool]) -> None:
    """Serve ``stop`` on ``peer``, accepting circuits from relays ``is_our_relay`` names."""

    async def answer(stream: Stream, status: Status) -> None:
        message = StopMessage(type=StopType.STATUS, status=status)
        with contextlib.suppress(ConnectionClosed):
            await stream.write(encode_delimited(encode_stop_message(message)))

    async def serve_stop(stream: Stream) -> None:
        relay = stream.remote_peer_id
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                request = decode_stop_message(
                    await read_delimited(stream, MAX_CIRCUIT_MESSAGE_BYTES)
                )
        except RelayProtocolError as e:
            await answer(stream, e.status)
            stream.reset()
            return
        except (TimeoutError, PeersError) as e:
            logger.info("stop stream from %s failed: %r", relay, e)
            await answer(stream, Status.MALFORMED_MESSAGE)
            stream.reset()
            return
        if request.type != StopType.CONNECT:
            await answer(stream, Status.UNEXPECTED_MESSAGE)
            stream.reset()
            return
        if request.peer is None:
            await answer(stream, Status.MALFORMED_MESSAGE)
            stream.reset()
            return
        if stream.connection.relayed or not is_our_relay(relay):
            await answer(stream, Status.PERMISSION_DENIED)
            stream.reset()
            return
        source = request.peer.peer_id
        await answer(stream, Status.OK)
        remote = Multiaddr(
            f"{stream.connection.remote_address}/p2p/{relay}/p2p-circuit/p2p/{source}"
        )
        await peer.accept_relayed(stream, remote, expected=source)

    peer.set_stream_handler(STOP_PROTOCOL_ID, serve_stop)
