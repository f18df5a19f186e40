"""Inbound admission by source (pure: no sockets, ``now`` passed in)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peers import admission
from peers.admission import Admitted, InboundAdmission, Refused, source_of
from peers.config import PeerConfig


def make(
    *, per_ip: int = 128, per_subnet: int = 64, rate: float = 10.0, burst: int = 40
) -> InboundAdmission:
    return InboundAdmission(
        max_connections_per_ip=per_ip,
        max_connections_per_subnet=per_subnet,
        handshake_rate=rate,
        handshake_burst=burst,
    )


@pytest.mark.parametrize(
    ("ip", "host", "subnet", "limited"),
    [
        ("127.0.0.1", "127.0.0.1", None, False),
        ("::1", "::1", None, False),
        ("::ffff:127.0.0.1", "127.0.0.1", None, False),
        ("192.168.1.7", "192.168.1.7", None, True),
        ("198.18.0.3", "198.18.0.3", None, True),  # the namespace lab's range
        ("8.8.4.4", "8.8.4.4", "8.8.4.0/24", True),
        ("::ffff:8.8.4.4", "8.8.4.4", "8.8.4.0/24", True),
        ("2001:4860:1:2:3:4:5:6", "2001:4860:1:2::/64", "2001:4860:1::/48", True),
        ("fe80::1%eth0", "fe80::/64", None, True),
        ("not an address", "not an address", None, True),
    ],
)
def test_sources(ip: str, host: str, subnet: str | None, limited: bool) -> None:
    source = source_of(ip)
    assert (source.host, source.subnet, source.rate_limited) == (host, subnet, limited)


def test_a_host_gets_its_burst_then_its_rate() -> None:
    gate = make(rate=10.0, burst=5)
    admitted = [gate.admit("192.168.1.7", now=100.0) for _ in range(8)]
    assert [isinstance(a, Admitted) for a in admitted] == [True] * 5 + [False] * 3
    refused = admitted[-1]
    assert isinstance(refused, Refused) and "192.168.1.7 above their rate" in refused.reason
    assert gate.connections_from("192.168.1.7") == 5  # refused ones are not counted
    # Another host is not touched; 0.25 s later two more tokens have come back.
    assert isinstance(gate.admit("192.168.1.8", now=100.0), Admitted)
    later = [gate.admit("192.168.1.7", now=100.25) for _ in range(3)]
    assert [isinstance(a, Admitted) for a in later] == [True, True, False]


def test_loopback_has_no_rate_but_is_still_counted() -> None:
    gate = make(per_ip=300, rate=1.0, burst=1)
    tickets = [gate.admit("127.0.0.1", now=0.0) for _ in range(300)]
    assert all(isinstance(t, Admitted) for t in tickets)
    assert isinstance(gate.admit("127.0.0.1", now=0.0), Refused)  # the count still binds
    gate.release(tickets[0])  # type: ignore[arg-type]
    assert isinstance(gate.admit("127.0.0.1", now=0.0), Admitted)


def test_an_ipv6_slash_64_is_one_host_and_a_slash_48_one_subnet() -> None:
    gate = make(per_ip=3, per_subnet=5, burst=1000)
    same_64 = [gate.admit(f"2001:db9:1:2::{i:x}", now=0.0) for i in range(4)]
    assert [isinstance(a, Admitted) for a in same_64] == [True, True, True, False]
    other_64s = [gate.admit(f"2001:db9:1:{i:x}::1", now=0.0) for i in range(3, 6)]
    # 3 + 2 fill the /48; the third /64 is refused for its subnet
    assert [isinstance(a, Admitted) for a in other_64s] == [True, True, False]
    assert "2001:db9:1::/48" in other_64s[-1].reason  # type: ignore[union-attr]
    assert isinstance(gate.admit("2001:db9:2::1", now=0.0), Admitted)  # another /48


def test_public_ipv4_neighbours_share_the_subnet_bound_and_bucket() -> None:
    gate = make(per_ip=100, per_subnet=6, rate=1.0, burst=2)
    # each host's burst is 2, the /24's is 4 x 2 = 8: hosts .1-.4 take 8 tokens, then
    # the subnet bound (6 connections) binds first
    results = [gate.admit(f"8.8.4.{i}", now=0.0) for i in (1, 1, 2, 2, 3, 3, 4)]
    assert [isinstance(r, Admitted) for r in results] == [True] * 6 + [False]
    assert "8.8.4.0/24" in results[-1].reason  # type: ignore[union-attr]
    for ticket in results[:6]:
        gate.release(ticket)  # type: ignore[arg-type]
    # connections are free again, tokens are not: the subnet has 2 of its 8 left
    more = [gate.admit(f"8.8.4.{i}", now=0.0) for i in (5, 6, 7)]
    assert [isinstance(r, Admitted) for r in more] == [True, True, False]
    assert "8.8.4.0/24 above their rate" in more[-1].reason  # type: ignore[union-attr]


def test_remembered_buckets_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "MAX_TRACKED_SOURCES", 50)
    gate = make(rate=1.0, burst=2)
    for i in range(1000):
        gate.admit(f"10.0.{i // 256}.{i % 256}", now=i * 0.001)
        assert gate.num_tracked_sources <= 50


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["127.0.0.1", "10.0.0.1", "8.8.8.8", "8.8.8.9", "2001:db8::1"]),
            st.booleans(),
        ),
        max_size=60,
    )
)
def test_counts_follow_admits_and_releases(events: list[tuple[str, bool]]) -> None:
    gate = make(per_ip=4, per_subnet=6, rate=5.0, burst=3)
    held: list[Admitted] = []
    for step, (ip, release) in enumerate(events):
        if release and held:
            gate.release(held.pop(0))
        result = gate.admit(ip, now=step * 0.1)
        if isinstance(result, Admitted):
            held.append(result)
        for probe in {ip for ip, _ in events}:
            live = sum(1 for h in held if h.source.host == source_of(probe).host)
            assert gate.connections_from(probe) == live <= 4
    for ticket in held:
        gate.release(ticket)
    assert all(gate.connections_from(ip) == 0 for ip, _ in events)


@pytest.mark.parametrize(
    "field",
    [
        "max_connections_per_subnet",
        "handshake_burst_per_ip",
        "handshake_rate_per_ip",
        "idle_connection_seconds",
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_config_refuses_bounds_that_admit_nothing(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        PeerConfig(**{field: value})  # type: ignore[arg-type]


def test_keepalive_settings_are_checked() -> None:
    for bad in (
        {"keepalive_interval": -1.0},
        {"keepalive_timeout": 0.0},
        {"keepalive_timeout": -2},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PeerConfig(**bad)  # type: ignore[arg-type]
    assert PeerConfig(keepalive_interval=0).keepalive_interval == 0  # off
