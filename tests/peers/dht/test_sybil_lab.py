"""Many cheap identities on one machine against a DHT node, over real TCP between
network namespaces (issue: security, item 4): they get a bounded share of its routing
table and one network's share of its storage, and an honest peer elsewhere is
unaffected."""

from __future__ import annotations

import pytest

from peers.dht.lookup import MAX_RESULTS_PER_SOURCE
from peers.dht.routing import MAX_PER_SOURCE
from peers.dht.storage import MAX_RECORDS_PER_SOURCE
from peers.netlab import Lab, lab_available
from peers.netlab.hosts import PublicHost
from peers.testing import LocalSwarm, PeerProcess

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(180)]

TARGET = "tests/peers/targets/dht_sybil.py:dht_node"
PORT = 4001
REPLY_SECONDS = 90.0
SYBILS = 16
RECORDS_EACH = 200  # 16 x 200 = 3,200: past one source's 2,048, far below 16 quotas


def _first_node(swarm: LocalSwarm, host: PublicHost) -> tuple[PeerProcess, str]:
    """The DHT's first node, on ``host`` at a fixed port; it and its full address."""
    (first,) = swarm.start(
        1,
        target=TARGET,
        options={"listen": [f"/ip4/0.0.0.0/tcp/{PORT}"]},
        namespaces=[host.namespace],
    )
    first.wait_report("dht_ready", REPLY_SECONDS)
    return first, f"/ip4/{host.address}/tcp/{PORT}/p2p/{first.peer_id}"


def _joined(swarm: LocalSwarm, via: str, hosts: list[PublicHost]) -> list[PeerProcess]:
    """A DHT node on each of ``hosts``, joined through ``via`` and ready."""
    joined = {"listen": ["/ip4/0.0.0.0/tcp/0"], "initial_peers": [via]}
    nodes = swarm.start(
        len(hosts), target=TARGET, options=joined, namespaces=[h.namespace for h in hosts]
    )
    for node in nodes:
        node.wait_report("dht_ready", REPLY_SECONDS)
    return nodes


def test_sybils_on_one_host_get_one_networks_share_of_a_dht_node() -> None:
    with Lab() as lab, LocalSwarm() as swarm:
        hosts = [lab.add_public_host(name) for name in ("victim", "sybil", "honest")]
        victim, victim_addr = _first_node(swarm, hosts[0])
        sybil, honest = _joined(swarm, victim_addr, hosts[1:])

        sybil.send(
            {"cmd": "sybils", "count": SYBILS, "victim": victim_addr, "records": RECORDS_EACH}
        )
        attack = sybil.wait_report("sybils", REPLY_SECONDS)
        # One network's quota, not sixteen identities' (before: all 3,200 were held).
        assert attack["accepted"] <= MAX_RECORDS_PER_SOURCE, attack["accepted"]

        victim.send({"cmd": "table"})
        table = victim.wait_report("table", REPLY_SECONDS)
        from_sybil_host = set(table["contacts"]) & {sybil.peer_id, *attack["peer_ids"]}
        # Before: every identity that called took a place (17 of the table's 18).
        assert len(from_sybil_host) <= MAX_PER_SOURCE, table
        assert honest.peer_id in table["contacts"], table
        assert table["num_contacts_refused_by_source"] >= SYBILS + 1 - MAX_PER_SOURCE

        # The honest host's records are its own network's share: all accepted.
        honest.send({"cmd": "sybils", "count": 1, "victim": victim_addr, "records": 100})
        assert honest.wait_report("sybils", REPLY_SECONDS)["accepted"] == 100


ECLIPSERS = 12  # more than a key's 8 replicas: without a limit they would be all of them
KEY = "run/progress"


def test_ids_ground_near_a_key_from_one_host_cannot_eclipse_it() -> None:
    """Twelve identities on one host, their ids ground near a key's, swallow every
    store and answer every lookup with each other (an eclipse of the key). Five honest
    hosts: one stores under the key, another gets it. A lookup's result holds at most
    two nodes of one network, so the store reaches honest replicas and the get finds
    the value (before: the key's nearest nodes were all eclipsers; the store vanished
    and the get found nothing)."""
    with Lab() as lab, LocalSwarm() as swarm:
        hosts = [lab.add_public_host(f"honest{i}") for i in range(5)]
        attacker_host = lab.add_public_host("eclipser")
        _, first_addr = _first_node(swarm, hosts[0])
        (attacker,) = _joined(swarm, first_addr, [attacker_host])
        attacker.send({"cmd": "eclipse", "count": ECLIPSERS, "key": KEY, "via": first_addr})
        eclipsers = set(attacker.wait_report("eclipse", REPLY_SECONDS)["peer_ids"])
        honest = _joined(swarm, first_addr, hosts[1:])

        honest[0].send({"cmd": "store", "key": KEY, "value": "epoch 7"})
        stored = honest[0].wait_report("store", REPLY_SECONDS)
        assert stored["accepted"], stored
        held = eclipsers & set(stored["nearest"])
        assert 1 <= len(held) <= MAX_RESULTS_PER_SOURCE, stored  # they were found, and held to two
        for proc in honest[1:]:
            proc.send({"cmd": "get", "key": KEY})
            assert proc.wait_report("get", REPLY_SECONDS)["value"] == "epoch 7"
