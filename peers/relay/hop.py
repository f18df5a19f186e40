"""The relay side of circuit relay v2: the ``hop`` protocol (libp2p specs, circuit-v2.md).

A public peer serves ``/libp2p/circuit/relay/0.2.0/hop``: peers that cannot be dialed
``RESERVE`` a slot (bound to their live connection, renewed before it expires, with a
voucher signed by us), and anyone may ``CONNECT`` to a peer holding a slot: we open a
``stop`` stream to it, and once it answers OK we splice the two streams, within the
circuit's limits (duration, bytes each way). Every decision about resources is
:class:`peers.relay.resources.RelayResources`'s; this module moves the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from peers.addresses import tcp_target, with_peer_id
from peers.connection import Connection, Stream
from peers.delimited import encode_delimited, read_delimited
from peers.errors import AddressError, ConnectionClosed, PeersError
from peers.relay.messages import (
    HOP_PROTOCOL_ID,
    MAX_CIRCUIT_MESSAGE_BYTES,
    STOP_PROTOCOL_ID,
    HopMessage,
    HopType,
    PeerInfo,
    RelayProtocolError,
    Reservation,
    Status,
    StopMessage,
    StopType,
    decode_hop_message,
    decode_stop_message,
    encode_hop_message,
    encode_stop_message,
)
from peers.relay.resources import (
    CircuitGrant,
    RelayResourceConfig,
    RelayResources,
    RelayResourceStatistics,
)
from peers.relay.voucher import make_voucher

if TYPE_CHECKING:
    from peers.host import Peer

logger = logging.getLogger(__name__)

#: Seconds a hop stream has to send its request, and a reserved peer to answer our
#: stop CONNECT: both are one small message over a live connection; a few round trips
#: of the slowest links we support (about a second) with room for a busy peer.
REQUEST_TIMEOUT_SECONDS = 10.0
#: Bytes read from one side of a circuit at a time: up to a whole AES-GCM Noise frame
#: of the relayed connection, so bulk traffic costs few Python iterations per MB.
SPLICE_READ_BYTES = 1024 * 1024


class RelayService:
    """Serve circuit relay v2 hops on ``peer``. ``is_allowed()`` says whether we relay
    at all just now (a private peer does not: nobody could dial through it)."""

    def __init__(
        self,
        peer: Peer,
        config: RelayResourceConfig | None = None,
    ) -> None:
        self.peer = peer
        self.resources = RelayResources(config)
        self._watched: set[Connection] = set()
        peer.set_stream_handler(HOP_PROTOCOL_ID, self._serve_hop)

    def statistics(self) -> RelayResourceStatistics:
        return self.resources.statistics()

    def holds_reservation(self, conn: Connection) -> bool:
        """Whether ``conn`` carries a reservation of ours (closing it would end it)."""
        return conn in self._watched

    async def _answer(self, stream: Stream, status: Status, **fields: object) -> None:
        message = HopMessage(type=HopType.STATUS, status=status, **fields)  # type: ignore[arg-type]
        with contextlib.suppress(ConnectionClosed):
            await stream.write(encode_delimited(encode_hop_message(message)))

    async def _serve_hop(self, stream: Stream) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                raw = await read_delimited(stream, MAX_CIRCUIT_MESSAGE_BYTES)
            request = decode_hop_message(raw)
        except RelayProtocolError as e:
            await self._refuse(stream, e.status, str(e))
            return
        except (TimeoutError, PeersError) as e:  # oversized, truncated, timed out
            await self._refuse(stream, Status.MALFORMED_MESSAGE, str(e))
            return
        if not self.peer.is_relay_allowed():
            await self._refuse(stream, Status.PERMISSION_DENIED, "not serving as a relay")
        elif request.type == HopType.RESERVE:
            await self._reserve(stream)
        elif request.type == HopType.CONNECT:
            await self._connect(stream, request)
        else:
            await self._refuse(stream, Status.UNEXPECTED_MESSAGE, f"a {request.type.name}")

    async def _refuse(self, stream: Stream, status: Status, why: str) -> None:
        logger.info(
            "refusing a hop request from %s: %s (%s)", stream.remote_peer_id, why, status.name
        )
        await self._answer(stream, status)
        with contextlib.suppress(ConnectionClosed):
            await stream.close()

    # --- reservations --------------------------------------------------------------

    async def _reserve(self, stream: Stream) -> None:
        conn = stream.connection
        if conn.relayed:
            await self._refuse(stream, Status.PERMISSION_DENIED, "a reservation over a relay")
            return
        try:
            ip = tcp_target(conn.remote_address).host
        except AddressError:
            await self._refuse(stream, Status.PERMISSION_DENIED, "no IP address to account")
            return
        now = time.time()
        grant = self.resources.reserve(stream.remote_peer_id, ip, conn, now)
        if isinstance(grant, Status):
            await self._refuse(stream, grant, "reservation limits")
            return
        reservation = Reservation(
            expire_unix_seconds=grant.expire_unix_seconds,
            addrs=tuple(with_peer_id(a, self.peer.peer_id) for a in self.peer.listen_addrs),
            voucher=make_voucher(self.peer.identity, grant.peer, grant.expire_unix_seconds),
        )
        await self._answer(stream, Status.OK, reservation=reservation, limit=grant.limit)
        self.peer.nat.notify_changed()
        with contextlib.suppress(ConnectionClosed):
            await stream.close()
        if conn in self._watched:
            return
        # The reservation lives as long as its connection (spec: "If the peer
        # disconnects, the reservation is no longer valid"). This task is the
        # connection's own, so it ends (and releases) when the connection does.
        self._watched.add(conn)
        try:
            await conn.wait_closed()
        finally:
            self._watched.discard(conn)
            self.resources.release_connection(conn)
            self.peer.nat.notify_changed()

    # --- circuits ------------------------------------------------------------------

    async def _connect(self, stream: Stream, request: HopMessage) -> None:
        if request.peer is None:
            await self._refuse(stream, Status.MALFORMED_MESSAGE, "CONNECT names no peer")
            return
        src, dst = stream.remote_peer_id, request.peer.peer_id
        if stream.connection.relayed:
            await self._refuse(stream, Status.PERMISSION_DENIED, "a circuit over a circuit")
            return
        dst_conn = self.peer.connection_to(dst)
        if dst_conn is None or dst_conn.relayed:
            self.resources.expire(time.time())
            await self._refuse(stream, Status.NO_RESERVATION, f"{dst} is not connected")
            return
        grant = self.resources.open_circuit(src, dst, time.time())
        if isinstance(grant, Status):
            await self._refuse(stream, grant, f"circuit {src} -> {dst}")
            return
        try:
            stop = await self._open_stop(grant, stream.connection)
            if stop is None:
                await self._refuse(stream, Status.CONNECTION_FAILED, f"{dst} did not accept")
                return
            await self._answer(stream, Status.OK, limit=grant.limit)
            self.peer.nat.notify_changed()
            await self._splice(grant, stream, stop)
        finally:
            self.resources.close_circuit(grant.circuit_id)
            self.peer.nat.notify_changed()

    async def _open_stop(self, grant: CircuitGrant, src_conn: Connection) -> Stream | None:
        src_info = PeerInfo(grant.src, ())
        try:
            stop = await self.peer.new_stream(grant.dst, STOP_PROTOCOL_ID)
        except PeersError:
            return None
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_SECONDS):
                await stop.write(
                    encode_delimited(
                        encode_stop_message(
                            StopMessage(type=StopType.CONNECT, peer=src_info, limit=grant.limit)
                        )
                    )
                )
                answer = decode_stop_message(await read_delimited(stop, MAX_CIRCUIT_MESSAGE_BYTES))
        except (TimeoutError, PeersError) as e:
            logger.info("stop CONNECT to %s failed: %r", grant.dst, e)
            stop.reset()
            return None
        if answer.type != StopType.STATUS or answer.status != Status.OK:
            stop.reset()
            return None
        return stop

    async def _splice(self, grant: CircuitGrant, src: Stream, dst: Stream) -> None:
        """Copy both ways until both ends close; reset both at a limit or a failure."""

        async def copy(a: Stream, b: Stream, *, from_src: bool) -> None:
            while data := await a.read(SPLICE_READ_BYTES):
                allowed = self.resources.allow_data(
                    grant.circuit_id, from_src=from_src, num_bytes=len(data)
                )
                if allowed:
                    await b.write(data[:allowed])
                if allowed < len(data):
                    raise _LimitReached
            await b.close()

        try:
            async with asyncio.timeout_at(_loop_deadline(grant.deadline_unix_seconds)):
                async with asyncio.TaskGroup() as group:
                    group.create_task(copy(src, dst, from_src=True))
                    group.create_task(copy(dst, src, from_src=False))
        except* (_LimitReached, TimeoutError, ConnectionClosed, PeersError):
            logger.info("circuit %s -> %s ended at its limit or broke", grant.src, grant.dst)
            src.reset()
            dst.reset()


class _LimitReached(Exception):
    """A circuit used up its data limit in one direction."""


def _loop_deadline(deadline_unix_seconds: float | None) -> float | None:
    if deadline_unix_seconds is None:
        return None
    return asyncio.get_running_loop().time() + (deadline_unix_seconds - time.time())
