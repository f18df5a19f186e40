"""The DHT over internet-like links (the namespace lab with link shapes): nodes on hosts
80 ms apart (20 ms each way at each end), 100 Mbit/s. Correctness, not speed: every
value stored is found by every other node, and a lookup returns the true nearest."""

from __future__ import annotations

import random

import pytest

from peers.dht.ids import distance, node_id_of
from peers.identity import PeerID
from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(180)]

TARGET = "peers.dht.testing:dht_node"
NUM_NODES = 10
REPORT_TIMEOUT = 60.0
LISTEN = {"listen": ["/ip4/0.0.0.0/tcp/4001"]}
KEYS_PER_WRITER = 10


def test_ten_nodes_80_ms_apart_find_every_value_and_the_true_nearest() -> None:
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    with Lab() as lab, LocalSwarm() as swarm:
        hosts = [lab.add_public_host(f"n{i}", rate_mbit=100) for i in range(NUM_NODES)]
        for i, host in enumerate(hosts):
            lab.delay(host, one_way_ms=20, seed=i)
        (boot,) = swarm.start(1, target=TARGET, options=LISTEN, namespaces=[hosts[0].namespace])
        boot.wait_report("joined", REPORT_TIMEOUT)
        nodes = swarm.start(
            NUM_NODES - 1,
            target=TARGET,
            options={**LISTEN, "initial_peers": [boot.maddr]},
            namespaces=[h.namespace for h in hosts[1:]],
        )
        for node in nodes:
            node.wait_report("joined", REPORT_TIMEOUT)
        everyone = [boot, *nodes]

        writers = nodes[:2]
        items = {
            w.peer_id: [
                [f"wan/{w.peer_id}/{i}", f"value {i} of {w.peer_id}"]
                for i in range(KEYS_PER_WRITER)
            ]
            for w in writers
        }
        for writer in writers:
            writer.send({"op": "store", "items": items[writer.peer_id], "ttl": 300})
        for writer in writers:
            assert writer.wait_report("stored", REPORT_TIMEOUT)["ok"] == KEYS_PER_WRITER

        expected = {key: value for pairs in items.values() for key, value in pairs}
        for node in everyone:
            node.send({"op": "get", "keys": sorted(expected), "timeout": 20})
        for node in everyone:
            got = node.wait_report("got", REPORT_TIMEOUT)
            assert got["timeouts"] == 0, (node.peer_id, got)
            assert got["values"] == expected, node.peer_id

        targets = [rng.getrandbits(256) for _ in range(10)]
        reader = nodes[-1]
        reader.send({"op": "nearest", "targets": [f"{t:x}" for t in targets], "count": 8})
        found = reader.wait_report("nearest", REPORT_TIMEOUT)["found"]
    # A lookup returns others: the reader itself is not among them.
    ids = {
        p.peer_id: node_id_of(PeerID.from_base58(p.peer_id)) for p in everyone if p is not reader
    }
    for target, result in zip(targets, found, strict=True):
        truth = sorted(ids, key=lambda pid: distance(ids[pid], target))[:8]
        assert result == truth, (f"{target:x}", result, truth)
