"""DCUtR (``/libp2p/dcutr``): turning a relayed connection into a direct one.

libp2p specs, relay/DCUtR.md. A dials B through a relay; B (the peer that accepted the
relayed connection) opens a DCUtR stream over it and sends CONNECT with its observed
addresses, timing the exchange; A answers CONNECT with its own; B sends SYNC and, half
the measured round trip later, dials A's addresses while A dials B's the moment SYNC
arrives. Both SYNs cross the NATs at about the same time, each opening its router's
mapping for the other's: a TCP simultaneous open. Both dial from their listen ports
(``SO_REUSEPORT``), the port their observed addresses name. On the direct connection A
is the security and muxer client, B the server, whoever's SYN went first (the spec).

go-libp2p before v0.27 took the roles the other way round (the stream's opener as the
client); an attempt whose handshake fails is retried with the roles swapped, so such a
peer still gets a direct connection on a later attempt. After :data:`MAX_ATTEMPTS`
failures the relayed connection simply stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multiaddr import Multiaddr

from peers.connection import Connection, Stream
from peers.dcutr.messages import (
    DCUTR_PROTOCOL_ID,
    MAX_HOLE_PUNCH_MESSAGE_BYTES,
    HolePunch,
    HolePunchType,
    decode_hole_punch,
    direct_addresses,
    encode_hole_punch,
)
from peers.delimited import encode_delimited, read_delimited
from peers.dial_filter import dialable
from peers.errors import ConnectionClosed, HandshakeError, PeersError
from peers.identity import PeerID
from peers.reachability import NatMapping

if TYPE_CHECKING:
    from peers.host import Peer

logger = logging.getLogger(__name__)

#: Attempts per relayed connection (the spec: "retries ... up to 3 times").
MAX_ATTEMPTS = 3
#: Seconds the CONNECT/SYNC exchange may take: a few round trips over a relay.
EXCHANGE_TIMEOUT_SECONDS = 10.0
#: Seconds each simultaneous dial may take (TCP and the whole upgrade). The two SYNs
#: meet within a round trip; a SYN the far router dropped is resent by the kernel after
#: 1 s, which the other side's SYN has opened the way for by then.
DIAL_TIMEOUT_SECONDS = 5.0
#: Addresses of the other side we dial per attempt (they are tried at once).
MAX_DIALS_PER_ATTEMPT = 8


@dataclass(frozen=True, slots=True)
class HolePunchResult:
    remote: PeerID
    success: bool
    attempts: int
    seconds: float


class HolePuncher:
    """DCUtR on ``peer``: serves the protocol (side A) and runs it (side B).
    ``observed_addrs()`` gives the addresses we tell the other side to dial."""

    def __init__(self, peer: Peer, observed_addrs: Callable[[], list[Multiaddr]]) -> None:
        self.peer = peer
        self._observed_addrs = observed_addrs
        self.results: list[HolePunchResult] = []
        #: Side A: peers whose last attempt failed, so the next takes the other role.
        self._swapped: set[PeerID] = set()
        #: Side A: peers whose DCUtR exchange with us is under way, each set when it ends.
        self._under_way: dict[PeerID, asyncio.Event] = {}
        #: Side A: set when any exchange begins, for :meth:`wait_for_direct`.
        self._began = asyncio.Event()
        peer.set_stream_handler(DCUTR_PROTOCOL_ID, self._serve)

    def _our_addrs(self) -> tuple[Multiaddr, ...]:
        return tuple(direct_addresses(self._observed_addrs()))[:MAX_DIALS_PER_ATTEMPT]

    async def _send(self, stream: Stream, message: HolePunch) -> None:
        await stream.write(encode_delimited(encode_hole_punch(message)))

    async def _receive(self, stream: Stream, expected: HolePunchType) -> HolePunch:
        message = decode_hole_punch(await read_delimited(stream, MAX_HOLE_PUNCH_MESSAGE_BYTES))
        if message.type != expected:
            raise HandshakeError(f"DCUtR: expected {expected.name}, got {message.type.name}")
        return message

    def _direct(self, remote: PeerID) -> Connection | None:
        conn = self.peer.connection_to(remote)
        return conn if conn is not None and not conn.relayed else None

    async def _dial_any(
        self, remote: PeerID, addrs: tuple[Multiaddr, ...], *, as_initiator: bool
    ) -> Connection | None:
        """Dial all of ``addrs`` at once; the first connection that upgrades wins. The
        remote chose them, so only those sensible to dial are (``peers.dial_filter``)."""
        local = self.peer.local_networks()
        addrs = tuple(dialable(direct_addresses(addrs), local))[:MAX_DIALS_PER_ATTEMPT]
        if not addrs:
            return None

        async def dial(addr: Multiaddr) -> Connection | None:
            try:
                return await self.peer.dial_direct(
                    addr, remote, as_initiator=as_initiator, timeout=DIAL_TIMEOUT_SECONDS
                )
            except (TimeoutError, PeersError, OSError) as e:
                logger.debug("hole punch dial to %s failed: %r", addr, e)
                return None

        for result in asyncio.as_completed([dial(a) for a in addrs]):
            conn = await result
            if conn is not None:
                return conn
        return self._direct(remote)  # the other side's dial may have won

    # --- side A: we dialed through the relay; the other side starts -----------------

    async def wait_for_direct(self, remote: PeerID, *, start_within: float) -> Connection | None:
        """Side A, right after dialing ``remote`` through a relay: wait until the hole
        punch the other side starts has ended, if it starts within ``start_within``
        seconds; the direct connection, or ``None`` (no punch came, or it failed).

        A caller about to send bulk data (a butterfly round's parts) would otherwise
        open its streams on the relayed connection, where they stay."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + start_within
        while remote not in self._under_way and self._direct(remote) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            began = self._began  # replaced by a fresh one each time it is set
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await began.wait()
        ended = self._under_way.get(remote)
        if ended is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS + DIAL_TIMEOUT_SECONDS):
                    await ended.wait()
        return self._direct(remote)

    async def _serve(self, stream: Stream) -> None:
        remote = stream.remote_peer_id
        if not stream.connection.relayed or self._direct(remote) is not None:
            stream.reset()
            return
        if self.peer.nat.mapping() == NatMapping.SYMMETRIC:
            # Our router picks a new port for each destination: the other side would
            # dial ports that lead nowhere, for its three attempts, while our traffic
            # waits. Refuse at once; the relayed connection stays.
            logger.info("refusing a hole punch from %s: our NAT is symmetric", remote)
            stream.reset()
            return
        ended = self._under_way.setdefault(remote, asyncio.Event())
        self._began.set()
        self._began = asyncio.Event()
        try:
            await self._serve_exchange(stream, remote)
        finally:
            ended.set()
            if self._under_way.get(remote) is ended:
                del self._under_way[remote]

    async def _serve_exchange(self, stream: Stream, remote: PeerID) -> None:
        try:
            async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
                connect = await self._receive(stream, HolePunchType.CONNECT)
                await self._send(stream, HolePunch(HolePunchType.CONNECT, self._our_addrs()))
                await self._receive(stream, HolePunchType.SYNC)
        except (TimeoutError, PeersError) as e:
            logger.info("DCUtR exchange from %s failed: %r", remote, e)
            stream.reset()
            return
        with contextlib.suppress(ConnectionClosed):
            await stream.close()
        # The attempt number rides on nothing in the protocol; A takes the spec's role
        # first and the swapped one after a failed handshake (see the module doc).
        as_initiator = remote not in self._swapped
        conn = await self._dial_any(remote, connect.addrs, as_initiator=as_initiator)
        if conn is None:
            self._swapped ^= {remote}
        else:
            self._swapped.discard(remote)
            logger.info("hole punch to %s succeeded (we dialed through the relay)", remote)

    # --- side B: a peer reached us through a relay; we start ------------------------

    async def punch(self, remote: PeerID) -> HolePunchResult:
        """Try to replace our relayed connection to ``remote`` with a direct one."""
        started = time.monotonic()
        attempt = 0
        success = False
        for attempt in range(1, MAX_ATTEMPTS + 1):
            if self._direct(remote) is not None:
                success = True
                break
            relayed = self.peer.connection_to(remote)
            if relayed is None:
                break  # the relayed connection is gone: nothing to upgrade
            as_initiator = attempt % 2 == 0  # the spec's role first, then swapped
            try:
                stream = await self.peer.new_stream(remote, DCUTR_PROTOCOL_ID)
                async with asyncio.timeout(EXCHANGE_TIMEOUT_SECONDS):
                    sent_at = time.monotonic()
                    await self._send(stream, HolePunch(HolePunchType.CONNECT, self._our_addrs()))
                    connect = await self._receive(stream, HolePunchType.CONNECT)
                    rtt = time.monotonic() - sent_at
                    await self._send(stream, HolePunch(HolePunchType.SYNC))
                with contextlib.suppress(ConnectionClosed):
                    await stream.close()
            except (TimeoutError, PeersError) as e:
                logger.info("DCUtR exchange with %s failed: %r", remote, e)
                continue
            await asyncio.sleep(rtt / 2)  # the spec: SYNC reaches A half a round trip on
            conn = await self._dial_any(remote, connect.addrs, as_initiator=as_initiator)
            if conn is not None:
                success = True
                break
        result = HolePunchResult(remote, success, attempt, time.monotonic() - started)
        self.results.append(result)
        del self.results[:-64]  # the recent ones are what statistics show
        logger.info(
            "hole punch to %s %s after %d attempt(s)",
            remote,
            "succeeded" if success else "failed; staying relayed",
            attempt,
        )
        return result
