"""A mixture of experts in one process: DHT nodes and servers on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from peers import PeerConfig
from peers.dht import BlockingDHT, DHTConfig
from swarm.experts import (
    BlockingExpertServer,
    ExpertCallConfig,
    ModuleBackend,
    NotEnoughExperts,
    ServerConfig,
    find_experts,
    get_remote_experts,
)
from swarm.experts.layers import linear
from swarm.experts.moe import MoEConfig, RemoteMixtureOfExperts

LISTEN = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
DIM = 8

torch.set_num_threads(1)


@contextlib.contextmanager
def _server(initial_peer: str, uids: list[str]) -> Iterator[list[ModuleBackend]]:
    """Experts on their own DHT node (a BlockingDHT: its loop runs in a thread)."""
    backends = []
    for uid in uids:
        module, specs = linear(DIM)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        backends.append(
            ModuleBackend(uid, module, inputs=specs, max_batch_size=64, optimizer=optimizer)
        )
    config = ServerConfig(announce_interval=30, announce_ttl=60)
    with (
        BlockingDHT(config=DHTConfig(initial_peers=(initial_peer,)), peer_config=LISTEN) as node,
        BlockingExpertServer(backends, config, dht=node),
    ):
        yield backends


def _prefer(moe: RemoteMixtureOfExperts, coords: tuple[int, int]) -> None:
    """Make the gate score ``coords`` highest for every input, and coordinate 0 next."""
    with torch.no_grad():
        moe.proj.weight.zero_()
        moe.proj.bias.zero_()
        moe.proj.bias[coords[0]] = 2.0
        moe.proj.bias[2 + coords[1]] = 2.0
        moe.proj.bias[2 + 2] += 1.0  # second choice in dimension 1: coordinate 2
        moe.proj.bias[0] += 1.0


def test_moe_finds_experts_and_retries_without_failed_ones() -> None:
    with BlockingDHT(peer_config=LISTEN) as boot:
        maddr = str(boot.peer.listen_addrs[0])
        with (
            _server(maddr, [f"ffn.0.{j}" for j in range(4)]) as first,
            BlockingDHT(config=DHTConfig(initial_peers=(maddr,))) as client,
        ):
            second = _server(maddr, [f"ffn.1.{j}" for j in range(4)])
            second.__enter__()
            try:
                found = client.peer.run(
                    find_experts(client.node, ["ffn.1.2", "ffn.0.3", "ffn.7.7"])
                )
                assert [len(found[u]) for u in ("ffn.1.2", "ffn.0.3", "ffn.7.7")] == [1, 1, 0]
                experts = get_remote_experts(client, ["ffn.0.3", "ffn.7.7"])
                assert experts["ffn.7.7"] is None and experts["ffn.0.3"] is not None
                assert experts["ffn.0.3"](torch.randn(2, DIM)).shape == (2, DIM)
                calls = ExpertCallConfig(forward_timeout=5.0, backward_timeout=5.0)
                config = MoEConfig(uid_prefix="ffn", grid_size=(2, 4), k_best=1, calls=calls)
                moe = RemoteMixtureOfExperts(in_features=DIM, dht=client, config=config)
                _prefer(moe, (1, 1))
                x = torch.randn(4, DIM, requires_grad=True)
                moe(x).sum().backward()
                assert moe.statistics().last_experts == ("ffn.1.1",)
            finally:
                second.__exit__(None, None, None)  # gone, but still announced in the DHT
            x = torch.randn(4, DIM, requires_grad=True)
            y = moe(x)  # ffn.1.1 fails; the retry goes to the best live one
            stats = moe.statistics()
            assert (stats.num_retries, stats.last_experts) == (1, ("ffn.0.1",))
            y.sum().backward()
            assert x.grad is not None and moe.proj.bias.grad is not None
            assert first[1].statistics().num_backward_samples == 4
            with pytest.raises(NotEnoughExperts, match="no live expert of grid moe"):
                other = MoEConfig(uid_prefix="moe", grid_size=(2,), k_best=1, calls=calls)
                RemoteMixtureOfExperts(in_features=DIM, dht=client, config=other)(x)
