"""Peers behind real NAT (the namespace lab): AutoNAT, relays, hole punching.

Two public relays and three laptops, each behind its own home router and all three
with the same private address: two routers map endpoint-independently (hole punching
works), one is symmetric (it cannot). Every peer is a real process started with
``reachability="auto"``: nothing tells a laptop it is behind NAT.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm, PeerProcess

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(180)]

TARGET = "tests/peers/targets/nat.py:nat_peer"
PORT = 4001
#: Seconds for a verdict: AutoNAT dial-backs to a NATed address time out after 5 s
#: each; two servers, a loaded 2-core machine.
VERDICT_SECONDS = 40.0
REPLY_SECONDS = 60.0


@dataclass
class World:
    lab: Lab
    swarm: LocalSwarm
    relays: list[PeerProcess]
    laptops: list[PeerProcess]  # behind EIM, EIM, symmetric NAT


def ask(proc: PeerProcess, command: dict[str, Any], event: str) -> dict[str, Any]:
    proc.send(command)
    return proc.wait_report(event, REPLY_SECONDS)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with Lab() as lab, LocalSwarm() as swarm:
        relay_hosts = [lab.add_public_host(f"relay{i}") for i in range(2)]
        routers = [
            lab.add_home_router("home0", nat="endpoint-independent"),
            lab.add_home_router("home1", nat="endpoint-independent"),
            lab.add_home_router("home2", nat="symmetric"),
        ]
        laptop_hosts = [lab.add_lan_host(r, f"laptop{i}") for i, r in enumerate(routers)]
        assert len({h.address for h in laptop_hosts}) == 1  # one private address for all
        listen = {"listen": [f"/ip4/0.0.0.0/tcp/{PORT}"]}
        first = swarm.start(1, target=TARGET, options=listen, namespaces=[relay_hosts[0].namespace])
        second = swarm.start(
            1,
            target=TARGET,
            options={**listen, "bootstrap": first[0].addrs},
            namespaces=[relay_hosts[1].namespace],
        )
        relays = [*first, *second]
        for relay in relays:
            relay.wait_report("joined", REPLY_SECONDS)
        bootstrap = [first[0].addrs[0], second[0].addrs[0]]
        laptops = swarm.start(
            3,
            target=TARGET,
            options={**listen, "bootstrap": bootstrap},
            namespaces=[h.namespace for h in laptop_hosts],
        )
        for laptop in laptops:
            laptop.wait_report("joined", REPLY_SECONDS)
        yield World(lab, swarm, relays, laptops)


def test_relays_find_themselves_public(world: World) -> None:
    for relay in world.relays:
        status = ask(
            relay, {"cmd": "wait", "reachability": "public", "timeout": VERDICT_SECONDS}, "status"
        )
        assert status["reachability"] == "public", status
        assert all("/ip4/198.18." in a for a in status["listen_addrs"]), status


def test_laptops_find_themselves_private_and_reserve_on_both_relays(world: World) -> None:
    for laptop in world.laptops:
        status = ask(
            laptop,
            {"cmd": "wait", "reachability": "private", "min_relays": 2, "timeout": VERDICT_SECONDS},
            "status",
        )
        assert status["reachability"] == "private", status
        assert status["listen_addrs"] == [], status  # never the shared private address
        assert len(status["relays"]) == 2, status
        assert len(status["circuit_addrs"]) == 2, status
        assert all("/p2p-circuit/p2p/" in a for a in status["circuit_addrs"]), status
    # Two relays saw each laptop: the same port through the endpoint-independent
    # routers, a different port each through the symmetric one.
    mappings = [ask(laptop, {"cmd": "status"}, "status")["mapping"] for laptop in world.laptops]
    assert mappings == ["endpoint-independent", "endpoint-independent", "symmetric"], mappings


def circuit_addrs(laptop: PeerProcess) -> list[str]:
    status = ask(
        laptop,
        {"cmd": "wait", "reachability": "private", "min_relays": 2, "timeout": VERDICT_SECONDS},
        "status",
    )
    addrs: list[str] = status["circuit_addrs"]
    assert addrs, status
    return addrs


def test_hole_punch_between_endpoint_independent_nats(world: World) -> None:
    a, b, _ = world.laptops
    reply = ask(a, {"cmd": "dial", "addr": circuit_addrs(b)[0], "direct_within": 20.0}, "dialed")
    assert reply["ok"], reply
    assert reply["relayed"] is False, reply  # the relayed connection was upgraded
    punches = ask(b, {"cmd": "status"}, "status")["hole_punches"]
    assert any(p["success"] for p in punches if p["remote"] == a.peer_id), punches


def test_symmetric_nat_falls_back_to_the_relay(world: World) -> None:
    a, _, symmetric = world.laptops
    reply = ask(
        a, {"cmd": "dial", "addr": circuit_addrs(symmetric)[0], "direct_within": 8.0}, "dialed"
    )
    assert reply["ok"], reply  # streams work over the relay
    assert reply["relayed"] is True, reply
    status = ask(symmetric, {"cmd": "wait", "reachability": "private", "timeout": 0.1}, "status")
    assert status["connections"][a.peer_id] == "relayed", status


def test_a_relay_killed_under_a_reservation(world: World) -> None:
    _, b, symmetric = world.laptops
    addrs = circuit_addrs(symmetric)
    killed = world.relays[0]
    world.swarm.kill(killed)
    survivor = [a for a in addrs if killed.peer_id not in a.split("/p2p-circuit")[0]]
    assert survivor, addrs
    reply = ask(b, {"cmd": "dial", "addr": survivor[0], "direct_within": 0.0}, "dialed")
    assert reply["ok"], reply
    command = {"cmd": "wait", "reachability": "private", "max_relays": 1, "timeout": 20.0}
    status = ask(symmetric, command, "status")
    assert status["relays"] == [world.relays[1].peer_id], status
