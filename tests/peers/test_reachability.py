"""Address hygiene: what a peer decides about its own reachability, and what it announces."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from multiaddr import Multiaddr

from peers import Peer, PeerConfig, split_peer_id, with_peer_id
from peers.address_book import expand_wildcard
from peers.identify import addrs_for
from peers.identity import KeyPair
from peers.reachability import (
    MAX_OBSERVED_ADDRS,
    RESULT_TTL_SECONDS,
    Reachability,
    ReachabilityTracker,
    is_public_candidate,
)

Run = Callable[[Coroutine[Any, Any, Any]], Any]

SERVERS = [KeyPair.from_seed(bytes([i]) * 32).peer_id for i in range(1, 6)]
WAN = Multiaddr("/ip4/198.18.0.10/tcp/4001")


def test_candidates_exclude_loopback_wildcards_and_relays() -> None:
    assert is_public_candidate(WAN)
    assert is_public_candidate(Multiaddr("/dns4/example.org/tcp/4001"))
    for addr in (
        "/ip4/127.0.0.1/tcp/4001",
        "/ip4/0.0.0.0/tcp/4001",
        "/ip6/::1/tcp/4001",
        "/ip6/fe80::1/tcp/4001",
        f"/ip4/198.18.0.1/tcp/1/p2p/{SERVERS[0]}/p2p-circuit",
        "/ip4/198.18.0.1/udp/1",
    ):
        assert not is_public_candidate(Multiaddr(addr)), addr


def test_one_dial_back_that_worked_makes_us_public() -> None:
    tracker = ReachabilityTracker()
    assert tracker.reachability(0.0) == Reachability.UNKNOWN
    tracker.dial_back(SERVERS[0], ok=True, addr=WAN, now=0.0)
    assert tracker.reachability(1.0) == Reachability.PUBLIC
    assert tracker.confirmed_addrs(1.0) == [WAN]


def test_private_needs_two_servers_unless_only_one_exists() -> None:
    tracker = ReachabilityTracker()
    tracker.dial_back(SERVERS[0], ok=False, addr=None, now=0.0)
    assert tracker.reachability(1.0) == Reachability.UNKNOWN  # one hostile server is not enough
    assert tracker.reachability(1.0, num_servers_known=1) == Reachability.PRIVATE
    tracker.dial_back(SERVERS[1], ok=False, addr=None, now=0.0)
    assert tracker.reachability(1.0) == Reachability.PRIVATE
    assert tracker.confirmed_addrs(1.0) == []


def test_a_verdict_holds_when_another_server_is_found_until_it_answers() -> None:
    """A laptop that knew one server (its bootstrap) is private; finding a second server
    does not send it back to "unknown" (announcing its private address for the seconds
    the next dial-back takes): the second one's answer decides."""
    tracker = ReachabilityTracker()
    tracker.dial_back(SERVERS[0], ok=False, addr=None, now=0.0)
    assert tracker.reachability(1.0, num_servers_known=1) == Reachability.PRIVATE
    assert tracker.reachability(2.0, num_servers_known=2) == Reachability.PRIVATE
    tracker.dial_back(SERVERS[1], ok=True, addr=WAN, now=3.0)
    assert tracker.reachability(4.0, num_servers_known=2) == Reachability.PUBLIC
    # with every answer expired, nothing is known any more
    assert tracker.reachability(3.0 + RESULT_TTL_SECONDS + 1.0) == Reachability.UNKNOWN


def test_a_lying_server_cannot_outvote_dial_backs_that_worked() -> None:
    tracker = ReachabilityTracker()
    tracker.dial_back(SERVERS[0], ok=True, addr=WAN, now=0.0)
    tracker.dial_back(SERVERS[1], ok=False, addr=None, now=0.0)
    assert tracker.reachability(1.0) == Reachability.PUBLIC
    # A server's newer answer replaces its older one: one server is one vote.
    tracker.dial_back(SERVERS[1], ok=False, addr=None, now=2.0)
    assert tracker.num_servers_asked(3.0) == 2


def test_answers_expire() -> None:
    tracker = ReachabilityTracker()
    tracker.dial_back(SERVERS[0], ok=True, addr=WAN, now=0.0)
    later = RESULT_TTL_SECONDS + 1.0
    assert tracker.reachability(later) == Reachability.UNKNOWN
    assert not tracker.has_answer_from(SERVERS[0], later)


def test_observed_addresses_are_bounded_and_ranked_by_observers() -> None:
    tracker = ReachabilityTracker()
    for server in SERVERS[:3]:
        tracker.observed(WAN, server)
    tracker.observed(Multiaddr("/ip4/127.0.0.1/tcp/4001"), SERVERS[0])  # ignored
    for i in range(MAX_OBSERVED_ADDRS * 2):  # one remote claiming many addresses
        tracker.observed(Multiaddr(f"/ip4/198.18.1.{i}/tcp/4001"), SERVERS[4])
    observed = tracker.observed_addrs()
    assert observed[0] == WAN
    assert len(observed) <= MAX_OBSERVED_ADDRS


def test_wildcard_expands_to_interface_addresses() -> None:
    expanded = [str(a) for a in expand_wildcard(Multiaddr("/ip4/0.0.0.0/tcp/4001"))]
    assert "/ip4/127.0.0.1/tcp/4001" in expanded
    assert all(a.endswith("/tcp/4001") and "0.0.0.0" not in a for a in expanded)


def test_a_private_peer_announces_no_direct_address(arun: Run) -> None:
    async def main() -> None:
        async with Peer(PeerConfig(reachability="private", use_relays=False)) as peer:
            assert peer.listen_addrs == []
            assert peer.bound_addrs()  # it still listens
            assert peer.advertised_addrs == []
        async with Peer(PeerConfig(reachability="private", announce_addrs=(str(WAN),))) as peer:
            assert [split_peer_id(a)[0] for a in peer.listen_addrs] == [WAN]  # said, kept

    arun(main())


def test_loopback_is_never_announced_to_a_remote_machine(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as peer:
            local = Multiaddr("/ip4/127.0.0.1/tcp/5000")
            remote = Multiaddr("/ip4/198.18.0.7/tcp/5000")
            assert addrs_for(peer, local) == peer.advertised_addrs  # loopback for loopback
            assert all("127.0.0.1" not in str(a) for a in addrs_for(peer, remote))

    arun(main())


def test_an_address_that_leads_to_another_peer_is_forgotten_quietly(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as target, Peer() as impostor, Peer() as dialer:
            # Two LANs with one private address: the address we were told leads to
            # someone else. The dial goes on to the next address and succeeds.
            wrong = split_peer_id(impostor.listen_addrs[0])[0]
            right = split_peer_id(target.listen_addrs[0])[0]
            dialer.add_addresses(target.peer_id, [wrong, right])
            assert await dialer.ping(target.peer_id) > 0
            assert wrong not in dialer.known_addresses(target.peer_id)
            assert right in dialer.known_addresses(target.peer_id)
            assert dialer.connection_to(impostor.peer_id) is None  # nothing kept open
            # The dialer keeps working with the impostor under its own name.
            assert await dialer.ping(with_peer_id(wrong, impostor.peer_id)) > 0

    arun(main())


def test_describe_says_how_a_peer_is_connected() -> None:
    from peers.nat import NatStatistics, describe
    from peers.reachability import NatMapping

    relay = SERVERS[0]
    behind = NatStatistics(
        reachability=Reachability.PRIVATE,
        mapping=NatMapping.ENDPOINT_INDEPENDENT,
        confirmed_addrs=(),
        observed_addrs=(WAN,),
        relays=(relay, SERVERS[1]),
        circuit_addrs=(),
        num_relayed_connections=1,
        num_direct_connections=3,
    )
    assert describe(behind, 2) == (
        "behind NAT (endpoint-independent): reachable through 2 relays;"
        " direct to 3 of 4 peers (2 by hole punching)"
    )
    public = NatStatistics(
        reachability=Reachability.PUBLIC,
        mapping=NatMapping.UNKNOWN,
        confirmed_addrs=(WAN,),
        observed_addrs=(WAN,),
        relays=(),
        circuit_addrs=(),
        num_relayed_connections=0,
        num_direct_connections=1,
    )
    assert describe(public) == f"public: reachable at {WAN}; direct to 1 of 1 peers"


def test_mapping_is_judged_from_what_remotes_saw() -> None:
    from peers.reachability import NatMapping

    tracker = ReachabilityTracker()
    assert tracker.mapping() == NatMapping.UNKNOWN
    tracker.observed(WAN, SERVERS[0])
    assert tracker.mapping() == NatMapping.UNKNOWN  # one remote says nothing about mapping
    tracker.observed(WAN, SERVERS[1])
    assert tracker.mapping() == NatMapping.ENDPOINT_INDEPENDENT

    symmetric = ReachabilityTracker()
    symmetric.observed(Multiaddr("/ip4/198.18.0.10/tcp/50001"), SERVERS[0])
    symmetric.observed(Multiaddr("/ip4/198.18.0.10/tcp/61234"), SERVERS[1])
    assert symmetric.mapping() == NatMapping.SYMMETRIC
