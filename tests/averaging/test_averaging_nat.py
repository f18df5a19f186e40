"""Averaging rounds among laptops behind NAT (the namespace lab), with a public bootstrap
peer that does not average and only relays.

Three laptops behind endpoint-independent routers and one behind a symmetric router,
all four with the same private address. The three find themselves private but
punchable: they announce relayed addresses, take a share of each butterfly round, and
the members reach them through the relay first, then over punched direct connections.
The symmetric one stays a client (reduces nothing), reached only through the relay.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(240)]

TARGET = f"{Path(__file__).parent / 'targets' / 'nat_averager.py'}:nat_averager"
REPORT_TIMEOUT = 90.0
ROUNDS = 3


def test_laptops_behind_nat_reduce_their_share_over_punched_connections() -> None:
    with Lab() as lab, LocalSwarm() as swarm:
        boot_host = lab.add_public_host("boot")
        kinds = ["endpoint-independent"] * 3 + ["symmetric"]
        laptops = [
            lab.add_lan_host(lab.add_home_router(f"home{i}", nat=kind), f"laptop{i}")
            for i, kind in enumerate(kinds)
        ]
        (boot,) = swarm.start(
            1,
            target="peers.dht.testing:dht_node",
            options={"listen": ["/ip4/0.0.0.0/tcp/4001"]},
            namespaces=[boot_host.namespace],
        )
        boot.wait_report("joined", REPORT_TIMEOUT)
        procs = swarm.start(
            4,
            target=TARGET,
            options={"initial_peers": [boot.maddr], "listen": ["/ip4/0.0.0.0/tcp/4001"]},
            per_peer_options=[{"rank": i} for i in range(4)],
            namespaces=[h.namespace for h in laptops],
        )
        for proc in procs:
            proc.wait_report("joined", REPORT_TIMEOUT)
        states = []
        for proc in procs:
            proc.send({"op": "wait_nat", "timeout": 60.0})
            states.append(proc.wait_report("nat", REPORT_TIMEOUT))
        assert [s["reachability"] for s in states] == ["private"] * 4, states
        assert [s["punchable"] for s in states] == [True, True, True, False], states
        punchable = {p.peer_id for p in procs[:3]}
        symmetric = procs[3].peer_id
        for round_key in range(ROUNDS):
            for proc in procs:
                proc.send({"op": "step", "round_key": round_key, "timeout": 60.0})
            reports = [proc.wait_report("stepped", 120.0) for proc in procs]
            for r in reports:
                print("round", round_key, "reduced", r["reduced"], "connections", r["connections"])
            assert len({r["fingerprint"] for r in reports}) == 1, reports  # one result
            for r in reports:
                assert r["agreed"] and not r["failed"], r
                assert len(r["members"]) == 4, r
                # The round's part sizes: the three punchable laptops reduce, each a
                # real share; the symmetric one and the bootstrap peer reduce nothing.
                shares = {peer for peer, size in r["reduced"].items() if size > 0}
                assert shares == punchable, r
                assert r["reduced"].get(symmetric, 0) == 0, r
        # Between punchable laptops the connections were made direct; the symmetric one
        # is reached through the relay.
        for proc in procs[:3]:
            connections = reports[procs.index(proc)]["connections"]
            for other in punchable - {proc.peer_id}:
                assert connections.get(other) == "direct", (proc.peer_id, connections)
            assert connections.get(symmetric) == "relayed", connections
