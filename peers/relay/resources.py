"""What a circuit relay v2 hop grants: reservations and circuits, as a pure state machine.

No I/O and no clock: every call that depends on time takes ``now``, *Unix* seconds
(wall clock), because reservation expirations travel on the wire as Unix times
(relay/circuit-v2.md, "Reservation"). The caller owns the streams: it answers
RESERVE/CONNECT with the status or grant returned here, tells us when a connection
closes (its reservation ends with it, per the spec) and when a circuit's streams end,
and resets circuits :meth:`RelayResources.overdue_circuits` names.

Not decided here (the caller knows and answers ``PERMISSION_DENIED``): reservations and
CONNECTs arriving over a relayed connection, and ACLs.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from peers.binary_multiaddr import IPAddress, normalize_ip
from peers.identity import PeerID
from peers.protofields import MAX_UINT32
from peers.relay.messages import Limit, Status

#: Seconds a reservation (or its refresh) lasts: go-libp2p's 1 hour. Reservations also
#: end when their connection closes, so the TTL only bounds how long a live but idle
#: peer holds a slot; go's client refreshes when two minutes are left.
RESERVATION_TTL_SECONDS = 3600

#: Reservations the relay holds at once (go: 128). A reservation costs a table entry and
#: a connection kept open; with ``limits.MAX_CONNECTIONS`` = 1024 this leaves three
#: quarters of the connection budget to the relay's own training and DHT traffic while
#: serving every NATed member of a few-hundred-peer swarm from two or three relays.
MAX_RESERVATIONS = 256

#: Reservations from one IP address, or one IPv6 /64 (go: 8). A lab or cloud VPC puts
#: many GPU hosts behind one NAT gateway, all of them training peers that need a slot;
#: 32 covers a rack while one host still cannot take more than an eighth of the slots.
MAX_RESERVATIONS_PER_IP = 32

#: IPv6 prefix counted as one "IP" for the limit above: a subscriber or VM is usually
#: given a whole /64, so counting single /128s would let one host mint endless IPs.
IPV6_PREFIX_BITS = 64

#: Open circuits that one peer takes part in, as source or destination (go: 16, counted
#: the same way). In a butterfly all-reduce every group member exchanges parts with every
#: other at once; 32 lets a NATed member of a 32-peer group reach all partners through
#: this relay while hole punching is retried.
MAX_CIRCUITS_PER_PEER = 32

#: Open circuits in all. The real cost of a circuit is relayed bandwidth: 64 circuits
#: each exhausting :data:`CIRCUIT_DATA_BYTES` within :data:`CIRCUIT_DURATION_SECONDS`
#: is about 150 Mbit/s each way, what a volunteer relay with a good uplink can give.
MAX_CIRCUITS = 64

#: Longest life of a relayed connection, seconds (go: 2 minutes). It must outlive the
#: DCUtR handshake (seconds) and, when hole punching fails, carry several training
#: rounds of a few minutes each; go's 2 minutes would cut a round in half. One hour
#: matches the reservation TTL; after it peers reopen a circuit (and retry hole
#: punching) as after any dropped connection.
CIRCUIT_DURATION_SECONDS = 3600

#: Most bytes relayed per circuit in each direction (go: 128 KiB, less than one
#: all-reduce part of the smallest model). In a butterfly all-reduce a member sends
#: about 2 * model_bytes / group_size to each partner per round (reduce-scatter plus
#: all-gather): 1 GiB carries a round of a 1B-parameter fp16 model in a group of four,
#: or many rounds of a smaller or compressed one.
CIRCUIT_DATA_BYTES = 1 << 30


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayResourceConfig:
    """Limits of one relay hop service; the defaults are the module's constants."""

    #: Seconds a new or refreshed reservation lasts.
    reservation_ttl_seconds: int = RESERVATION_TTL_SECONDS
    #: Reservations held at once.
    max_reservations: int = MAX_RESERVATIONS
    #: Reservations from one IPv4 address or one IPv6 prefix of ``ipv6_prefix_bits``.
    max_reservations_per_ip: int = MAX_RESERVATIONS_PER_IP
    #: Length of the IPv6 prefix counted as one IP.
    ipv6_prefix_bits: int = IPV6_PREFIX_BITS
    #: Open circuits one peer takes part in (as source or destination).
    max_circuits_per_peer: int = MAX_CIRCUITS_PER_PEER
    #: Open circuits in all.
    max_circuits: int = MAX_CIRCUITS
    #: Longest life of a circuit, seconds; 0 for no limit.
    circuit_duration_seconds: int = CIRCUIT_DURATION_SECONDS
    #: Most bytes relayed per circuit in each direction; 0 for no limit.
    circuit_data_bytes: int = CIRCUIT_DATA_BYTES

    def __post_init__(self) -> None:
        for name in (
            "reservation_ttl_seconds",
            "max_reservations",
            "max_reservations_per_ip",
            "max_circuits_per_peer",
            "max_circuits",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 1 <= self.ipv6_prefix_bits <= 128:
            raise ValueError(f"ipv6_prefix_bits must be in 1..128, got {self.ipv6_prefix_bits}")
        if not 0 <= self.circuit_duration_seconds <= MAX_UINT32:
            raise ValueError("circuit_duration_seconds must fit the wire's uint32 seconds")
        if self.circuit_data_bytes < 0:
            raise ValueError("circuit_data_bytes must not be negative")

    @property
    def circuit_limit(self) -> Limit:
        """The ``Limit`` message a relay sends with each grant."""
        return Limit(
            duration_seconds=self.circuit_duration_seconds, data_bytes=self.circuit_data_bytes
        )


@dataclass(frozen=True, slots=True)
class ReservationGrant:
    """A granted reservation: answer STATUS:OK with it (and a voucher until the expiry)."""

    peer: PeerID
    #: Unix seconds the reservation ends (the ``Reservation.expire`` to send).
    expire_unix_seconds: int
    #: The limit each circuit to this peer will have.
    limit: Limit
    #: Whether it extended a reservation the peer already held.
    refreshed: bool


@dataclass(frozen=True, slots=True)
class CircuitGrant:
    """An admitted circuit; :meth:`RelayResources.close_circuit` it when its streams end."""

    circuit_id: int
    src: PeerID
    dst: PeerID
    #: The limit to send in the stop CONNECT and the hop STATUS:OK.
    limit: Limit
    #: Unix seconds after which the circuit must be reset, or ``None`` for no limit.
    deadline_unix_seconds: float | None


@dataclass(frozen=True, slots=True)
class RelayResourceStatistics:
    """What :meth:`RelayResources.statistics` reports: current sizes, then totals since
    the relay started."""

    num_reservations: int
    num_reserving_ips: int
    num_circuits: int
    num_reservations_granted: int
    num_reservations_refused: int
    num_circuits_opened: int
    num_circuits_refused: int
    num_relayed_bytes: int


@dataclass(slots=True)
class _Reservation:
    ip_key: Hashable
    conn_key: Hashable
    expire_unix_seconds: int


@dataclass(slots=True)
class _Circuit:
    src: PeerID
    dst: PeerID
    deadline_unix_seconds: float | None
    #: Bytes still allowed from src to dst and from dst to src (``None``: unlimited).
    left_from_src: int | None
    left_from_dst: int | None


class RelayResources:
    """Reservations and circuits of one relay, with their limits (see the module doc).

    One reservation per PeerID: a peer that reserves again, on the same connection or
    another, refreshes its one reservation (which moves to the connection the refresh
    came over) and never holds two slots; go-libp2p keeps one per peer too.
    """

    def __init__(self, config: RelayResourceConfig | None = None) -> None:
        self.config = config or RelayResourceConfig()
        self._reservations: dict[PeerID, _Reservation] = {}
        self._peers_by_ip: dict[Hashable, set[PeerID]] = {}
        self._peers_by_conn: dict[Hashable, set[PeerID]] = {}
        self._circuits: dict[int, _Circuit] = {}
        self._circuits_per_peer: Counter[PeerID] = Counter()
        self._next_circuit_id = 1
        self._num_reservations_granted = 0
        self._num_reservations_refused = 0
        self._num_circuits_opened = 0
        self._num_circuits_refused = 0
        self._num_relayed_bytes = 0

    # --- reservations ----------------------------------------------------------------

    def _ip_key(self, ip: str | IPAddress) -> Hashable:
        address = normalize_ip(ip)
        if isinstance(address, ipaddress.IPv6Address):
            return ipaddress.IPv6Network((address, self.config.ipv6_prefix_bits), strict=False)
        return address

    def _unlink(self, peer: PeerID, reservation: _Reservation) -> None:
        for index, key in (
            (self._peers_by_ip, reservation.ip_key),
            (self._peers_by_conn, reservation.conn_key),
        ):
            peers = index.get(key)
            if peers is not None:
                peers.discard(peer)
                if not peers:
                    del index[key]

    def _link(self, peer: PeerID, reservation: _Reservation) -> None:
        self._reservations[peer] = reservation
        self._peers_by_ip.setdefault(reservation.ip_key, set()).add(peer)
        self._peers_by_conn.setdefault(reservation.conn_key, set()).add(peer)

    def _drop(self, peer: PeerID) -> None:
        reservation = self._reservations.pop(peer)
        self._unlink(peer, reservation)

    def reserve(
        self, peer: PeerID, ip: str | IPAddress, conn_key: Hashable, now: float
    ) -> ReservationGrant | Status:
        """Grant or refresh ``peer``'s reservation, made over the connection identified by
        ``conn_key`` (any hashable the caller picks) from ``ip``.

        Returns the grant, or ``Status.RESERVATION_REFUSED`` when the relay holds
        ``max_reservations`` already or ``ip`` (its IPv6 prefix) holds
        ``max_reservations_per_ip``; a refused refresh leaves the old reservation as it
        was. Raises ``ValueError`` if ``ip`` is not an IP address.
        """
        ip_key = self._ip_key(ip)
        self.expire(now)
        existing = self._reservations.get(peer)
        if existing is not None:
            self._unlink(peer, existing)
            del self._reservations[peer]
        if (
            len(self._reservations) >= self.config.max_reservations
            or len(self._peers_by_ip.get(ip_key, ())) >= self.config.max_reservations_per_ip
        ):
            if existing is not None:
                self._link(peer, existing)
            self._num_reservations_refused += 1
            return Status.RESERVATION_REFUSED
        expire = int(now) + self.config.reservation_ttl_seconds
        self._link(peer, _Reservation(ip_key, conn_key, expire))
        self._num_reservations_granted += 1
        return ReservationGrant(peer, expire, self.config.circuit_limit, existing is not None)

    def release_connection(self, conn_key: Hashable) -> tuple[PeerID, ...]:
        """The connection ``conn_key`` closed: end the reservations bound to it (the spec:
        "If the peer disconnects, the reservation is no longer valid"). Returns the
        peers whose reservation ended; unknown keys are fine. Circuits are not touched:
        their streams end with the connection and the caller closes them."""
        peers = tuple(self._peers_by_conn.get(conn_key, ()))
        for peer in peers:
            self._drop(peer)
        return peers

    def expire(self, now: float) -> tuple[PeerID, ...]:
        """Drop the reservations expired at ``now``; returns their peers."""
        expired = tuple(
            peer for peer, r in self._reservations.items() if r.expire_unix_seconds <= now
        )
        for peer in expired:
            self._drop(peer)
        return expired

    def reservation_expiry(self, peer: PeerID, now: float) -> int | None:
        """When ``peer``'s reservation ends (Unix seconds), or ``None`` if it has none."""
        reservation = self._reservations.get(peer)
        if reservation is None or reservation.expire_unix_seconds <= now:
            return None
        return reservation.expire_unix_seconds

    # --- circuits --------------------------------------------------------------------

    def open_circuit(self, src: PeerID, dst: PeerID, now: float) -> CircuitGrant | Status:
        """Admit a circuit from ``src`` to ``dst`` (before the relay opens the stop stream).

        Returns the grant, ``Status.NO_RESERVATION`` if ``dst`` holds no reservation
        unexpired at ``now``, or ``Status.RESOURCE_LIMIT_EXCEEDED`` if ``max_circuits``
        are open or ``src`` or ``dst`` takes part in ``max_circuits_per_peer`` already.
        """
        if self.reservation_expiry(dst, now) is None:
            self._num_circuits_refused += 1
            return Status.NO_RESERVATION
        per_peer = self.config.max_circuits_per_peer
        if (
            len(self._circuits) >= self.config.max_circuits
            or self._circuits_per_peer[src] >= per_peer
            or self._circuits_per_peer[dst] >= per_peer
        ):
            self._num_circuits_refused += 1
            return Status.RESOURCE_LIMIT_EXCEEDED
        limit = self.config.circuit_limit
        circuit_id = self._next_circuit_id
        self._next_circuit_id += 1
        deadline = now + limit.duration_seconds if limit.duration_seconds else None
        data = limit.data_bytes or None
        self._circuits[circuit_id] = _Circuit(src, dst, deadline, data, data)
        self._circuits_per_peer[src] += 1
        self._circuits_per_peer[dst] += 1
        self._num_circuits_opened += 1
        return CircuitGrant(circuit_id, src, dst, limit, deadline)

    def allow_data(self, circuit_id: int, *, from_src: bool, num_bytes: int) -> int:
        """How many of ``num_bytes`` read from one side the circuit may still forward to the
        other (all of them, some, or 0 once the direction's data limit is used up, when
        the caller closes that direction as the spec says). 0 for an unknown circuit."""
        circuit = self._circuits.get(circuit_id)
        if circuit is None or num_bytes <= 0:
            return 0
        left = circuit.left_from_src if from_src else circuit.left_from_dst
        allowed = num_bytes if left is None else min(num_bytes, left)
        if left is not None:
            if from_src:
                circuit.left_from_src = left - allowed
            else:
                circuit.left_from_dst = left - allowed
        self._num_relayed_bytes += allowed
        return allowed

    def overdue_circuits(self, now: float) -> tuple[int, ...]:
        """Circuits past their duration limit at ``now``: reset their streams, then close
        them."""
        return tuple(
            circuit_id
            for circuit_id, c in self._circuits.items()
            if c.deadline_unix_seconds is not None and c.deadline_unix_seconds <= now
        )

    def close_circuit(self, circuit_id: int) -> bool:
        """Forget a circuit whose streams ended; False if it was unknown (already closed)."""
        circuit = self._circuits.pop(circuit_id, None)
        if circuit is None:
            return False
        for peer in (circuit.src, circuit.dst):
            self._circuits_per_peer[peer] -= 1
            if self._circuits_per_peer[peer] <= 0:
                del self._circuits_per_peer[peer]
        return True

    def statistics(self) -> RelayResourceStatistics:
        return RelayResourceStatistics(
            num_reservations=len(self._reservations),
            num_reserving_ips=len(self._peers_by_ip),
            num_circuits=len(self._circuits),
            num_reservations_granted=self._num_reservations_granted,
            num_reservations_refused=self._num_reservations_refused,
            num_circuits_opened=self._num_circuits_opened,
            num_circuits_refused=self._num_circuits_refused,
            num_relayed_bytes=self._num_relayed_bytes,
        )
