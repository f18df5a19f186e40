"""AutoNAT v1 (``/libp2p/autonat/1.0.0``): dialing a peer back, and asking to be dialed.

libp2p specs, autonat/autonat-v1.md: a peer sends a DIAL with its addresses; the server
opens a *new* connection to those of them on the IP the request came from (never a
third party's address, so AutoNAT cannot be used to make us dial someone else) and
answers OK with the address that worked, or ``E_DIAL_ERROR``. Requests are rate
limited per peer and in all (:class:`peers.autonat.policy.DialRateLimiter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from multiaddr import Multiaddr

from peers.addresses import tcp_target
from peers.autonat.messages import (
    AUTONAT_PROTOCOL_ID,
    MAX_AUTONAT_MESSAGE_BYTES,
    AutoNATProtocolError,
    Dial,
    DialResponse,
    ResponseStatus,
    decode_autonat_message,
    encode_autonat_message,
)
from peers.autonat.policy import DialRateLimiter, check_dial_request, dial_back_addresses
from peers.connection import Stream
from peers.delimited import encode_delimited, read_delimited
from peers.errors import AddressError, ConnectionClosed, PeersError
from peers.identity import PeerID

if TYPE_CHECKING:
    from peers.host import Peer

logger = logging.getLogger(__name__)

#: Seconds a requester has to send its DIAL.
REQUEST_TIMEOUT_SECONDS = 10.0
#: Seconds one dial-back may take (TCP connect and the whole upgrade). A dropped SYN is
#: retried by the kernel after 1 s and 3 s, so 5 s sees a reachable peer on any link we
#: support (round trips up to a few hundred ms) and gives up on a NAT soon enough.
DIAL_BACK_TIMEOUT_SECONDS = 5.0
#: Seconds a requester waits for the answer: every address may take a dial-back.
RESPONSE_TIMEOUT_SECONDS = 20.0


class AutoNATServer:
    """Serve AutoNAT v1 dial-backs on ``peer`` while ``is_allowed()`` (a private peer's
    dial-backs would say nothing about the requester)."""

    def __init__(self, peer: Peer, is_allowed: Callable[[], bool]) -> None:
        self.peer = peer
        self._is_allowed = is_allowed
        self._limiter = DialRateLimiter()
        self.num_dial_backs = 0
        peer.set_stream_handler(AUTONAT_PROTOCOL_ID, self._serve)

    async def _answer(
        self, stream: Stream, status: ResponseStatus, text: str = "", addr: Multiaddr | None = None
    ) -> None:
        response = DialResponse(status=status, status_text=text[:200], addr=addr)
        with contextlib.suppress(ConnectionClosed):
            await stream.write(encode_delimited(encode_autonat_message(response)))
            await stream.close()

    async def _serve(self, stream: Stream) -> None:
        remote = stream.remote_peer_id
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                request = decode_autonat_message(
                    await read_delimited(stream, MAX_AUTONAT_MESSAGE_BYTES)
                )
            if not isinstance(request, Dial):
                raise AutoNATProtocolError("expected a DIAL")
            check_dial_request(request, remote)
        except AutoNATProtocolError as e:
            await self._answer(stream, e.status, str(e))
            return
        except (TimeoutError, PeersError) as e:
            await self._answer(stream, ResponseStatus.E_BAD_REQUEST, str(e))
            return
        conn = stream.connection
        if conn.relayed or not self._is_allowed():
            await self._answer(stream, ResponseStatus.E_DIAL_REFUSED, "not serving dial-backs")
            return
        try:
            observed_ip = tcp_target(conn.remote_address).host
        except AddressError:
            await self._answer(stream, ResponseStatus.E_DIAL_REFUSED, "no observed IP")
            return
        addrs = dial_back_addresses(request.addrs, observed_ip)
        if not addrs:
            await self._answer(
                stream, ResponseStatus.E_DIAL_REFUSED, "no address on the IP you came from"
            )
            return
        if not self._limiter.allow(remote, time.monotonic()):
            await self._answer(stream, ResponseStatus.E_DIAL_REFUSED, "too many requests")
            return
        self.num_dial_backs += 1
        for addr in addrs:
            if await self.peer.check_dialable(addr, remote, timeout=DIAL_BACK_TIMEOUT_SECONDS):
                await self._answer(stream, ResponseStatus.OK, addr=addr)
                return
        await self._answer(stream, ResponseStatus.E_DIAL_ERROR, "no address could be dialed")


async def request_dial_back(peer: Peer, server: PeerID, addrs: Sequence[Multiaddr]) -> DialResponse:
    """Ask ``server`` to dial us back at ``addrs``; its answer. Raises
    :class:`peers.errors.PeersError` (or TimeoutError) if it does not answer."""
    stream = await peer.new_stream(server, AUTONAT_PROTOCOL_ID)
    try:
        async with asyncio.timeout(RESPONSE_TIMEOUT_SECONDS):
            await stream.write(
                encode_delimited(encode_autonat_message(Dial(peer.peer_id, tuple(addrs))))
            )
            answer = decode_autonat_message(await read_delimited(stream, MAX_AUTONAT_MESSAGE_BYTES))
    finally:
        stream.reset()
    if not isinstance(answer, DialResponse):
        raise AutoNATProtocolError(f"{server} answered a DIAL with a DIAL")
    return answer
