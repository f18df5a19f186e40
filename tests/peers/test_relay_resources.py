"""The relay's resource manager: reservations (refresh, expiry, per-IP and total limits,
release on connection close) and circuits (NO_RESERVATION, limits, data, deadlines)."""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from peers.identity import KeyPair, PeerID
from peers.relay import (
    CircuitGrant,
    HopMessage,
    HopType,
    Limit,
    RelayResourceConfig,
    RelayResources,
    ReservationGrant,
    Status,
    decode_hop_message,
    encode_hop_message,
)
from peers.relay.resources import (
    CIRCUIT_DATA_BYTES,
    CIRCUIT_DURATION_SECONDS,
    RESERVATION_TTL_SECONDS,
)

NOW = 1_700_000_000.25


def _peer(i: int) -> PeerID:
    return KeyPair.from_seed(i.to_bytes(32, "big")).peer_id


A, B, C, D = (_peer(i) for i in range(4))


def _grant(result: ReservationGrant | Status) -> ReservationGrant:
    assert isinstance(result, ReservationGrant), result
    return result


def _circuit(result: CircuitGrant | Status) -> CircuitGrant:
    assert isinstance(result, CircuitGrant), result
    return result


def test_reservation_grant_carries_expiry_and_the_circuit_limit() -> None:
    relay = RelayResources()
    grant = _grant(relay.reserve(A, "198.51.100.7", "conn-a", NOW))
    assert grant.expire_unix_seconds == int(NOW) + RESERVATION_TTL_SECONDS
    assert grant.limit == Limit(CIRCUIT_DURATION_SECONDS, CIRCUIT_DATA_BYTES)
    assert not grant.refreshed
    assert relay.reservation_expiry(A, NOW) == grant.expire_unix_seconds


def test_default_limit_travels() -> None:
    """The default limit fits the wire (duration is a uint32 there)."""
    limit = RelayResourceConfig().circuit_limit
    msg = HopMessage(type=HopType.STATUS, status=Status.OK, limit=limit)
    assert decode_hop_message(encode_hop_message(msg)).limit == limit


def test_refresh_on_the_same_connection_extends_and_counts_once() -> None:
    relay = RelayResources()
    first = _grant(relay.reserve(A, "198.51.100.7", "conn-a", NOW))
    second = _grant(relay.reserve(A, "198.51.100.7", "conn-a", NOW + 600))
    assert second.refreshed
    assert second.expire_unix_seconds == first.expire_unix_seconds + 600
    stats = relay.statistics()
    assert (stats.num_reservations, stats.num_reserving_ips) == (1, 1)
    assert stats.num_reservations_granted == 2


def test_one_peer_holds_one_slot_however_often_it_reserves() -> None:
    relay = RelayResources(RelayResourceConfig(max_reservations=3, max_reservations_per_ip=1))
    for i in range(10):  # over ten connections from ten IPs
        _grant(relay.reserve(A, f"198.51.100.{i}", f"conn-{i}", NOW + i))
    stats = relay.statistics()
    assert (stats.num_reservations, stats.num_reserving_ips) == (1, 1)
    # and its refreshes never used up the second slot, nor its last IP's:
    _grant(relay.reserve(B, "198.51.100.0", "conn-b", NOW))
    assert relay.reserve(C, "198.51.100.9", "conn-c", NOW) is Status.RESERVATION_REFUSED


def test_refresh_over_another_connection_moves_the_reservation() -> None:
    relay = RelayResources()
    _grant(relay.reserve(A, "198.51.100.7", "old", NOW))
    _grant(relay.reserve(A, "198.51.100.7", "new", NOW + 1))
    assert relay.release_connection("old") == ()
    assert relay.reservation_expiry(A, NOW + 2) is not None
    assert relay.release_connection("new") == (A,)
    assert relay.reservation_expiry(A, NOW + 2) is None


def test_total_reservation_limit() -> None:
    relay = RelayResources(RelayResourceConfig(max_reservations=2))
    _grant(relay.reserve(A, "198.51.100.1", 1, NOW))
    _grant(relay.reserve(B, "198.51.100.2", 2, NOW))
    assert relay.reserve(C, "198.51.100.3", 3, NOW) is Status.RESERVATION_REFUSED
    assert _grant(relay.reserve(A, "198.51.100.1", 1, NOW + 1)).refreshed  # full, refresh ok
    relay.release_connection(2)
    _grant(relay.reserve(C, "198.51.100.3", 3, NOW + 2))
    stats = relay.statistics()
    assert (stats.num_reservations, stats.num_reservations_refused) == (2, 1)


def test_per_ip_reservation_limit() -> None:
    relay = RelayResources(RelayResourceConfig(max_reservations_per_ip=2))
    _grant(relay.reserve(A, "198.51.100.7", 1, NOW))
    _grant(relay.reserve(B, "198.51.100.7", 2, NOW))
    assert relay.reserve(C, "198.51.100.7", 3, NOW) is Status.RESERVATION_REFUSED
    # a dual-stack socket's IPv4-mapped form is the same IP
    assert relay.reserve(C, "::ffff:198.51.100.7", 3, NOW) is Status.RESERVATION_REFUSED
    _grant(relay.reserve(C, ipaddress.ip_address("198.51.100.8"), 3, NOW))


def test_ipv6_counts_per_64_prefix() -> None:
    relay = RelayResources(RelayResourceConfig(max_reservations_per_ip=2))
    _grant(relay.reserve(A, "2001:db8:0:1::a", 1, NOW))
    _grant(relay.reserve(B, "2001:db8:0:1::b", 2, NOW))
    assert relay.reserve(C, "2001:db8:0:1:ffff::1", 3, NOW) is Status.RESERVATION_REFUSED
    _grant(relay.reserve(C, "2001:db8:0:2::1", 3, NOW))


def test_refused_refresh_keeps_the_old_reservation() -> None:
    relay = RelayResources(RelayResourceConfig(max_reservations_per_ip=1))
    first = _grant(relay.reserve(A, "198.51.100.1", "a1", NOW))
    _grant(relay.reserve(B, "198.51.100.2", "b", NOW))
    # A comes back over a new connection from B's (full) IP: refused, and A keeps its slot
    assert relay.reserve(A, "198.51.100.2", "a2", NOW + 5) is Status.RESERVATION_REFUSED
    assert relay.reservation_expiry(A, NOW + 5) == first.expire_unix_seconds
    assert relay.release_connection("a2") == ()
    assert relay.release_connection("a1") == (A,)


def test_reservations_expire() -> None:
    relay = RelayResources(RelayResourceConfig(reservation_ttl_seconds=60))
    expire = _grant(relay.reserve(A, "198.51.100.1", 1, NOW)).expire_unix_seconds
    assert relay.reservation_expiry(A, expire - 0.001) == expire
    assert relay.reservation_expiry(A, expire) is None
    assert relay.open_circuit(B, A, expire) is Status.NO_RESERVATION
    assert relay.expire(expire) == (A,)
    assert relay.statistics().num_reservations == 0
    assert relay.expire(expire) == ()


def test_expired_reservations_free_their_slots_for_new_ones() -> None:
    relay = RelayResources(RelayResourceConfig(max_reservations=1, reservation_ttl_seconds=60))
    _grant(relay.reserve(A, "198.51.100.1", 1, NOW))
    assert relay.reserve(B, "198.51.100.2", 2, NOW + 59) is Status.RESERVATION_REFUSED
    _grant(relay.reserve(B, "198.51.100.2", 2, NOW + 60))


def test_release_on_connection_close() -> None:
    relay = RelayResources()
    _grant(relay.reserve(A, "198.51.100.1", "conn-a", NOW))
    _grant(relay.reserve(B, "198.51.100.2", "conn-b", NOW))
    assert relay.release_connection("conn-a") == (A,)
    assert relay.open_circuit(C, A, NOW) is Status.NO_RESERVATION
    _circuit(relay.open_circuit(C, B, NOW))
    assert relay.release_connection("conn-a") == ()
    assert relay.release_connection("never-seen") == ()
    assert relay.statistics().num_reserving_ips == 1


def test_invalid_ip_is_the_callers_mistake() -> None:
    with pytest.raises(ValueError):
        RelayResources().reserve(A, "relay.example.com", 1, NOW)


# --- circuits ----------------------------------------------------------------------


def test_circuit_needs_a_reservation_of_the_destination() -> None:
    relay = RelayResources()
    assert relay.open_circuit(A, B, NOW) is Status.NO_RESERVATION
    _grant(relay.reserve(B, "198.51.100.2", 2, NOW))
    grant = _circuit(relay.open_circuit(A, B, NOW))
    assert (grant.src, grant.dst) == (A, B)
    assert grant.limit == RelayResourceConfig().circuit_limit
    assert grant.deadline_unix_seconds == NOW + CIRCUIT_DURATION_SECONDS
    assert relay.open_circuit(B, A, NOW) is Status.NO_RESERVATION  # A holds none
    stats = relay.statistics()
    assert (stats.num_circuits, stats.num_circuits_opened, stats.num_circuits_refused) == (1, 1, 2)


def test_circuits_per_destination_limit() -> None:
    relay = RelayResources(RelayResourceConfig(max_circuits_per_peer=2))
    _grant(relay.reserve(D, "198.51.100.4", 4, NOW))
    _circuit(relay.open_circuit(A, D, NOW))
    second = _circuit(relay.open_circuit(B, D, NOW))
    assert relay.open_circuit(C, D, NOW) is Status.RESOURCE_LIMIT_EXCEEDED
    assert relay.close_circuit(second.circuit_id)
    assert not relay.close_circuit(second.circuit_id)  # already closed
    _circuit(relay.open_circuit(C, D, NOW))


def test_circuits_per_source_limit() -> None:
    relay = RelayResources(RelayResourceConfig(max_circuits_per_peer=2))
    for peer, conn in ((B, 2), (C, 3), (D, 4)):
        _grant(relay.reserve(peer, f"198.51.100.{conn}", conn, NOW))
    _circuit(relay.open_circuit(A, B, NOW))
    _circuit(relay.open_circuit(A, C, NOW))
    assert relay.open_circuit(A, D, NOW) is Status.RESOURCE_LIMIT_EXCEEDED
    # a peer's count includes the circuits it is the destination of (as go counts)
    _circuit(relay.open_circuit(B, C, NOW))
    assert relay.open_circuit(D, B, NOW) is Status.RESOURCE_LIMIT_EXCEEDED


def test_total_circuit_limit() -> None:
    relay = RelayResources(RelayResourceConfig(max_circuits=2))
    _grant(relay.reserve(D, "198.51.100.4", 4, NOW))
    first = _circuit(relay.open_circuit(A, D, NOW))
    second = _circuit(relay.open_circuit(B, D, NOW))
    assert first.circuit_id != second.circuit_id
    assert relay.open_circuit(C, D, NOW) is Status.RESOURCE_LIMIT_EXCEEDED
    relay.close_circuit(first.circuit_id)
    _circuit(relay.open_circuit(C, D, NOW))


def test_open_circuits_survive_their_destinations_reservation() -> None:
    """A circuit's life is its streams'; the caller closes it when they end."""
    relay = RelayResources()
    _grant(relay.reserve(B, "198.51.100.2", "conn-b", NOW))
    grant = _circuit(relay.open_circuit(A, B, NOW))
    relay.release_connection("conn-b")
    assert relay.statistics().num_circuits == 1
    assert relay.close_circuit(grant.circuit_id)
    assert relay.statistics().num_circuits == 0


def test_data_limit_per_direction() -> None:
    relay = RelayResources(RelayResourceConfig(circuit_data_bytes=100))
    _grant(relay.reserve(B, "198.51.100.2", 2, NOW))
    circuit = _circuit(relay.open_circuit(A, B, NOW)).circuit_id
    assert relay.allow_data(circuit, from_src=True, num_bytes=60) == 60
    assert relay.allow_data(circuit, from_src=True, num_bytes=60) == 40
    assert relay.allow_data(circuit, from_src=True, num_bytes=1) == 0
    assert relay.allow_data(circuit, from_src=False, num_bytes=100) == 100  # other direction
    assert relay.allow_data(circuit, from_src=False, num_bytes=0) == 0
    assert relay.allow_data(circuit + 1, from_src=True, num_bytes=10) == 0  # unknown
    assert relay.statistics().num_relayed_bytes == 200


def test_zero_means_no_limit() -> None:
    relay = RelayResources(RelayResourceConfig(circuit_data_bytes=0, circuit_duration_seconds=0))
    _grant(relay.reserve(B, "198.51.100.2", 2, NOW))
    grant = _circuit(relay.open_circuit(A, B, NOW))
    assert grant.limit == Limit(0, 0) and grant.deadline_unix_seconds is None
    assert relay.allow_data(grant.circuit_id, from_src=True, num_bytes=1 << 40) == 1 << 40
    assert relay.overdue_circuits(NOW + 10**9) == ()


def test_overdue_circuits() -> None:
    relay = RelayResources(RelayResourceConfig(circuit_duration_seconds=120))
    _grant(relay.reserve(B, "198.51.100.2", 2, NOW))
    early = _circuit(relay.open_circuit(A, B, NOW)).circuit_id
    late = _circuit(relay.open_circuit(C, B, NOW + 60)).circuit_id
    assert relay.overdue_circuits(NOW + 119) == ()
    assert relay.overdue_circuits(NOW + 120) == (early,)
    assert set(relay.overdue_circuits(NOW + 180)) == {early, late}


def test_statistics_is_a_frozen_record() -> None:
    stats = RelayResources().statistics()
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.num_circuits = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_reservations", 0),
        ("max_reservations_per_ip", 0),
        ("max_circuits", 0),
        ("max_circuits_per_peer", 0),
        ("reservation_ttl_seconds", 0),
        ("ipv6_prefix_bits", 129),
        ("circuit_duration_seconds", 2**32),
        ("circuit_data_bytes", -1),
    ],
)
def test_config_is_validated(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        RelayResourceConfig(**{field: value})
