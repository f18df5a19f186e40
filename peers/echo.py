"""Echo services: a diagnostic a bootstrap peer offers so others can check the whole
path (dial, Noise, yamux, RPC, arrays) end to end, and a target for test swarms.

``/swarmtrain/echo/1.0.0`` answers a unary string with the same string;
``/swarmtrain/echo-stream/1.0.0`` sends back every array it receives, as it arrives.
Both are bounded by the RPC frame limit; echoing only to the authenticated caller
amplifies nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np

from peers.host import Peer
from peers.rpc import CallContext
from peers.testing import Node

ECHO_PROTOCOL_ID = "/swarmtrain/echo/1.0.0"
ECHO_STREAM_PROTOCOL_ID = "/swarmtrain/echo-stream/1.0.0"


async def _echo(request: str, context: CallContext) -> str:
    return request


async def _echo_stream(
    requests: AsyncIterator[np.ndarray], context: CallContext
) -> AsyncIterator[np.ndarray]:
    async for array in requests:
        yield array


def install_echo(peer: Peer) -> None:
    peer.add_unary_handler(ECHO_PROTOCOL_ID, _echo, str)
    peer.add_stream_handler(ECHO_STREAM_PROTOCOL_ID, _echo_stream, np.ndarray)


async def serve_echo(node: Node) -> None:
    """A :mod:`peers.testing` target: serve the echo services until stopped."""
    install_echo(node.peer)
    for addr in node.options.get("bootstrap", []):
        await node.peer.connect(addr)
    node.report({"event": "serving"})
