"""Matchmaking among real processes: one group of 8, and a leader SIGKILLed mid-search.
Each process runs a DHT node and a Matchmaker (tests/averaging/targets/matchmaking_node.py)
and joins through one bootstrap node. Balanced splits, client-mode members and larger
swarms at internet latency run on the in-memory network (test_memory_matchmaking.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from averaging.matchmaking.records import rank
from peers.identity import PeerID
from peers.testing import LocalSwarm, PeerProcess

TARGET = f"{Path(__file__).parent / 'targets' / 'matchmaking_node.py'}:matchmaking_node"
BOOTSTRAP = "peers.dht.testing:dht_node"
CONFIG = {
    "target_group_size": 8,
    "min_group_size": 2,
    "search_timeout": 20.0,
    "gather_timeout": 3.0,
    "request_timeout": 3.0,
    "poll_interval_seconds": 0.25,
}
#: Seconds a process may report after its own search timeout (a loaded 2-core machine).
SLACK_SECONDS = 5.0


def _start(swarm: LocalSwarm, num_peers: int, config: dict[str, Any]) -> list[PeerProcess]:
    (boot,) = swarm.start(
        1, target=BOOTSTRAP, options={"rpc_timeout": 2.0, "maintenance_interval": 3600.0}
    )
    boot.wait_report("joined", 60)
    procs = swarm.start(
        num_peers,
        target=TARGET,
        options={"initial_peers": [boot.maddr], "config": config},
    )
    for p in procs:
        p.wait_report("joined", 60)
    return procs


def _outcome(proc: PeerProcess, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        report = proc.next_report(max(0.0, deadline - time.monotonic()))
        if report.get("event") in ("group", "failed"):
            return report


def _look(procs: list[PeerProcess], key: str, timeout: float) -> list[dict[str, Any]]:
    for p in procs:  # sent back to back: the searches start within milliseconds
        p.send({"op": "look", "key": key, "timeout": timeout})
    return [_outcome(p, timeout + SLACK_SECONDS + 30) for p in procs]


def _groups(procs: list[PeerProcess], outcomes: list[dict[str, Any]]) -> dict[str, list[str]]:
    """round id -> members, checking that every member got the same group and is in it."""
    groups: dict[str, list[str]] = {}
    for proc, outcome in zip(procs, outcomes, strict=True):
        if outcome["event"] != "group":
            continue
        assert proc.peer_id in outcome["members"]
        assert outcome["metadata_ok"]
        assert groups.setdefault(outcome["round_id"], outcome["members"]) == outcome["members"]
    for members in groups.values():  # each member of a group reported that very group
        for member in members:
            (outcome,) = [o for p, o in zip(procs, outcomes, strict=True) if p.peer_id == member]
            assert outcome["event"] == "group" and outcome["members"] == members
    return groups


@pytest.mark.timeout(240)
def test_eight_processes_form_one_group_every_time() -> None:
    with LocalSwarm() as swarm:
        procs = _start(swarm, 8, CONFIG)
        for i in range(3):
            outcomes = _look(procs, f"round-{i}", 20.0)
            assert all(o["event"] == "group" for o in outcomes), outcomes
            groups = _groups(procs, outcomes)
            assert len(groups) == 1, groups
            (members,) = groups.values()
            assert sorted(members) == sorted(p.peer_id for p in procs)
            print(f"round {i}: {max(o['seconds'] for o in outcomes):.2f} s")


@pytest.mark.timeout(240)
def test_leader_killed_mid_search_never_hangs_the_others() -> None:
    config = {**CONFIG, "target_group_size": 6, "gather_timeout": 4.0}
    timeout = 15.0
    with LocalSwarm() as swarm:
        procs = _start(swarm, 6, config)
        key = "killed-leader"
        leader = min(procs, key=lambda p: rank(key, PeerID.from_base58(p.peer_id)))
        for p in procs:
            p.send({"op": "look", "key": key, "timeout": timeout})
        time.sleep(1.5)  # inside the gather window: the others have joined it by now
        swarm.kill(leader)
        survivors = [p for p in procs if p is not leader]
        outcomes = [_outcome(p, timeout + SLACK_SECONDS + 30) for p in survivors]
        for outcome in outcomes:
            print(outcome["event"], outcome.get("error", ""), f"{outcome['seconds']:.2f} s")
            assert outcome["seconds"] <= timeout + SLACK_SECONDS
        groups = _groups(survivors, outcomes)
        for members in groups.values():
            assert leader.peer_id not in members
        failed = [o for o in outcomes if o["event"] == "failed"]
        assert all("no group under key 'killed-leader'" in o["error"] for o in failed)
