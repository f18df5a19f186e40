"""A LocalSwarm target: an expert server that joins a DHT and hosts modules.

Options: ``initial_peers``; ``uids``; the other :class:`~swarm.experts.serve.ServeConfig`
fields (``module``, ``hidden_dim``, ``max_batch_size``, ``module_seed`` for ``seed``); ``lr`` (SGD);
``announce_interval`` (entries live three times as long). Reports ``serving`` once its
experts are announced; answers ``{"op": "stats"}`` with ``stats`` (per uid: samples
forward and backward, optimizer steps).
"""

from __future__ import annotations

import asyncio

import torch

from peers.dht import DHT, DHTConfig
from peers.testing import Node
from swarm.experts.serve import ServeConfig, serve
from swarm.experts.server import ExpertServer
from swarm.experts.server_config import ServerConfig
from swarm.optim_spec import OptimizerSpec


async def expert_server(node: Node) -> None:
    torch.set_num_threads(1)  # several processes share 2 cores
    options = node.options
    interval = float(options.get("announce_interval", 1.0))
    config = ServeConfig(
        uids=tuple(options["uids"]),
        module=options.get("module", "linear"),
        hidden_dim=int(options.get("hidden_dim", 16)),
        max_batch_size=int(options.get("max_batch_size", 256)),
        optimizer=OptimizerSpec(kind="sgd", lr=float(options.get("lr", 0.05))),
        seed=options.get("module_seed"),
        server=ServerConfig(announce_interval=interval, announce_ttl=3 * interval),
    )
    dht_config = DHTConfig(initial_peers=tuple(options.get("initial_peers", ())), rpc_timeout=2.0)
    stop = asyncio.Event()
    ready: asyncio.Future[ExpertServer] = asyncio.get_running_loop().create_future()
    async with DHT(node.peer, dht_config) as dht, asyncio.TaskGroup() as group:
        group.create_task(serve(node.peer, dht, config, stop, ready.set_result))
        server = await ready
        node.report({"event": "serving", "uids": list(config.uids)})
        while True:
            command = await node.receive()
            if command.get("op") == "stats":
                stats = server.statistics().modules
                node.report(
                    {
                        "event": "stats",
                        "modules": {
                            uid: [
                                s.num_forward_samples,
                                s.num_backward_samples,
                                s.num_optimizer_steps,
                            ]
                            for uid, s in stats.items()
                        },
                    }
                )
