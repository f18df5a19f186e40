"""A pipeline whose stage servers sit behind home routers (the namespace lab).

A public bootstrap peer, a stage server on a public host, two stage servers behind NAT
(one endpoint-independent, one symmetric; both with the same private address), and a
pipeline client on another public host that dials out only. The servers behind NAT find
themselves private, reserve on the bootstrap peer (a relay by default) and announce
relayed addresses; the client trains through them.
"""

from __future__ import annotations

import math

import pytest

from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm, PeerProcess

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(240)]

REPORT_TIMEOUT = 90.0
LISTEN = ["/ip4/0.0.0.0/tcp/4001"]


def stats(proc: PeerProcess) -> dict[str, object]:
    proc.send({"op": "stats"})
    return proc.wait_report("stats", REPORT_TIMEOUT)


def test_stage_servers_behind_nat_serve_a_pipeline_client() -> None:
    with Lab() as lab, LocalSwarm() as swarm:
        boot_host, server_host, client_host = (
            lab.add_public_host(name) for name in ("boot", "server0", "client")
        )
        homes = [
            lab.add_home_router("home1", nat="endpoint-independent"),
            lab.add_home_router("home2", nat="symmetric"),
        ]
        laptops = [lab.add_lan_host(home, f"gpu{i}") for i, home in enumerate(homes, 1)]
        (boot,) = swarm.start(
            1,
            target="peers.dht.testing:dht_node",
            options={"listen": LISTEN},
            namespaces=[boot_host.namespace],
        )
        boot.wait_report("joined", REPORT_TIMEOUT)
        options = {
            "initial_peers": [boot.maddr],
            "optimizer": "adam",
            "lr": 3e-3,
            "announce_interval": 1.0,
            "listen": LISTEN,
        }
        servers = swarm.start(
            3,
            target="swarm.pipeline.testing:stage_server",
            options=options,
            per_peer_options=[{"stage": i} for i in range(3)],
            namespaces=[server_host.namespace, *(h.namespace for h in laptops)],
        )
        for server in servers:
            server.wait_report("serving", REPORT_TIMEOUT)
        for server in servers[1:]:  # behind NAT: wait until they know and announce it
            server.send({"op": "wait_private", "timeout": 60.0})
            report = server.wait_report("stats", REPORT_TIMEOUT)
            addrs = report["advertised_addrs"]
            assert report["reachability"] == "private", report
            assert isinstance(addrs, list) and addrs, report
            assert all("/p2p-circuit" in a for a in addrs), report
        (client,) = swarm.start(
            1,
            target="tests/swarm/targets/pipeline_client.py:pipeline_client",
            options={"initial_peers": [boot.maddr], "steps": 6},
            namespaces=[client_host.namespace],
        )
        trained = client.wait_report("trained", 180.0)
        losses = trained["losses"]
        assert len(losses) == 12 and all(math.isfinite(x) for x in losses), trained
        relayed = trained["relayed"]
        for server in servers[1:]:
            report = stats(server)
            assert report["forward_samples"] > 0 and report["backward_samples"] > 0, report
            assert relayed.get(server.peer_id) is True, trained  # reached through the relay
