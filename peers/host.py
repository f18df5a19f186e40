"""The Peer: listens, dials, keeps one connection per remote peer, and routes streams.

A :class:`Peer` is entered with ``async with`` and owns every task it starts: the
listeners, each connection's reader, each inbound stream's handler
(CONTRIBUTING.md, "Every task has an owner").
Inbound streams negotiate their protocol with multistream-select and go to the handler
registered for it; ``identify`` and ``ping`` are built in.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections import defaultdict
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from multiaddr import Multiaddr

from peers import limits, rpc
from peers.address_book import AddressBook, expand_wildcard
from peers.addresses import (
    circuit_address,
    is_circuit,
    parse_multiaddr,
    split_peer_id,
    tcp_multiaddr,
    tcp_target,
    with_peer_id,
)
from peers.admission import Admitted, InboundAdmission, Refused
from peers.config import PeerConfig, PeerStatistics
from peers.connection import Connection, Stream
from peers.dial_filter import LocalNetworks, dialable, refusal
from peers.errors import (
    AddressError,
    ConnectionClosed,
    DialError,
    HandshakeError,
    LimitExceeded,
    PeerIDMismatch,
    PeerNotAllowed,
    PeersError,
    ProtocolNotSupported,
    RemoteProtocolError,
    raisable_copy,
)
from peers.identity import KeyPair, PeerID
from peers.multistream import MultistreamDialer, MultistreamListener
from peers.noise import NOISE_CIPHERS, NoiseStaticKey
from peers.printable import printable
from peers.rpc import CallContext
from peers.serialization import MAX_FRAME_BYTES, MAX_VALUE_ITEMS
from peers.service import Service
from peers.socket_reader import SocketReader, can_reuse_port, open_connection, start_server
from peers.stream_socket import stream_as_socket
from peers.traffic import TrafficBook
from peers.upgrade import UpgradedConnection, upgrade
from peers.yamux import HEADER_BYTES as YAMUX_HEADER_BYTES
from peers.yamux import YamuxSession

if TYPE_CHECKING:
    from peers.identify import IdentifyInfo

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Longest wait, after a relayed dial, for the other side to begin a hole punch: a
#: relayed handshake's time bounds a round trip, and a second covers the slowest links.
PUNCH_START_WAIT_SECONDS = 1.0
#: A socket reader's buffer limit during the handshake (afterwards it buffers nothing).
STREAM_LIMIT_BYTES = 2**20

StreamHandler = Callable[[Stream], Awaitable[None]]

#: Seconds between two reads of this machine's interfaces for the dial filter: a laptop
#: that changes networks is right again within this, and a DHT that learns hundreds of
#: addresses a second reads them rarely.
LOCAL_NETWORKS_SECONDS = 30.0
#: A peer we could not dial a further connection to is not tried again for this long.
POOL_RETRY_SECONDS = 300.0
#: Peers whose failed further dial is remembered (the oldest forgotten first).
MAX_POOL_FAILURES_KEPT = 1024
#: A further connection the peer closes this soon after we dialed it, having sent no
#: stream data, was refused (its own per-peer cap): remembered as a failed dial.
POOL_REFUSED_SECONDS = 10.0


@dataclass
class _Counters:
    inbound_refused: int = 0
    handshake_failures: int = 0
    not_allowed: int = 0
    streams_refused: int = 0
    idle_closed: int = 0
    addresses_refused: int = 0


class Peer(Service):
    """A libp2p-compatible peer. Use ``async with Peer(config) as peer``."""

    def __init__(self, config: PeerConfig | None = None) -> None:
        super().__init__()
        self.config = config or PeerConfig()
        self.identity = self.config.identity or KeyPair.generate()
        self._noise_ciphers = tuple(NOISE_CIPHERS[name] for name in self.config.noise_ciphers)
        #: One static key for all our handshakes, signed once (see NoiseStaticKey).
        self._noise_static = NoiseStaticKey.create(self.identity)
        self.peer_id = self.identity.peer_id
        self._handlers: dict[str, StreamHandler] = {}
        #: Bytes by protocol and unary call latencies (``statistics().traffic``).
        self.traffic = TrafficBook()
        self._connections: dict[PeerID, list[Connection]] = defaultdict(list)
        self._dialing: dict[PeerID, asyncio.Future[Connection]] = {}
        #: Further connections being dialed (``new_pooled_stream``: one per peer at a
        #: time), and when a further dial to each peer last failed (monotonic).
        self._pool_dialing: dict[PeerID, asyncio.Future[None]] = {}
        self._pool_failed: dict[PeerID, float] = {}
        self._pool_dialed_at: dict[Connection, float] = {}  # further ones we dialed, live
        self._admission = InboundAdmission(
            max_connections_per_ip=self.config.max_connections_per_ip,
            max_connections_per_subnet=self.config.max_connections_per_subnet,
            handshake_rate=self.config.handshake_rate_per_ip,
            handshake_burst=self.config.handshake_burst_per_ip,
        )
        self._num_connections = 0
        self._servers: list[asyncio.Server] = []
        self._listen_addrs: list[Multiaddr] = []
        self._full_listen_addrs: list[Multiaddr] | None = None
        self._address_book = AddressBook()
        self._local: tuple[float, LocalNetworks] | None = None
        self._counters = _Counters()
        self._closing = False
        self._reuse_port = self.config.reuse_port and can_reuse_port()
        #: (host, port) of our TCP listeners, by address family: where dials leave from.
        self._bound: dict[int, tuple[str, int]] = {}
        # Imported here: identify and ping register themselves through the public API.
        from peers.identify import install_identify
        from peers.ping import install_ping

        install_identify(self)
        install_ping(self)
        from peers.nat import ForcedReachability, NatManager

        #: Reachability, AutoNAT, relays: see :mod:`peers.nat`.
        self.nat = NatManager(
            self,
            forced=ForcedReachability(self.config.reachability),
            relay_hop=self.config.relay_service,
            use_relays=self.config.use_relays,
            relay_limits=self.config.relay_limits,
            hole_punching=self.config.hole_punching,
        )

    # --- lifecycle ---------------------------------------------------------------

    async def _start(self) -> None:
        for text in self.config.listen_addrs:
            await self._listen(parse_multiaddr(text))
        if self._bound or self.config.reachability != "auto":
            # Only a peer others might reach from elsewhere needs to find out whether
            # they can; one on loopback alone is a local test or tool.
            self._spawn(self.nat.run())

    async def _stop(self) -> None:
        self._closing = True
        for server in self._servers:
            server.close()
        for conns in list(self._connections.values()):
            for conn in conns:
                conn.close()
        # Then the skeleton cancels our tasks: handshakes in progress, connection readers.

    async def _listen(self, addr: Multiaddr) -> None:
        target = tcp_target(addr)
        try:
            server = await start_server(
                self._on_tcp_connection,
                target.host,
                target.port,
                limit=STREAM_LIMIT_BYTES,
                reuse_port=self._reuse_port,
                swarm_key=self.config.swarm_key,
            )
        except OSError as e:
            raise AddressError(f"cannot listen on {addr}: {e.strerror or e}") from e
        self._servers.append(server)
        for sock in server.sockets:
            host, port = sock.getsockname()[:2]
            self._listen_addrs.append(tcp_multiaddr(host, port))
            if not ipaddress.ip_address(host).is_loopback:
                self._bound.setdefault(sock.family, (host, port))
        self._full_listen_addrs = None

    def bound_addrs(self) -> list[Multiaddr]:
        """The addresses our listeners are bound to, wildcards made concrete (without
        ``/p2p``): what this machine listens on, not what others can dial."""
        return [concrete for a in self._listen_addrs for concrete in expand_wildcard(a)]

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """The addresses others can dial us at directly, each ending in ``/p2p/OUR_ID``:
        ``announce_addrs`` if configured; none once AutoNAT found us private (behind
        NAT: we are reached through relays, :attr:`circuit_addrs`); else the addresses
        dial-backs confirmed, then our bound addresses (loopback ones only when we have
        nothing else: a remote machine could not use them)."""
        if self._full_listen_addrs is None:
            self._full_listen_addrs = [with_peer_id(a, self.peer_id) for a in self._direct_addrs()]
        return list(self._full_listen_addrs)

    def _direct_addrs(self) -> list[Multiaddr]:
        from peers.reachability import Reachability, is_public_candidate

        if self.config.announce_addrs:
            return [parse_multiaddr(a) for a in self.config.announce_addrs]
        reachability = self.nat.reachability
        if reachability == Reachability.PRIVATE:
            return []
        bound = self.bound_addrs()
        public = [a for a in bound if is_public_candidate(a)]
        if reachability == Reachability.PUBLIC:
            return list(dict.fromkeys([*self.nat.confirmed_addrs(), *(public or bound)]))
        return public or bound

    @property
    def circuit_addrs(self) -> list[Multiaddr]:
        """Our addresses through the relays we hold reservations on (``/p2p-circuit``)."""
        return [with_peer_id(a, self.peer_id) for a in self.nat.circuit_addrs()]

    @property
    def advertised_addrs(self) -> list[Multiaddr]:
        """Every address others may reach us at: direct ones first, then relayed ones."""
        return [*self.listen_addrs, *self.circuit_addrs]

    def addresses_changed(self) -> None:
        """Our reachability or relays changed: recompute what we announce."""
        self._full_listen_addrs = None
        self.nat.notify_changed()

    def is_relay_allowed(self) -> bool:
        """Whether we serve as a circuit relay hop now (configured, and not private)."""
        from peers.reachability import Reachability

        return self.config.relay_service and self.nat.reachability != Reachability.PRIVATE

    @property
    def protocols(self) -> list[str]:
        return sorted(self._handlers)

    # --- handlers ----------------------------------------------------------------

    def set_stream_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve ``protocol``: ``handler(stream)`` runs for each inbound stream of it.

        The stream is reset if the handler raises; the handler's task is cancelled when
        the remote resets the stream's connection or the peer closes.
        """
        if protocol in self._handlers:
            raise ValueError(f"a handler for {protocol} is already registered")
        self._handlers[protocol] = handler

    def remove_stream_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)

    # --- inbound -----------------------------------------------------------------

    async def _on_tcp_connection(self, reader: SocketReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername") or ("0.0.0.0", 0)
        ip = str(peername[0])
        now = time.monotonic()
        admitted = Refused("closing") if self._closing else self._admission.admit(ip, now)
        # Idle connections make room only for a newcomer its source checks let in.
        if isinstance(admitted, Admitted) and (
            self._num_connections >= self.config.max_connections and not self._close_idle(now)
        ):
            self._admission.release(admitted)
            admitted = Refused("connection limit reached")
        if isinstance(admitted, Refused):
            self._counters.inbound_refused += 1
            logger.info("refusing a connection from %s: %s", ip, admitted.reason)
            writer.close()
            return
        # The server's own task only admits; the connection's life belongs to our group.
        self._spawn(self._serve_inbound_tcp(reader, writer, admitted, ip, int(peername[1])))

    def _close_idle(self, now: float) -> int:
        """All connections are taken: close the inbound ones idle longest (no stream for
        ``idle_connection_seconds``; none carrying a relay reservation of ours), at most
        ``MAX_IDLE_CLOSED_PER_ACCEPT``. Returns how many: the newcomer takes the place of
        one (they are counted until their tasks end, a moment later)."""
        relay = self.nat.relay_service
        idle: list[tuple[float, Connection]] = []
        for conn in (c for cs in self._connections.values() for c in cs):
            seconds = conn.idle_seconds(now)
            if (
                seconds is not None
                and seconds >= self.config.idle_connection_seconds
                and not conn.outbound
                and not conn.relayed
                and not conn.is_closed
                and not (relay is not None and relay.holds_reservation(conn))
            ):
                idle.append((seconds, conn))
        idle.sort(key=lambda pair: pair[0], reverse=True)
        closing = [conn for _, conn in idle[: limits.MAX_IDLE_CLOSED_PER_ACCEPT]]
        for conn in closing:
            logger.info(
                "closing a connection from %s: idle, and a newcomer needs room", conn.remote_peer_id
            )
            conn.close()
        self._counters.idle_closed += len(closing)
        return len(closing)

    async def _serve_inbound_tcp(
        self,
        reader: SocketReader,
        writer: asyncio.StreamWriter,
        admitted: Admitted,
        ip: str,
        port: int,
    ) -> None:
        try:
            await self._accept(reader, writer, tcp_multiaddr(ip, port))
        finally:
            writer.close()
            self._admission.release(admitted)

    async def _accept(
        self, reader: SocketReader, writer: asyncio.StreamWriter, remote: Multiaddr
    ) -> None:
        self._num_connections += 1
        try:
            try:
                async with asyncio.timeout(self.config.handshake_timeout):
                    upgraded = await self._upgrade(reader, writer, outbound=False)
            except (TimeoutError, PeersError, ConnectionError, OSError) as e:
                self._counters.handshake_failures += 1
                logger.info("inbound handshake from %s failed: %r", remote, e)
                writer.close()
                return
            conn = self._make_connection(reader, writer, upgraded, remote, outbound=False)
            if not self._register(conn):
                writer.close()
                return
            await self._run_connection(conn)
        finally:
            self._num_connections -= 1

    async def _upgrade(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        outbound: bool,
        expected: PeerID | None = None,
    ) -> UpgradedConnection:
        """The whole connection upgrade with our identity and ciphers (the caller bounds
        it); :class:`PeerNotAllowed` for a remote outside the allow-list."""
        try:
            upgraded = await upgrade(
                reader,
                writer,
                identity=self.identity,
                outbound=outbound,
                expected_peer_id=expected,
                ciphers=self._noise_ciphers,
                static=self._noise_static,
            )
        except HandshakeError as e:
            if self.config.swarm_key is None or isinstance(e, PeerIDMismatch):
                raise
            raise HandshakeError(
                f"{e} (we use a swarm key: a remote without the same key cannot complete"
                " a handshake with us)"
            ) from e
        self._check_allowed(upgraded.remote_peer_id)
        return upgraded

    def _check_allowed(self, peer_id: PeerID) -> None:
        allowed = self.config.allowed_peers
        if allowed is not None and peer_id not in allowed and peer_id != self.peer_id:
            self._counters.not_allowed += 1
            raise PeerNotAllowed(f"{peer_id} is not in this peer's allow-list")

    def _make_connection(
        self,
        reader: SocketReader,
        writer: asyncio.StreamWriter,
        upgraded: UpgradedConnection,
        remote: Multiaddr,
        *,
        outbound: bool,
    ) -> Connection:
        return Connection(
            reader=reader,
            writer=writer,
            transport=upgraded.transport,
            security_protocol=upgraded.cipher.protocol_id,
            session=YamuxSession(
                is_client=outbound,
                max_streams=self.config.max_streams_per_connection,
                # One Data frame fills one Noise frame: 64 KiB with /noise, 2 MiB with ours.
                max_frame_payload_bytes=upgraded.transport.max_plaintext - YAMUX_HEADER_BYTES,
            ),
            remote_peer_id=upgraded.remote_peer_id,
            remote_public_key=upgraded.remote_public_key,
            remote_address=remote,
            outbound=outbound,
            initial_plaintext=upgraded.leftover_plaintext,
            on_inbound_stream=self._on_inbound_stream,
            traffic=self.traffic,
            keepalive=(self.config.keepalive_interval, self.config.keepalive_timeout),
        )

    def _register(self, conn: Connection) -> bool:
        live = [c for c in self._connections[conn.remote_peer_id] if not c.is_closed]
        if len(live) >= self.config.max_connections_per_peer:
            self._counters.inbound_refused += 1
            logger.info("refusing another connection from %s: per-peer limit", conn.remote_peer_id)
            return False
        live.append(conn)
        self._connections[conn.remote_peer_id] = live
        self.nat.on_connection(conn)
        return True

    async def _run_connection(self, conn: Connection) -> None:
        try:
            await conn.run()
        finally:
            dialed_at = self._pool_dialed_at.pop(conn, None)
            if (  # refused by the peer, which still keeps our first connection
                dialed_at is not None
                and time.monotonic() < dialed_at + POOL_REFUSED_SECONDS
                and conn.session_statistics().num_data_bytes_received == 0
                and not conn.closed_by_us
                and any(c is not conn for c in self.direct_connections(conn.remote_peer_id))
            ):
                self._pool_failure(conn.remote_peer_id)
            conns = self._connections.get(conn.remote_peer_id)
            if conns is not None and conn in conns:
                conns.remove(conn)
                if not conns:
                    del self._connections[conn.remote_peer_id]
            self.nat.notify_changed()

    async def _on_inbound_stream(self, stream: Stream) -> None:
        listener = MultistreamListener(self._handlers.keys())
        try:
            async with asyncio.timeout(self.config.stream_negotiation_timeout):
                # If the proposal came with the stream's opening (lazy dialers send them
                # together), our header goes out with our answer: one frame, not two.
                # Otherwise it goes now, for dialers that wait for it before proposing.
                header = listener.initial_bytes()
                if not stream.has_buffered_data:
                    await stream.write(header)
                    header = b""
                while listener.selected is None:
                    if listener.has_pending_input:  # more after a refusal: parse it first
                        data = b""
                    else:
                        data = await stream.read(1024)
                        if not data:
                            return
                    reply = listener.receive_data(data)
                    if reply or header:  # a header-only opening still gets our header
                        answer, header = header + reply, b""
                        if listener.selected is not None and (
                            listener.leftover or stream.has_buffered_data
                        ):
                            # The dialer sent its request without waiting for our answer
                            # (lazy): the answer goes with the handler's first bytes.
                            stream.defer_write(answer)
                        else:
                            await stream.write(answer)
        except (TimeoutError, RemoteProtocolError) as e:
            self._counters.streams_refused += 1
            logger.info("stream from %s failed to negotiate: %r", stream.remote_peer_id, e)
            stream.reset()
            return
        except ConnectionClosed:
            # The dialer reset the stream, as libp2p dialers do after our "na": no
            # handler ran, so nothing failed (and a remote must not flood our log).
            return
        stream.protocol = listener.selected
        if listener.leftover:
            stream.unread(listener.leftover)
        # What came with the negotiation (a pipelined request) counts for the protocol.
        pending = len(listener.leftover) + stream.buffered_bytes
        self.traffic.received(listener.selected, pending)
        handler = self._handlers.get(listener.selected)
        if handler is None:  # removed while negotiating
            stream.reset()
            return
        await handler(stream)

    # --- outbound ----------------------------------------------------------------

    def add_addresses(
        self, peer_id: PeerID, addrs: Iterable[Multiaddr | str], *, learned: bool = True
    ) -> None:
        """Remember where ``peer_id`` can be dialed. Addresses ``learned`` from peers
        are kept only if sensible to dial (:mod:`peers.dial_filter`: no loopback, LAN or
        DNS addresses but where we share that network); ``learned=False`` for addresses
        the user gave, kept as given and never evicted by learned ones."""
        parsed = [split_peer_id(parse_multiaddr(a))[0] for a in addrs]
        if learned:
            local = self.local_networks()
            kept = dialable(parsed, local)
            refused = [a for a in parsed if a not in kept]
            if refused:
                self._counters.addresses_refused += len(refused)
                logger.debug(
                    "not dialing %d of %s's addresses: %s",
                    len(refused),
                    peer_id,
                    printable("; ".join(f"{a}: {refusal(a, local)}" for a in refused)),
                )
            parsed = kept
        self._address_book.add(peer_id, parsed, pin=not learned)

    def known_addresses(self, peer_id: PeerID) -> list[Multiaddr]:
        return self._address_book.get(peer_id)

    def local_networks(self) -> LocalNetworks:
        """Where we are (for :mod:`peers.dial_filter`), read again every
        :data:`LOCAL_NETWORKS_SECONDS`: a laptop changes networks."""
        now = time.monotonic()
        if self._local is None or now - self._local[0] > LOCAL_NETWORKS_SECONDS:
            self._local = (now, LocalNetworks.of_this_machine(self.bound_addrs()))
        return self._local[1]

    def connection_to(self, peer_id: PeerID) -> Connection | None:
        """A live connection to ``peer_id``, a direct one if there is one."""
        relayed: Connection | None = None
        for conn in self._connections.get(peer_id, ()):
            if not conn.is_closed:
                if not conn.relayed:
                    return conn
                relayed = relayed or conn
        return relayed

    def connected_peers(self) -> list[PeerID]:
        return [
            pid for pid, conns in self._connections.items() if any(not c.is_closed for c in conns)
        ]

    async def connect(self, addr: Multiaddr | str) -> PeerID:
        """Dial ``addr`` (which may end in ``/p2p/ID``) and return the remote's PeerID.

        Raises :class:`PeerIDMismatch` if the address names a PeerID and the remote is
        someone else, :class:`DialError` if it cannot be reached, :class:`HandshakeError`
        if the upgrade fails. Reuses an existing connection to a named PeerID.
        """
        maddr = parse_multiaddr(addr)
        transport, expected = split_peer_id(maddr)
        if expected is not None:
            self.add_addresses(expected, [transport], learned=False)
            await self._get_connection(expected)
            return expected
        conn = await self._dial_address(transport, None)
        return conn.remote_peer_id

    async def _get_connection(self, peer_id: PeerID) -> Connection:
        if peer_id == self.peer_id:
            raise DialError("cannot dial ourselves")
        self._check_allowed(peer_id)  # not even a TCP connection to a stranger
        while True:
            conn = self.connection_to(peer_id)
            if conn is not None:
                return conn
            pending = self._dialing.get(peer_id)
            if pending is None:
                break
            # Someone is dialing this peer already: share the result. If their dial was
            # cancelled (their caller gave up), loop and dial ourselves.
            await asyncio.wait([pending])
            if not pending.cancelled():
                error = pending.exception()
                if error is None:
                    return pending.result()
                raise raisable_copy(error) from None  # the future keeps the original
        future: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._dialing[peer_id] = future
        try:
            conn = await self._dial_known(peer_id)
            future.set_result(conn)
            return conn
        except Exception as e:
            future.set_exception(e)
            future.exception()  # mark retrieved: there may be no other waiter
            raise
        finally:
            del self._dialing[peer_id]
            if not future.done():
                future.cancel()
            del future  # the raised error's frames must not keep the future (and it)

    async def _dial_known(self, peer_id: PeerID) -> Connection:
        # Direct addresses first: a relay is the way of last resort.
        addrs = sorted(self.known_addresses(peer_id), key=is_circuit)
        if not addrs:
            raise DialError(f"no known address for {peer_id}")
        errors: list[str] = []
        mismatches: list[PeerIDMismatch] = []
        for addr in addrs:
            try:
                return await self._dial_address(addr, peer_id)
            except PeerIDMismatch as e:
                mismatches.append(e)
                # Someone else answers there: most often another volunteer's LAN with
                # the same private address. The address is wrong for this peer, not an
                # error of the dial: forget it quietly and try the next one.
                logger.debug("%s leads to another peer than %s: %s", addr, peer_id, e)
                self._address_book.remove(peer_id, addr)
                errors.append(f"{addr}: another peer answers there")
            except (DialError, HandshakeError) as e:
                errors.append(f"{addr}: {e}")
        if len(mismatches) == len(addrs):  # every address we had leads to someone else
            raise mismatches[0]
        raise DialError(f"could not reach {peer_id}: " + "; ".join(errors))

    async def dial_direct(
        self, addr: Multiaddr, expected: PeerID, *, as_initiator: bool, timeout: float
    ) -> Connection:
        """Open a new direct TCP connection to ``addr`` from our listen port, taking the
        given role in the upgrade whoever's SYN went first: a DCUtR hole punch, where
        both sides dial at once (a TCP simultaneous open) and the spec says who is the
        client. Raises DialError, HandshakeError or PeerIDMismatch; TimeoutError after
        ``timeout``."""
        async with asyncio.timeout(timeout):
            return await self._dial_address(addr, expected, as_initiator=as_initiator)

    async def _dial_address(
        self, addr: Multiaddr, expected: PeerID | None, *, as_initiator: bool = True
    ) -> Connection:
        if self._closing:
            raise DialError("peer is closing")
        if is_circuit(addr):
            return await self._dial_circuit(addr, expected)
        target = tcp_target(addr)
        self._num_connections += 1
        registered = False
        try:
            try:
                async with asyncio.timeout(self.config.dial_timeout):
                    reader, writer = await open_connection(
                        target.host,
                        target.port,
                        limit=STREAM_LIMIT_BYTES,
                        local_addr=self._local_addr_for(target.host),
                        swarm_key=self.config.swarm_key,
                    )
            except TimeoutError as e:
                raise DialError(f"timed out connecting to {addr}") from e
            except (ConnectionError, OSError) as e:
                raise DialError(f"cannot connect to {addr}: {e.strerror or e}") from e
            upgraded = None
            try:
                async with asyncio.timeout(self.config.dial_timeout):
                    upgraded = await self._upgrade(
                        reader, writer, outbound=as_initiator, expected=expected
                    )
            except TimeoutError as e:
                raise HandshakeError(f"{addr} did not complete the handshake in time") from e
            except (ConnectionError, OSError) as e:
                raise HandshakeError(
                    f"{addr} dropped the connection during the handshake: {e}"
                ) from e
            finally:
                if upgraded is None:
                    writer.close()
            conn = self._make_connection(reader, writer, upgraded, addr, outbound=as_initiator)
            if not self._register(conn):
                writer.close()
                raise LimitExceeded(f"too many connections to {conn.remote_peer_id}")
            self._address_book.add(conn.remote_peer_id, [addr])  # it worked: keep it
            assert self._group is not None
            registered = True
            self._spawn(self._run_outbound(conn))
            return conn
        finally:
            if not registered:
                self._num_connections -= 1

    async def check_dialable(self, addr: Multiaddr, peer_id: PeerID, *, timeout: float) -> bool:
        """Whether a new connection to ``addr`` reaches ``peer_id`` within ``timeout``
        (TCP and the whole upgrade, from an ephemeral port; closed at once, never
        registered): an AutoNAT dial-back."""
        try:
            target = tcp_target(addr)
        except AddressError:
            return False
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await open_connection(
                    target.host,
                    target.port,
                    limit=STREAM_LIMIT_BYTES,
                    swarm_key=self.config.swarm_key,
                )
                await self._upgrade(reader, writer, outbound=True, expected=peer_id)
            return True
        except (TimeoutError, PeersError, ConnectionError, OSError):
            return False
        finally:
            if writer is not None:
                writer.close()

    async def _dial_circuit(self, addr: Multiaddr, expected: PeerID | None) -> Connection:
        """Reach a peer through a relay (circuit relay v2): a hop CONNECT on a stream to
        the relay, then a whole connection upgrade inside that stream."""
        from peers.relay.client import open_circuit

        circuit = circuit_address(addr)
        destination = circuit.destination or expected
        if destination is None:
            raise DialError(f"a relayed address must name the peer to reach: {addr}")
        if expected is not None and destination != expected:
            raise PeerIDMismatch(f"{addr} leads to {destination}, not {expected}")
        if circuit.relay == self.peer_id or destination == self.peer_id:
            raise DialError(f"cannot relay to or through ourselves: {addr}")
        async with asyncio.timeout(self.config.dial_timeout):
            try:
                stream = await open_circuit(self, circuit.relay_addr, destination)
            except TimeoutError as e:
                raise DialError(f"the relay in {addr} did not connect us in time") from e
            ready: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
            self._spawn(
                self._serve_relayed(
                    stream, outbound=True, expected=destination, remote=addr, ready=ready
                )
            )
            started = asyncio.get_running_loop().time()
            try:
                conn = await ready
            finally:
                if not ready.done():
                    ready.cancel()
        self._address_book.add(destination, [addr])  # it worked: keep it
        # The peer we reached starts a hole punch at once (DCUtR: the side that accepted
        # the relayed connection does). Its first message comes about a round trip
        # after the connection is up, which took at least one and a half.
        elapsed = asyncio.get_running_loop().time() - started
        await self.nat.wait_for_direct(
            destination, start_within=min(PUNCH_START_WAIT_SECONDS, max(0.2, elapsed))
        )
        return self.connection_to(destination) or conn

    async def accept_relayed(
        self, stream: Stream, remote: Multiaddr, *, expected: PeerID | None = None
    ) -> None:
        """Run the connection a relay opened to us inside ``stream`` (the stop side of
        circuit relay v2, after its STATUS OK) until it closes; the handshake fails
        unless the remote is ``expected`` (the peer the relay said is connecting)."""
        await self._serve_relayed(
            stream, outbound=False, expected=expected, remote=remote, ready=None
        )

    async def _serve_relayed(
        self,
        stream: Stream,
        *,
        outbound: bool,
        expected: PeerID | None,
        remote: Multiaddr,
        ready: asyncio.Future[Connection] | None,
    ) -> None:
        if self._closing or self._num_connections >= self.config.max_connections:
            stream.reset()
            if ready is not None and not ready.done():
                ready.set_exception(DialError("connection limit reached"))
            return
        reader, writer, bridge = await stream_as_socket(
            stream, limit=STREAM_LIMIT_BYTES, swarm_key=self.config.swarm_key
        )
        self._num_connections += 1
        try:
            async with asyncio.TaskGroup() as group:
                bridge_task = group.create_task(bridge)
                try:
                    try:
                        async with asyncio.timeout(self.config.handshake_timeout):
                            upgraded = await self._upgrade(
                                reader, writer, outbound=outbound, expected=expected
                            )
                    except TimeoutError as e:
                        raise HandshakeError(f"{remote}: no relayed handshake in time") from e
                    except (ConnectionError, OSError) as e:
                        raise HandshakeError(f"{remote}: relayed handshake broke: {e}") from e
                    conn = self._make_connection(
                        reader, writer, upgraded, remote, outbound=outbound
                    )
                    conn.relayed = True
                    if not self._register(conn):
                        raise LimitExceeded(f"too many connections to {conn.remote_peer_id}")
                except PeersError as e:
                    self._counters.handshake_failures += 1
                    writer.close()
                    bridge_task.cancel()
                    if ready is None:
                        logger.info("relayed connection from %s failed: %r", remote, e)
                    elif not ready.done():
                        ready.set_exception(e)
                    return
                if ready is not None:
                    if ready.done():  # the dialer gave up meanwhile
                        conn.close()
                    else:
                        ready.set_result(conn)
                await self._run_connection(conn)
        finally:
            self._num_connections -= 1

    def _local_addr_for(self, host: str) -> tuple[str, int] | None:
        """Where a dial to ``host`` leaves from: our listen port (reused), so NATs map it
        as they map our listener and hole punching can work; ``None`` (an ephemeral
        port) for loopback, which never crosses a NAT, or when we do not listen."""
        if not self._reuse_port:
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:  # a DNS name: assume it is not loopback
            family = socket.AF_INET
        else:
            if ip.is_loopback:
                return None
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        return self._bound.get(family)

    async def _run_outbound(self, conn: Connection) -> None:
        try:
            await self._run_connection(conn)
        finally:
            self._num_connections -= 1

    async def new_stream(
        self, peer: PeerID | Multiaddr | str, protocols: str | list[str]
    ) -> Stream:
        """Open a stream to ``peer`` (dialing if needed) speaking one of ``protocols``.

        With one protocol the proposal is sent and the stream returned at once (lazy
        negotiation, one round trip saved): a refusal then surfaces as
        :class:`ProtocolNotSupported` from the first ``read``. With several, the
        negotiation completes here and raises :class:`ProtocolNotSupported` if the remote
        serves none of them. :class:`DialError`/:class:`HandshakeError` if it cannot be
        reached.
        """
        if isinstance(peer, PeerID):
            peer_id = peer
        else:
            peer_id = await self.connect(peer)
        conn = await self._get_connection(peer_id)
        return await self._open_stream_on(conn, protocols)

    def round_trip(self, peer_id: PeerID) -> float | None:
        """The round-trip time of our direct connection to ``peer_id`` as its TCP
        measures it (seconds), ``None`` with no direct connection or no figure yet."""
        conn = self.connection_to(peer_id)
        return conn.round_trip_seconds() if conn is not None else None

    async def new_pooled_stream(self, peer_id: PeerID, protocol: str, index: int) -> Stream:
        """A stream to ``peer_id`` speaking ``protocol`` on our ``index``-th direct
        connection to it (0 is the one :meth:`new_stream` uses), dialing another one
        when there are fewer: bulk transfers that several TCP connections carry faster
        than one (a window caps each on a long fat pipe). Raises :class:`DialError` when
        no further connection can be made (the peer is reached only through a relay or a
        hole punch, or refuses more); a peer that could not be dialed again is not tried
        again for ``POOL_RETRY_SECONDS``. :class:`LimitExceeded` where ``index`` is past
        what ``PeerConfig.max_connections_per_peer`` lets us keep."""
        conn = await self._pooled_connection(peer_id, index)
        return await self._open_stream_on(conn, protocol)

    async def connect_pooled(self, peer_id: PeerID, index: int) -> None:
        """Make sure our ``index``-th direct connection to ``peer_id`` is up, dialing it
        if not, so that a :meth:`new_pooled_stream` on it later opens at once; raises as
        that does. (A stream opened early and left silent could meet the remote's
        deadline for its first bytes; a connection waits.)"""
        await self._pooled_connection(peer_id, index)

    async def _pooled_connection(self, peer_id: PeerID, index: int) -> Connection:
        if index < 1:
            raise ValueError(f"connection index {index} is not a further connection")
        if index >= self.config.max_connections_per_peer:
            raise LimitExceeded(
                f"connection {index} to {peer_id}: this peer keeps at most "
                f"{self.config.max_connections_per_peer} to one other (max_connections_per_peer)"
            )
        first = await self._get_connection(peer_id)
        if first.relayed:
            raise DialError(f"{peer_id} is reached through a relay: no connection to add")
        while True:
            pooled = self.direct_connections(peer_id)
            if first in pooled:  # the one new_stream uses comes first
                pooled.remove(first)
                pooled.insert(0, first)
            if len(pooled) > index:
                conn = pooled[index]
                break
            pending = self._pool_dialing.get(peer_id)
            if pending is not None:  # one dial at a time per peer: then count again
                await asyncio.wait([pending])
                continue
            dialed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._pool_dialing[peer_id] = dialed
            try:
                conn = await self._dial_another(peer_id, first)
            finally:
                del self._pool_dialing[peer_id]
                dialed.set_result(None)
            break
        return conn

    def direct_connections(self, peer_id: PeerID) -> list[Connection]:
        """Our live direct (not relayed) connections to ``peer_id``, oldest first."""
        return [c for c in self._connections.get(peer_id, ()) if not c.is_closed and not c.relayed]

    async def _dial_another(self, peer_id: PeerID, first: Connection) -> Connection:
        failed_at = self._pool_failed.get(peer_id)
        now = time.monotonic()
        if failed_at is not None and now < failed_at + POOL_RETRY_SECONDS:
            raise DialError(f"{peer_id} could not be dialed again lately")
        live = [c for c in self._connections.get(peer_id, ()) if not c.is_closed]
        if len(live) >= self.config.max_connections_per_peer:  # relayed ones count too
            raise LimitExceeded(f"{len(live)} connections to {peer_id} already: no room for more")
        # Where our first connection reached it, else where it listens; a punched
        # connection's address is one its NAT opened for that connection alone.
        addrs = [first.remote_address] if first.outbound else []
        addrs += [a for a in self.known_addresses(peer_id) if not is_circuit(a) and a not in addrs]
        errors: list[str] = []
        for addr in addrs:
            try:
                conn = await self._dial_address(addr, peer_id)
            except LimitExceeded:
                raise  # ours: full meanwhile, not a peer that cannot be dialed
            except PeersError as e:  # DialError, HandshakeError, PeerIDMismatch, AddressError
                errors.append(f"{addr}: {e}")
            else:  # a peer that closes it at once is noticed in _run_connection
                self._pool_dialed_at[conn] = time.monotonic()
                return conn
        self._pool_failure(peer_id)
        tried = "; ".join(errors) or "no address to dial"
        raise DialError(f"no further connection to {peer_id}: {tried}")

    def _pool_failure(self, peer_id: PeerID) -> None:
        """``peer_id`` takes no further connection: not dialed again for a while."""
        self._pool_failed.pop(peer_id, None)  # (re-inserted last: the oldest go first)
        self._pool_failed[peer_id] = time.monotonic()
        while len(self._pool_failed) > MAX_POOL_FAILURES_KEPT:
            del self._pool_failed[next(iter(self._pool_failed))]

    async def _open_stream_on(self, conn: Connection, protocols: str | list[str]) -> Stream:
        proposals = [protocols] if isinstance(protocols, str) else list(protocols)
        stream = conn.open_stream_raw()
        dialer = MultistreamDialer(proposals)
        if len(proposals) == 1:
            stream.protocol = proposals[0]
            stream.begin_lazy_negotiation(dialer)
            return stream
        negotiated = False
        try:
            async with asyncio.timeout(self.config.stream_negotiation_timeout):
                await stream.write(dialer.initial_bytes())
                while dialer.selected is None:
                    data = await stream.read(1024)
                    if not data:
                        raise ProtocolNotSupported("remote closed the stream while negotiating")
                    reply = dialer.receive_data(data)
                    if reply:
                        await stream.write(reply)
            negotiated = True
        finally:
            if not negotiated:
                stream.reset()
        stream.protocol = dialer.selected
        if dialer.leftover:
            stream.unread(dialer.leftover)
        return stream

    def disconnect(self, peer_id: PeerID) -> None:
        for conn in list(self._connections.get(peer_id, ())):
            conn.close()

    def statistics(self) -> PeerStatistics:
        conns = [c for cs in self._connections.values() for c in cs]
        return PeerStatistics(
            num_connections=len(conns),
            num_streams=sum(c.num_streams for c in conns),
            num_inbound_connections_refused=self._counters.inbound_refused,
            num_handshake_failures=self._counters.handshake_failures,
            num_not_allowed=self._counters.not_allowed,
            num_idle_closed=self._counters.idle_closed,
            num_streams_refused=self._counters.streams_refused,
            num_addresses_refused=self._counters.addresses_refused,
            num_relayed_connections=sum(1 for c in conns if c.relayed),
            traffic=self.traffic.snapshot(),
        )

    # --- conveniences ------------------------------------------------------------

    async def ping(self, peer: PeerID | Multiaddr | str) -> float:
        """Round-trip time in seconds of one ``/ipfs/ping/1.0.0`` exchange."""
        from peers.ping import ping_once

        stream = await self.new_stream(peer, "/ipfs/ping/1.0.0")
        try:
            return await ping_once(stream, os.urandom(32), time.perf_counter)
        finally:
            with contextlib.suppress(ConnectionClosed):
                await stream.close()

    # --- RPC ---------------------------------------------------------------------

    def add_unary_handler(
        self,
        protocol: str,
        handler: Callable[[Any, CallContext], Awaitable[Any]],
        request_type: type[Any],
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_value_items: int = MAX_VALUE_ITEMS,
        first_frame_timeout: float = rpc.FIRST_FRAME_SECONDS,
        max_handler_seconds: float = rpc.MAX_HANDLER_SECONDS,
    ) -> None:
        """See :func:`peers.rpc.add_unary_handler`."""
        rpc.add_unary_handler(
            self,
            protocol,
            handler,
            request_type,
            max_frame_bytes=max_frame_bytes,
            max_value_items=max_value_items,
            first_frame_timeout=first_frame_timeout,
            max_handler_seconds=max_handler_seconds,
        )

    def add_stream_handler(
        self,
        protocol: str,
        handler: Callable[[AsyncIterator[Any], CallContext], AsyncIterator[Any]],
        request_type: type[Any],
        *,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        first_frame_timeout: float = rpc.STREAM_FIRST_FRAME_SECONDS,
    ) -> None:
        """See :func:`peers.rpc.add_stream_handler`."""
        rpc.add_stream_handler(
            self,
            protocol,
            handler,
            request_type,
            max_frame_bytes=max_frame_bytes,
            first_frame_timeout=first_frame_timeout,
        )

    async def call_unary(
        self,
        remote: PeerID | Multiaddr | str,
        protocol: str,
        request: object,
        response_type: type[T],
        *,
        timeout: float | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_value_items: int = MAX_VALUE_ITEMS,
    ) -> T:
        """See :func:`peers.rpc.call_unary`."""
        return await rpc.call_unary(
            self,
            remote,
            protocol,
            request,
            response_type,
            timeout=timeout,
            max_frame_bytes=max_frame_bytes,
            max_value_items=max_value_items,
        )

    def call_stream(
        self,
        remote: PeerID | Multiaddr | str,
        protocol: str,
        requests: AsyncIterable[Any] | Iterable[Any],
        response_type: type[T],
        *,
        timeout: float | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> AsyncIterator[T]:
        """See :func:`peers.rpc.call_stream`."""
        return rpc.call_stream(
            self,
            remote,
            protocol,
            requests,
            response_type,
            timeout=timeout,
            max_frame_bytes=max_frame_bytes,
        )

    async def identify(self, remote: PeerID | Multiaddr | str) -> IdentifyInfo:
        """Ask ``remote`` for its identify record (agent, protocols, addresses)."""
        from peers.identify import identify

        return await identify(self, remote)
