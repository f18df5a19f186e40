"""A mixture of experts across real processes: 8 experts on 2 servers, one killed."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from peers.dht import BlockingDHT, DHTConfig
from peers.testing import LocalSwarm
from swarm.experts import ExpertCallConfig
from swarm.experts.moe import MoEConfig, RemoteMixtureOfExperts

TARGET = f"{Path(__file__).parent / 'targets' / 'expert_server.py'}:expert_server"
HIDDEN = 16
#: Seconds a report may take on a loaded 2-core machine (imports, DHT joins).
REPORT_TIMEOUT = 60.0


def _stats(proc: object) -> dict[str, list[int]]:
    proc.send({"op": "stats"})  # type: ignore[attr-defined]
    modules: dict[str, list[int]] = proc.wait_report("stats", REPORT_TIMEOUT)["modules"]  # type: ignore[attr-defined]
    return modules


def _train_step(moe: RemoteMixtureOfExperts, gate_opt: torch.optim.Optimizer, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, HIDDEN, generator=gen, requires_grad=True)
    target = torch.randn(16, HIDDEN, generator=gen)
    gate_opt.zero_grad()
    y = moe(x)
    assert isinstance(y, torch.Tensor) and y.shape == (16, HIDDEN)
    loss = (y - target).square().mean()
    loss.backward()
    assert moe.proj.weight.grad is not None and moe.proj.weight.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.abs().sum() > 0 and torch.isfinite(x.grad).all()
    gate_opt.step()
    return float(loss.detach())


def test_moe_trains_on_two_servers_and_survives_losing_one() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with LocalSwarm() as local:
        (boot,) = local.start(1, target="peers.dht.testing:dht_node")
        boot.wait_report("joined", REPORT_TIMEOUT)
        servers = local.start(
            2,
            target=TARGET,
            options={"initial_peers": [boot.maddr], "hidden_dim": HIDDEN, "announce_interval": 1.0},
            per_peer_options=[
                {"uids": [f"ffn.{i}.{j}" for j in range(4)], "module_seed": 10 * i}
                for i in range(2)
            ],
        )
        for server in servers:
            server.wait_report("serving", REPORT_TIMEOUT)
        client = BlockingDHT(config=DHTConfig(initial_peers=(boot.maddr,), rpc_timeout=2.0))
        try:
            config = MoEConfig(
                uid_prefix="ffn",
                grid_size=(2, 4),
                k_best=4,
                timeout_after_k_min=2.0,
                calls=ExpertCallConfig(forward_timeout=10.0, backward_timeout=10.0),
                cache_seconds=0.5,
            )
            moe = RemoteMixtureOfExperts(in_features=HIDDEN, dht=client, config=config)
            gate_opt = torch.optim.SGD(moe.parameters(), lr=0.1)
            for step in range(3):
                _train_step(moe, gate_opt, seed=step)
            # both servers computed forward and backward passes (and so trained)
            for server in servers:
                trained = _stats(server)
                assert sum(bwd for _, bwd, _ in trained.values()) > 0, trained
                assert all(fwd >= bwd for fwd, bwd, _ in trained.values())

            local.kill(servers[1])
            before = _stats(servers[0])
            killed_at = time.monotonic()
            for step in range(3, 6):
                _train_step(moe, gate_opt, seed=step)
            stats = moe.statistics()
            print(stats)
            assert time.monotonic() - killed_at < 40
            assert stats.last_experts and all(u.startswith("ffn.0.") for u in stats.last_experts)
            after = _stats(servers[0])
            assert sum(a[1] for a in after.values()) > sum(b[1] for b in before.values())
        finally:
            client.close()
