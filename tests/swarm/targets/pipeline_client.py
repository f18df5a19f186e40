"""A LocalSwarm target: a pipeline client that trains ``digits`` through remote stages.

Options: ``initial_peers``, ``steps``, ``micro_batch``. Dials out only (its own DHT
peer does not listen), so it reaches stage servers behind NAT through their relays.
Reports ``trained`` with the losses and, per stage server it reached, whether the
connection to it is relayed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch
import torch.nn.functional as F

from peers import PeerConfig
from peers.dht import BlockingDHT, DHTConfig
from peers.testing import Node
from swarm.experts import ExpertCallConfig
from swarm.pipeline import DIGITS_STAGES, PipelineConfig, RemoteSequential
from swarm.tasks import get_task


def _train(options: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    data = get_task("digits").batches(
        rank=0, num_peers=1, batch_size=int(options.get("micro_batch", 32)), seed=0
    )
    config = PipelineConfig(
        num_stages=DIGITS_STAGES.num_stages,
        calls=ExpertCallConfig(forward_timeout=20.0, backward_timeout=20.0),
        refresh_seconds=1.0,
        seed=0,
    )
    dht_config = DHTConfig(initial_peers=tuple(options["initial_peers"]), rpc_timeout=5.0)
    losses: list[float] = []
    with BlockingDHT(config=dht_config, peer_config=PeerConfig(listen_addrs=())) as dht:
        model = RemoteSequential(dht, config)
        for _ in range(int(options.get("steps", 5))):
            losses += model.train_step([next(data), next(data)], F.cross_entropy)
        peer = dht.peer.peer  # read once training is done: nothing else runs on it
        connections = {
            str(pid): conn.relayed
            for pid in peer.connected_peers()
            if (conn := peer.connection_to(pid)) is not None
        }
    return {"event": "trained", "losses": losses, "relayed": connections}


async def pipeline_client(node: Node) -> None:
    if node.options.get("log"):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    node.report(await asyncio.to_thread(_train, node.options))
