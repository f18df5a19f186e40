"""Averaging over internet-like links (the namespace lab with link shapes): four peers on
100 Mbit/s links 80 ms apart (20 ms each way on each end), with 1% loss on every link.
Correctness, not speed: every round agrees, every member holds the same tensor, and it
is the mean of what they started with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peers.netlab import Lab, lab_available
from peers.testing import LocalSwarm
from tests.averaging.targets.nat_averager import member_tensor

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(240)]

TARGET = f"{Path(__file__).parent / 'targets' / 'nat_averager.py'}:nat_averager"
REPORT_TIMEOUT = 90.0
ELEMENTS = 1 << 20  # 4 MiB of float32 per peer: a third of a second at 100 Mbit/s
ROUNDS = 2


def test_four_peers_80_ms_apart_with_lossy_links_average_to_the_mean() -> None:
    loss = 0.01
    with Lab() as lab, LocalSwarm() as swarm:
        boot_host = lab.add_public_host("boot")
        hosts = [lab.add_public_host(f"peer{i}", rate_mbit=100) for i in range(4)]
        for i, host in enumerate(hosts):
            lab.delay(host, one_way_ms=20, loss=loss, seed=i)
        listen = {"listen": ["/ip4/0.0.0.0/tcp/4001"]}
        (boot,) = swarm.start(
            1, target="peers.dht.testing:dht_node", options=listen, namespaces=[boot_host.namespace]
        )
        boot.wait_report("joined", REPORT_TIMEOUT)
        procs = swarm.start(
            4,
            target=TARGET,
            options={
                "initial_peers": [boot.maddr],
                "elements": ELEMENTS,
                "log_level": "INFO",
                **listen,
            },
            per_peer_options=[{"rank": i} for i in range(4)],
            namespaces=[h.namespace for h in hosts],
        )
        for proc in procs:
            proc.wait_report("joined", REPORT_TIMEOUT)
        mean = sum(member_tensor(rank, ELEMENTS)[:4] for rank in range(4)) / 4
        for round_key in range(ROUNDS):
            for proc in procs:
                proc.send({"op": "step", "round_key": round_key, "timeout": 60.0})
            reports = [proc.wait_report("stepped", 120.0) for proc in procs]
            assert len({r["fingerprint"] for r in reports}) == 1, reports  # one result
            for r in reports:
                assert r["agreed"] and not r["failed"] and len(r["members"]) == 4, r
                assert torch.allclose(torch.tensor(r["head"]), mean, atol=1e-6), r["head"]
