"""Addresses learned from peers are dialed only where sensible (issue: security, item 6):
the pure rule, the bounded address book, and a hostile DHT peer in the namespace lab
that announces the victim's own loopback, a LAN it is not on, and a DNS name."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peers.address_book import MAX_ADDRESSES_PER_PEER, AddressBook
from peers.addresses import parse_multiaddr
from peers.dial_filter import LocalNetworks, dialable, refusal
from peers.identity import KeyPair
from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm

RELAY = KeyPair.from_seed(bytes(32)).peer_id
HOME = LocalNetworks(
    networks=(
        ipaddress.ip_network("127.0.0.0/8"),
        ipaddress.ip_network("192.168.1.0/24"),
        ipaddress.ip_network("fd00:1::/64"),
    ),
    loopback_only=False,
)
LOCAL_SWARM = LocalNetworks(networks=(ipaddress.ip_network("127.0.0.0/8"),), loopback_only=True)


def refused(text: str, local: LocalNetworks = HOME) -> str | None:
    return refusal(parse_multiaddr(text), local)


@pytest.mark.parametrize(
    "addr",
    [
        "/ip4/8.8.8.8/tcp/4001",
        "/ip6/2001:4860::8888/tcp/4001",
        "/ip4/192.168.1.20/tcp/4001",  # our own LAN
        "/ip6/fd00:1::5/tcp/4001",  # our own unique-local network
        "/ip4/198.18.0.3/tcp/4001",  # the namespace lab's internet
        "/ip4/198.19.0.2/tcp/4001",  # a lab LAN
        f"/ip4/8.8.8.8/tcp/4001/p2p/{RELAY}/p2p-circuit",
    ],
)
def test_public_addresses_and_our_own_networks_are_dialed(addr: str) -> None:
    assert refused(addr) is None


@pytest.mark.parametrize(
    ("addr", "why"),
    [
        ("/ip4/127.0.0.1/tcp/22", "loopback"),
        ("/ip6/::1/tcp/22", "loopback"),
        ("/ip6/::ffff:127.0.0.1/tcp/22", "loopback"),  # mapped: still our own machine
        ("/ip4/10.0.0.1/tcp/80", "private"),  # someone else's LAN (or our VPN's router)
        ("/ip4/192.168.2.1/tcp/80", "private"),
        ("/ip4/169.254.169.254/tcp/80", "private"),  # a cloud's metadata service
        ("/ip4/100.64.0.1/tcp/80", "private"),  # CGNAT
        ("/ip6/fe80::1/tcp/80", "private"),
        ("/ip4/203.0.113.7/tcp/80", "private"),  # documentation: never a peer
        ("/ip4/0.0.0.0/tcp/80", "unspecified"),
        ("/ip4/224.0.0.1/tcp/80", "multicast"),
        ("/ip4/255.255.255.255/tcp/80", "reserved"),
        ("/ip4/8.8.8.8/tcp/0", "port 0"),
        ("/dns4/localhost/tcp/22", "DNS"),
        ("/dns/example.com/tcp/4001", "DNS"),
        (f"/ip4/127.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit", "loopback"),  # by its relay
    ],
)
def test_what_a_peer_cannot_make_us_dial(addr: str, why: str) -> None:
    reason = refused(addr)
    assert reason is not None and why in reason, reason


def test_a_local_swarm_dials_loopback_and_nothing_private_it_is_not_on() -> None:
    assert refused("/ip4/127.0.0.1/tcp/4001", LOCAL_SWARM) is None
    assert refused("/ip4/127.0.0.5/tcp/4001", LOCAL_SWARM) is None
    assert refused("/ip4/10.0.0.1/tcp/80", LOCAL_SWARM) is not None
    assert refused("/dns4/localhost/tcp/4001", LOCAL_SWARM) is not None


def test_dialable_keeps_order_and_drops_only_the_refused() -> None:
    addrs = [
        parse_multiaddr(a)
        for a in ("/ip4/8.8.8.8/tcp/1", "/ip4/127.0.0.1/tcp/2", "/ip4/192.168.1.9/tcp/3")
    ]
    assert dialable(addrs, HOME) == [addrs[0], addrs[2]]


def test_this_machine_bound_to_loopback_alone_is_a_local_swarm() -> None:
    assert LocalNetworks.of_this_machine([parse_multiaddr("/ip4/127.0.0.1/tcp/1")]).loopback_only
    assert LocalNetworks.of_this_machine([]).loopback_only  # a client: no listener
    bound = [parse_multiaddr(a) for a in ("/ip4/127.0.0.1/tcp/1", "/ip4/192.0.2.1/tcp/1")]
    local = LocalNetworks.of_this_machine(bound)
    assert not local.loopback_only
    assert any(ipaddress.ip_address("127.0.0.1") in n for n in local.networks)


@given(
    st.ip_addresses(),
    st.integers(min_value=0, max_value=65535),
    st.booleans(),
)
def test_refusal_never_raises_and_public_ips_pass(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, loopback_only: bool
) -> None:
    family = "ip4" if ip.version == 4 else "ip6"
    local = LocalNetworks(networks=HOME.networks, loopback_only=loopback_only)
    reason = refusal(parse_multiaddr(f"/{family}/{ip}/tcp/{port}"), local)
    if ip.is_global and port and not (ip.is_multicast or ip.is_reserved):
        assert reason is None
    if port == 0 or ip.is_unspecified:
        assert reason is not None


def test_the_address_book_is_bounded_in_peers_and_keeps_what_the_user_gave() -> None:
    book = AddressBook(max_peers=3)
    user = KeyPair.generate().peer_id
    book.add(user, [parse_multiaddr("/ip4/8.8.8.8/tcp/1")], pin=True)
    learned = [KeyPair.generate().peer_id for _ in range(5)]
    for i, peer in enumerate(learned):
        book.add(peer, [parse_multiaddr(f"/ip4/8.8.4.{i}/tcp/1")])
    assert [book.get(p) != [] for p in learned] == [False, False, True, True, True]
    assert book.get(user) == [parse_multiaddr("/ip4/8.8.8.8/tcp/1")]
    assert len(book) == 4
    # Hearing of a peer again makes it the newest: the oldest other one goes.
    book.add(learned[2], [parse_multiaddr("/ip4/8.8.4.2/tcp/2")])
    book.add(KeyPair.generate().peer_id, [parse_multiaddr("/ip4/8.8.4.9/tcp/1")])
    assert book.get(learned[3]) == [] and len(book.get(learned[2])) == 2
    # Per peer, the newest few; a learned copy of a pinned address is listed once.
    many = [parse_multiaddr(f"/ip4/8.8.5.{i}/tcp/1") for i in range(40)]
    book.add(user, many)
    assert len(book.get(user)) == 1 + MAX_ADDRESSES_PER_PEER
    book.remove(user, parse_multiaddr("/ip4/8.8.8.8/tcp/1"))
    assert len(book.get(user)) == MAX_ADDRESSES_PER_PEER


AVAILABLE, REASON = lab_available()
TARGET = "tests/peers/targets/dial_probe.py:dial_probe_peer"
PORT = 4001
REPLY_SECONDS = 60.0


@pytest.mark.skipif(not AVAILABLE, reason=REASON)
@pytest.mark.timeout(120)
def test_a_hostile_peer_cannot_make_a_volunteer_dial_its_own_machine_or_lan() -> None:
    """The hostile peer announces (in every DHT request it sends) only addresses that
    lead into the victim: its loopback, where a canary listens, the same by a DNS name,
    and a LAN the victim is not on. The victim then dials the hostile peer by PeerID.
    Before the filter it connected to its own canary; now it dials none of them."""
    with Lab() as lab, LocalSwarm() as swarm:
        victim_host, hostile_host = (lab.add_public_host(n) for n in ("victim", "hostile"))
        (victim,) = swarm.start(
            1,
            target=TARGET,
            options={"listen": [f"/ip4/0.0.0.0/tcp/{PORT}"]},
            namespaces=[victim_host.namespace],
        )
        victim.wait_report("dht_ready", REPLY_SECONDS)
        victim.send({"cmd": "canary"})
        canary = victim.wait_report("canary", REPLY_SECONDS)["port"]
        lies = [
            f"/ip4/127.0.0.1/tcp/{canary}",
            f"/dns4/localhost/tcp/{canary}",
            "/ip4/10.77.0.1/tcp/22",
        ]
        victim_addr = f"/ip4/{victim_host.address}/tcp/{PORT}/p2p/{victim.peer_id}"
        (hostile,) = swarm.start(
            1,
            target=TARGET,
            options={
                "peer_config": {"announce_addrs": lies},
                "initial_peers": [victim_addr],
            },
            namespaces=[hostile_host.namespace],
        )
        hostile.wait_report("dht_ready", REPLY_SECONDS)
        swarm.terminate(hostile)  # the victim can only dial what it was told

        victim.send({"cmd": "ping", "peer_id": hostile.peer_id})
        pinged = victim.wait_report("pinged", REPLY_SECONDS)
        assert not pinged["ok"] and "no known address" in pinged["error"], pinged
        victim.send({"cmd": "canary_count"})
        assert victim.wait_report("canary_count", REPLY_SECONDS)["count"] == 0
        victim.send({"cmd": "statistics"})
        assert victim.wait_report("statistics", REPLY_SECONDS)["num_addresses_refused"] >= 3
