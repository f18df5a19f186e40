"""Getting through NAT: learn whether we are reachable, and if not, stay reachable anyway.

One long-lived task per :class:`peers.host.Peer` (owned by its TaskGroup) that:

- runs identify on each new direct connection, collecting the address the remote saw
  us come from and the protocols it serves;
- asks AutoNAT servers among our peers to dial us back at our candidate addresses
  (:mod:`peers.autonat.service`), and records what they say in a
  :class:`peers.reachability.ReachabilityTracker`;
- once found private, reserves slots on :data:`NUM_RELAYS` relays among our peers
  (circuit relay v2), renews them before they expire, replaces one whose connection
  closed, and announces our ``/p2p-circuit`` addresses;
- serves AutoNAT dial-backs and relay hops for others while not private.

The protocols themselves live in :mod:`peers.autonat` and :mod:`peers.relay`; this
module only decides when to use them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multiaddr import Multiaddr

from peers.addresses import tcp_target
from peers.autonat.messages import AUTONAT_PROTOCOL_ID, ResponseStatus
from peers.autonat.service import AutoNATServer, request_dial_back
from peers.connection import Connection
from peers.dcutr.holepunch import HolePuncher, HolePunchResult
from peers.errors import PeersError
from peers.identity import PeerID
from peers.reachability import (
    NatMapping,
    Reachability,
    ReachabilityTracker,
    is_public_candidate,
)
from peers.relay.client import ReservationInfo, reserve
from peers.relay.hop import RelayService
from peers.relay.messages import HOP_PROTOCOL_ID
from peers.relay.resources import RelayResourceConfig
from peers.relay.stop import install_stop_handler

if TYPE_CHECKING:
    from peers.host import Peer

logger = logging.getLogger(__name__)

#: Relays a private peer holds reservations on: one is a single point of failure; two
#: survive a relay's death while its replacement is found (the issue and go-libp2p's
#: autorelay, which keeps 2 by default, agree).
NUM_RELAYS = 2
#: Seconds between two rounds of the manager's loop when nothing wakes it: new
#: connections wake it at once; this only paces retries and renewals.
TICK_SECONDS = 2.0
#: Renew a reservation this long before it ends (go-libp2p renews at half its life;
#: a margin of minutes survives a slow or busy relay).
RENEW_MARGIN_SECONDS = 5 * 60.0
#: Seconds a dial-back answer is trusted before we ask again while the verdict holds.
REPROBE_SECONDS = 15 * 60.0
#: Seconds one identify of a new connection may take.
IDENTIFY_TIMEOUT_SECONDS = 10.0
#: Seconds before a peer that failed a probe or reservation is asked again.
RETRY_SECONDS = 30.0


class ForcedReachability(enum.Enum):
    AUTO = "auto"
    PUBLIC = "public"
    PRIVATE = "private"


@dataclass(frozen=True, slots=True)
class NatStatistics:
    reachability: Reachability
    mapping: NatMapping
    confirmed_addrs: tuple[Multiaddr, ...]
    observed_addrs: tuple[Multiaddr, ...]
    relays: tuple[PeerID, ...]
    circuit_addrs: tuple[Multiaddr, ...]
    num_relayed_connections: int
    num_direct_connections: int


class NatManager:
    """See the module doc. Built by the Peer; ``run()`` is its task."""

    def __init__(
        self,
        peer: Peer,
        *,
        forced: ForcedReachability = ForcedReachability.AUTO,
        relay_hop: bool = True,
        use_relays: bool = True,
        relay_limits: RelayResourceConfig | None = None,
        hole_punching: bool = True,
    ) -> None:
        self.peer = peer
        self.forced = forced
        self.tracker = ReachabilityTracker()
        self.use_relays = use_relays
        self._protocols: dict[PeerID, frozenset[str]] = {}
        self._reservations: dict[PeerID, ReservationInfo] = {}
        self._failed_at: dict[PeerID, float] = {}
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        #: Whether the manager's task runs (the peer listens beyond loopback, or its
        #: reachability was given): a loopback-only peer has nothing to find out.
        self.active = False
        self.relay_service = RelayService(peer, relay_limits) if relay_hop else None
        self.autonat_server = AutoNATServer(peer, lambda: self.reachability != Reachability.PRIVATE)
        install_stop_handler(peer, lambda relay: relay in self._reservations)
        self.hole_puncher = (
            HolePuncher(peer, lambda: [*self.confirmed_addrs(), *self.tracker.observed_addrs()])
            if hole_punching
            else None
        )

    # --- state ---------------------------------------------------------------------

    @property
    def reachability(self) -> Reachability:
        if self.forced is ForcedReachability.PUBLIC:
            return Reachability.PUBLIC
        if self.forced is ForcedReachability.PRIVATE:
            return Reachability.PRIVATE
        servers = sum(AUTONAT_PROTOCOL_ID in p for p in self._protocols.values())
        return self.tracker.reachability(time.monotonic(), num_servers_known=servers or None)

    def confirmed_addrs(self) -> list[Multiaddr]:
        return self.tracker.confirmed_addrs(time.monotonic())

    def mapping(self) -> NatMapping:
        """How our router maps our listen port (see :meth:`ReachabilityTracker.mapping`)."""
        ports = {tcp_target(a).port for a in self.peer.bound_addrs()}
        return self.tracker.mapping(ports)

    @property
    def punchable(self) -> bool:
        """Whether we are private yet others should still send us work (a butterfly
        part to reduce): we hold a relay reservation, punch holes, and our router maps
        endpoint-independently, so a connection that reaches us through a relay can be
        made direct. A symmetric NAT's peer stays a client: everything sent to it would
        cross the relay."""
        return (
            self.hole_puncher is not None
            and self.reachability == Reachability.PRIVATE
            and bool(self._reservations)
            and self.mapping() == NatMapping.ENDPOINT_INDEPENDENT
        )

    async def wait_for_direct(self, remote: PeerID, *, start_within: float) -> None:
        """After dialing ``remote`` through a relay: give the hole punch it starts (if
        one starts within ``start_within`` seconds) the time to finish, so streams that
        follow take the direct connection. Returns when there is one, or there will be
        none."""
        if self.hole_puncher is not None and self.mapping() != NatMapping.SYMMETRIC:
            await self.hole_puncher.wait_for_direct(remote, start_within=start_within)
        # behind a symmetric NAT no punch can succeed (and _serve refuses one at once)

    def circuit_addrs(self) -> list[Multiaddr]:
        return [a for r in self._reservations.values() for a in r.circuit_addrs]

    @property
    def relays(self) -> list[PeerID]:
        return list(self._reservations)

    def statistics(self) -> NatStatistics:
        conns = [self.peer.connection_to(p) for p in self.peer.connected_peers()]
        return NatStatistics(
            reachability=self.reachability,
            mapping=self.mapping(),
            confirmed_addrs=tuple(self.confirmed_addrs()),
            observed_addrs=tuple(self.tracker.observed_addrs()),
            relays=tuple(self._reservations),
            circuit_addrs=tuple(self.circuit_addrs()),
            num_relayed_connections=sum(c is not None and c.relayed for c in conns),
            num_direct_connections=sum(c is not None and not c.relayed for c in conns),
        )

    # --- events --------------------------------------------------------------------

    def notify_changed(self) -> None:
        """Wake every :meth:`wait_changed` (our addresses, relays or connections moved)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self) -> None:
        """Wait until our reachability, relays, announced addresses or connections next
        change (a connection opened or closed, direct or relayed), or our relay service
        grants, releases or relays something. For code that waits for a
        condition on them: re-check it after each wake-up."""
        await self._changed.wait()

    def on_connection(self, conn: Connection) -> None:
        """A connection was registered: learn about it (in the manager's own task); one
        that a peer opened to us through a relay, try to make direct (DCUtR: the side
        that accepted the relayed connection starts)."""
        self.notify_changed()
        if not conn.relayed:
            self._wake.set()
        elif not conn.outbound and self.hole_puncher is not None:
            self.peer._spawn(self._punch(conn.remote_peer_id))

    async def _punch(self, remote: PeerID) -> None:
        assert self.hole_puncher is not None
        if self.mapping() == NatMapping.SYMMETRIC:
            # Our router gives each destination its own port: the one the other side
            # would dial is never the one our SYN leaves from. Stay relayed.
            logger.info("not hole punching to %s: our NAT is symmetric", remote)
            return
        await self.hole_puncher.punch(remote)

    @property
    def hole_punch_results(self) -> list[HolePunchResult]:
        return [] if self.hole_puncher is None else list(self.hole_puncher.results)

    def describe(self) -> str:
        """:func:`describe` of our statistics and the hole punches that succeeded."""
        punched = {r.remote for r in self.hole_punch_results if r.success}
        return describe(self.statistics(), len(punched))

    # --- the loop --------------------------------------------------------------------

    async def run(self) -> None:
        self.active = True
        identified: set[Connection] = set()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_SECONDS):
                    await self._wake.wait()
            self._wake.clear()
            identified = await self._identify_new(identified)
            if self.forced is ForcedReachability.AUTO:
                await self._probe()
            if self.use_relays and self.reachability == Reachability.PRIVATE:
                await self._keep_reservations()
            elif self._reservations and self.reachability == Reachability.PUBLIC:
                self._reservations.clear()
                self.peer.addresses_changed()

    async def _identify_new(self, identified: set[Connection]) -> set[Connection]:
        live: set[Connection] = set()
        for peer_id in self.peer.connected_peers():
            conn = self.peer.connection_to(peer_id)
            if conn is None or conn.relayed:
                continue
            if conn in identified:
                live.add(conn)
                continue
            try:
                async with asyncio.timeout(IDENTIFY_TIMEOUT_SECONDS):
                    info = await self.peer.identify(peer_id)
            except (TimeoutError, PeersError) as e:
                logger.debug("identify of %s failed: %r", peer_id, e)
                continue  # tried again next time round
            live.add(conn)
            self._protocols[peer_id] = frozenset(info.protocols)
            if info.observed_addr is not None and conn.outbound:
                self.tracker.observed(info.observed_addr, peer_id)
            self.notify_changed()
        # What we know of peers we are no longer connected to would grow without bound
        # on a long-lived public peer; a reconnecting peer is identified again.
        connected = set(self.peer.connected_peers())
        for table in (self._protocols, self._failed_at):
            for gone in [p for p in table if p not in connected]:
                del table[gone]
        return live

    def _candidates(self) -> list[Multiaddr]:
        bound = [a for a in self.peer.bound_addrs() if is_public_candidate(a)]
        return list(dict.fromkeys([*self.tracker.observed_addrs(), *bound]))

    def _servers_to_ask(self, now: float) -> list[PeerID]:
        """AutoNAT servers among our direct peers that have not answered lately, as
        many as a verdict still needs (one more than the confirmations, for a tie)."""
        room = self.tracker.confirmations + 1 - self.tracker.num_servers_asked(now)
        servers: list[PeerID] = []
        for peer_id, protocols in self._protocols.items():
            if len(servers) >= room:
                break
            if AUTONAT_PROTOCOL_ID not in protocols or self.tracker.has_answer_from(peer_id, now):
                continue
            if now - self._failed_at.get(peer_id, -RETRY_SECONDS) < RETRY_SECONDS:
                continue
            conn = self.peer.connection_to(peer_id)
            if conn is not None and not conn.relayed:
                servers.append(peer_id)
        return servers

    def verdict_pending(self) -> bool:
        """Whether a reachability verdict may still come: we are not forced, the
        verdict is unknown, and a peer we are directly connected to has not been
        identified yet (so we may not know our observed address yet either), or we have
        an address to test and an AutoNAT server we may still ask."""
        if not self.active or self.forced is not ForcedReachability.AUTO:
            return False
        if self.reachability != Reachability.UNKNOWN:
            return False
        direct = [
            p
            for p in self.peer.connected_peers()
            if (conn := self.peer.connection_to(p)) is not None and not conn.relayed
        ]
        if any(p not in self._protocols for p in direct):
            return True  # its identify may bring an observed address and a server
        return bool(self._candidates()) and bool(self._servers_to_ask(time.monotonic()))

    async def wait_for_verdict(self, timeout: float) -> Reachability:
        """Wait (at most ``timeout`` seconds) until AutoNAT has decided whether others
        can dial us, or no server is left to ask; the reachability then. A trainer
        does this before its first round, so that it does not offer the swarm an
        address nobody can dial."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.verdict_pending():
                    await self.wait_changed()
        return self.reachability

    async def _probe(self) -> None:
        now = time.monotonic()
        candidates = self._candidates()
        servers = self._servers_to_ask(now) if candidates else []
        if not servers:
            return
        # All at once: each dial-back to a NATed address takes its whole timeout.
        answers = await asyncio.gather(
            *(request_dial_back(self.peer, server, candidates) for server in servers),
            return_exceptions=True,
        )
        before = self.reachability
        for server, answer in zip(servers, answers, strict=True):
            if isinstance(answer, TimeoutError | PeersError):
                logger.info("AutoNAT probe by %s failed: %r", server, answer)
                self._failed_at[server] = now
            elif isinstance(answer, BaseException):  # not the server's word: skip it
                logger.warning("AutoNAT probe by %s broke: %r", server, answer)
                self._failed_at[server] = now
            elif answer.status == ResponseStatus.OK:
                self.tracker.dial_back(server, ok=True, addr=answer.addr, now=time.monotonic())
            elif answer.status == ResponseStatus.E_DIAL_ERROR:
                self.tracker.dial_back(server, ok=False, addr=None, now=time.monotonic())
            else:  # refused or bad request: this server says nothing about us
                self._failed_at[server] = now
        if self.reachability != before:
            logger.info("reachability: %s", self.reachability.value)
        self.peer.addresses_changed()  # also wakes whoever waits for a verdict

    async def _keep_reservations(self) -> None:
        now_unix = time.time()
        for relay, info in list(self._reservations.items()):
            conn = self.peer.connection_to(relay)
            if conn is None or conn.relayed:
                del self._reservations[relay]
                self.peer.addresses_changed()
            elif info.expire_unix_seconds - now_unix < RENEW_MARGIN_SECONDS:
                await self._reserve(relay)
        if len(self._reservations) >= NUM_RELAYS:
            return
        now = time.monotonic()
        for peer_id, protocols in list(self._protocols.items()):
            if len(self._reservations) >= NUM_RELAYS:
                break
            if peer_id in self._reservations or HOP_PROTOCOL_ID not in protocols:
                continue
            if now - self._failed_at.get(peer_id, -RETRY_SECONDS) < RETRY_SECONDS:
                continue
            await self._reserve(peer_id)

    async def _reserve(self, relay: PeerID) -> None:
        try:
            async with asyncio.timeout(IDENTIFY_TIMEOUT_SECONDS):
                info = await reserve(self.peer, relay)
        except (TimeoutError, PeersError) as e:
            logger.info("reservation on %s failed: %r", relay, e)
            self._failed_at[relay] = time.monotonic()
            self._reservations.pop(relay, None)
            return
        known = relay in self._reservations
        self._reservations[relay] = info
        if not known:
            logger.info("reserved a relay slot on %s", relay)
            self.peer.addresses_changed()


def describe(stats: NatStatistics, num_punched: int = 0) -> str:
    """One line for a person: how this peer is connected (what ``swarm join`` prints).

    ``num_punched``: connections that hole punching made direct."""
    direct, relayed = stats.num_direct_connections, stats.num_relayed_connections
    total = direct + relayed
    peers_part = f"direct to {direct} of {total} peers" if total else "no peers yet"
    if num_punched:
        peers_part += f" ({num_punched} by hole punching)"
    if stats.reachability == Reachability.PRIVATE:
        relays = len(stats.relays)
        how = (
            f"reachable through {relays} relay{'s' if relays != 1 else ''}"
            if relays
            else ("no relay yet: reachable only over connections it opens")
        )
        mapping = {
            NatMapping.ENDPOINT_INDEPENDENT: " (endpoint-independent)",
            NatMapping.SYMMETRIC: " (symmetric: no hole punching)",
        }.get(stats.mapping, "")
        return f"behind NAT{mapping}: {how}; {peers_part}"
    if stats.reachability == Reachability.PUBLIC:
        where = ", ".join(str(a) for a in stats.confirmed_addrs[:2]) or "its listen addresses"
        return f"public: reachable at {where}; {peers_part}"
    return f"reachability not known yet; {peers_part}"
