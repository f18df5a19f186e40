"""DHT swarms of real processes: cold start, lookup quality, churn."""

from __future__ import annotations

import random

from peers.dht.ids import distance, node_id_of
from peers.identity import PeerID
from peers.testing import LocalSwarm, PeerProcess

TARGET = "peers.dht.testing:dht_node"
OPTIONS = {"rpc_timeout": 2.0, "maintenance_interval": 3600.0}


def _start_swarm(swarm: LocalSwarm, num_peers: int) -> tuple[list[PeerProcess], list[PeerProcess]]:
    """Two bootstrap nodes, then ``num_peers`` started at the same moment from both."""
    (first,) = swarm.start(1, target=TARGET, options=OPTIONS)
    first.wait_report("joined", 30)
    (second,) = swarm.start(1, target=TARGET, options={**OPTIONS, "initial_peers": [first.maddr]})
    second.wait_report("joined", 30)
    initial = [first.maddr, second.maddr]
    peers = swarm.start(num_peers, target=TARGET, options={**OPTIONS, "initial_peers": initial})
    for p in peers:
        p.wait_report("joined", 60)
    return [first, second], peers


def test_cold_start_forms_one_dht() -> None:
    """32 processes started at once from the same initial peers: every one of them can
    find every other's record (no split into separate DHTs). Once, over real sockets:
    the races of many joins at once are tried seed by seed on the in-memory network
    (test_memory_dht.py), where a run is seconds and replays exactly."""
    run = 0
    with LocalSwarm() as swarm:
        _, peers = _start_swarm(swarm, 32)
        for p in peers:
            p.send({"op": "store", "items": [[f"record-of-{p.peer_id}", p.peer_id]], "ttl": 300})
        for p in peers:
            assert p.wait_report("stored", 60)["ok"] == 1
        keys = [f"record-of-{p.peer_id}" for p in peers]
        for p in peers:
            p.send({"op": "get", "keys": keys, "timeout": 20})
        for p in peers:
            got = p.wait_report("got", 120)
            missing = [k for k in keys if got["values"][k] != k.removeprefix("record-of-")]
            assert not missing, f"run {run}: {p.peer_id} cannot find {len(missing)} records"


def test_lookups_return_the_true_nearest() -> None:
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    with LocalSwarm() as swarm:
        boots, peers = _start_swarm(swarm, 48)
        everyone = boots + peers
        (fresh,) = swarm.start(
            1, target=TARGET, options={**OPTIONS, "initial_peers": [boots[0].maddr]}
        )
        fresh.wait_report("joined", 60)
        targets = [rng.getrandbits(256) for _ in range(30)]
        fresh.send({"op": "nearest", "targets": [f"{t:x}" for t in targets], "count": 20})
        found = fresh.wait_report("nearest", 120)["found"]
    ids = {p.peer_id: node_id_of(PeerID.from_base58(p.peer_id)) for p in everyone}
    top1 = 0
    recall = []
    for target, result in zip(targets, found, strict=True):
        truth = sorted(ids, key=lambda pid: distance(ids[pid], target))[:20]
        top1 += bool(result) and result[0] == truth[0]
        recall.append(len(set(result) & set(truth)) / len(truth))
    mean_recall = sum(recall) / len(recall)
    print(f"top-1 accuracy {top1 / len(targets):.2f}, mean top-20 recall {mean_recall:.2f}")
    assert top1 / len(targets) >= 0.9
    assert mean_recall >= 0.9


def test_records_survive_killing_30_percent() -> None:
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    with LocalSwarm() as swarm:
        boots, peers = _start_swarm(swarm, 30)
        everyone = boots + peers
        items = [[f"key-{i}", f"value-{i}"] for i in range(1000)]
        writers = rng.sample(everyone, 8)
        for i, w in enumerate(writers):
            w.send({"op": "store", "items": items[i::8], "ttl": 600})
        assert sum(w.wait_report("stored", 120)["ok"] for w in writers) == 1000
        victims = rng.sample(everyone, 10)  # 30% of 32, bootstrap nodes included
        for v in victims:
            swarm.kill(v)
        survivors = [p for p in everyone if p not in victims]
        readers = rng.sample(survivors, 4)
        timeout = 10.0
        for i, r in enumerate(readers):
            r.send({"op": "get", "keys": [k for k, _ in items[i::4]], "timeout": timeout})
        found = 0
        for r in readers:
            got = r.wait_report("got", 300)
            assert got["timeouts"] == 0 and got["max_seconds"] < timeout
            found += sum(
                1 for k, v in got["values"].items() if v == "value-" + k.removeprefix("key-")
            )
    print(f"{found}/1000 records found after killing {len(victims)} of {len(everyone)} peers")
    assert found >= 990
