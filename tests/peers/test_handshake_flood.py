"""A handshake flood from one host, over real TCP between network namespaces: the
victim runs whole handshakes for at most its burst plus its rate, refuses the rest at
accept, and keeps serving everyone else (issue: security, transport limits)."""

from __future__ import annotations

import pytest

from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(120)]

TARGET = "tests/peers/targets/flood.py:flood_peer"
PORT = 4001
REPLY_SECONDS = 60.0
RATE, BURST = 5.0, 20
FLOOD, CONCURRENCY = 150, 16


def test_a_flood_from_one_host_gets_its_rate_and_costs_no_one_else() -> None:
    with Lab() as lab, LocalSwarm() as swarm:
        hosts = [lab.add_public_host(name) for name in ("victim", "flooder", "honest")]
        victim_config = {
            "handshake_rate_per_ip": RATE,
            "handshake_burst_per_ip": BURST,
            "reachability": "public",
        }
        (victim,) = swarm.start(
            1,
            target=TARGET,
            options={"listen": [f"/ip4/0.0.0.0/tcp/{PORT}"], "peer_config": victim_config},
            namespaces=[hosts[0].namespace],
        )
        flooder, honest = swarm.start(
            2, target=TARGET, namespaces=[hosts[1].namespace, hosts[2].namespace]
        )
        for proc in (victim, flooder, honest):
            proc.wait_report("ready", REPLY_SECONDS)
        addr = f"/ip4/{hosts[0].address}/tcp/{PORT}/p2p/{victim.peer_id}"

        flooder.send({"cmd": "flood", "addr": addr, "count": FLOOD, "concurrency": CONCURRENCY})
        flooded = flooder.wait_report("flooded", REPLY_SECONDS)
        # At most the burst plus what the rate gave back while the flood lasted.
        bound = BURST + RATE * flooded["seconds"] + 1
        assert 0 < flooded["completed"] <= bound, flooded
        victim.send({"cmd": "statistics"})
        stats = victim.wait_report("statistics", REPLY_SECONDS)
        assert stats["num_inbound_connections_refused"] == flooded["refused"], (stats, flooded)

        # Another host is served at once, while the flooder's bucket is still empty.
        honest.send({"cmd": "ping", "addr": addr})
        assert honest.wait_report("pinged", REPLY_SECONDS)["ok"]
        flooder.send({"cmd": "flood", "addr": addr, "count": 1, "concurrency": 1})
        assert flooder.wait_report("flooded", REPLY_SECONDS)["completed"] <= 1
