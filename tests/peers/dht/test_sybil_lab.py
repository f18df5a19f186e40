"""Many cheap identities on one machine against a DHT node, over real TCP between
network namespaces (issue: security, item 4): they get a bounded share of its routing
table and one network's share of its storage, and an honest peer elsewhere is
unaffected."""

from __future__ import annotations

import pytest

from peers.dht.routing import MAX_PER_SOURCE
from peers.dht.storage import MAX_RECORDS_PER_SOURCE
from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(180)]

TARGET = "tests/peers/targets/dht_sybil.py:dht_node"
PORT = 4001
REPLY_SECONDS = 90.0
SYBILS = 16
RECORDS_EACH = 200  # 16 x 200 = 3,200: past one source's 2,048, far below 16 quotas


def test_sybils_on_one_host_get_one_networks_share_of_a_dht_node() -> None:
    with Lab() as lab, LocalSwarm() as swarm:
        hosts = [lab.add_public_host(name) for name in ("victim", "sybil", "honest")]
        (victim,) = swarm.start(
            1,
            target=TARGET,
            options={"listen": [f"/ip4/0.0.0.0/tcp/{PORT}"]},
            namespaces=[hosts[0].namespace],
        )
        victim.wait_report("dht_ready", REPLY_SECONDS)
        victim_addr = f"/ip4/{hosts[0].address}/tcp/{PORT}/p2p/{victim.peer_id}"
        joined = {"listen": ["/ip4/0.0.0.0/tcp/0"], "initial_peers": [victim_addr]}
        sybil, honest = swarm.start(
            2, target=TARGET, options=joined, namespaces=[hosts[1].namespace, hosts[2].namespace]
        )
        for proc in (sybil, honest):
            proc.wait_report("dht_ready", REPLY_SECONDS)

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
