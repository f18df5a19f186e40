"""A :mod:`peers.testing` target that runs a stage server, for local multi-process swarms.

``LocalSwarm().start(n, target="swarm.pipeline.testing:stage_server", options={...})``.
Options: ``initial_peers``; ``stage`` (an int, or ``"auto"`` for the most under-served);
the model: ``widths`` and ``seed`` (an :class:`MLPStages`; default the digits model), or
``model`` (a built-in name: ``charlm``), or ``charlm`` (a transformer's ``d_model``,
``num_heads``, ``num_layers`` (3), ``context``, ``bottleneck``); ``synchronous``; ``clip``
(``"none"``: no clipping); ``optimizer`` (``sgd``, ``adam``), ``lr`` and ``momentum``
(SGD); ``announce_interval`` (entries live three times as long); ``average_interval``;
``run_id``; ``rebalance_interval`` (``null``: never move); ``max_batch_size``;
``linear_kernels`` (:class:`ServerConfig`'s). Reports ``serving`` (``stage``,
``loaded_version``) each time it serves a stage, and answers ``{"op": "stats"}`` with
``stats``: ``stage``, ``forward_samples``, ``backward_samples``, ``steps``,
``compute_seconds``, ``rounds`` (averaged with others), ``alone``, ``moves``, and the
peer's ``reachability`` and ``advertised_addrs`` (see :mod:`peers.nat`); ``{"op":
"wait_private", "timeout": S}`` answers the same once the peer found itself behind NAT
and holds a relay reservation (or after S seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch

from averaging import AllReduceConfig, MatchmakingConfig
from peers.dht import DHT, DHTConfig
from peers.testing import Node
from swarm.experts.backend import DEFAULT_CLIP_GRAD_NORM
from swarm.experts.server_config import ServerConfig
from swarm.optim_spec import OptimizerSpec
from swarm.pipeline.models import pipeline_model
from swarm.pipeline.replicas import ReplicaConfig
from swarm.pipeline.server import StageServer, StageServerConfig
from swarm.pipeline.stages import DIGITS_STAGES, MLPStages, PipelineModel
from swarm.pipeline.transformer import CharLMStages
from swarm.tasks.charlm import CharLMConfig


def config_from_options(options: dict[str, Any]) -> StageServerConfig:
    """The server config the target's options describe (see the module docstring)."""
    widths = options.get("widths")
    model: PipelineModel
    if "charlm" in options:  # a transformer's shape: d_model, num_layers, heads, bottleneck
        shape = dict(options["charlm"])
        bottleneck = shape.pop("bottleneck", None)
        model = CharLMStages(
            config=CharLMConfig(**{"num_layers": 3, **shape}),
            bottleneck=None if bottleneck is None else int(bottleneck),
        )
    elif "model" in options:
        model = pipeline_model(str(options["model"]))
    else:
        mlp = DIGITS_STAGES
        if widths is not None:
            mlp = MLPStages(widths=tuple(tuple(int(w) for w in s) for s in widths))
        model = MLPStages(widths=mlp.widths, seed=int(options.get("seed", 0)))
    interval = float(options.get("announce_interval", 1.0))
    average = float(options.get("average_interval", 5.0))
    stage = options.get("stage", "auto")
    rebalance = options.get("rebalance_interval")
    return StageServerConfig(
        model=model,
        stage=None if stage == "auto" else int(stage),
        optimizer=OptimizerSpec(
            kind=options.get("optimizer", "sgd"),
            lr=float(options.get("lr", 0.1)),
            momentum=float(options.get("momentum", 0)),
        ),
        max_batch_size=int(options.get("max_batch_size", 512)),
        server=ServerConfig(
            announce_interval=interval,
            announce_ttl=3 * interval,
            linear_kernels=options.get("linear_kernels", "auto"),
        ),
        replicas=ReplicaConfig(
            run_id=str(options.get("run_id", "test")),
            interval_seconds=average,
            matchmaking=MatchmakingConfig(
                search_timeout=average / 2 + 1.0,
                gather_timeout=min(1.0, average / 4),
                request_timeout=2.0,
                poll_interval_seconds=min(0.25, average / 4),
            ),
            allreduce=AllReduceConfig(
                sender_timeout=2.0, reducer_timeout=4.0, round_timeout=8.0, join_timeout=2.0
            ),
            load_timeout=20.0,
        ),
        rebalance_interval_seconds=None if rebalance is None else float(rebalance),
        clip_grad_norm=None if options.get("clip") == "none" else DEFAULT_CLIP_GRAD_NORM,
        synchronous=bool(options.get("synchronous", StageServerConfig.synchronous)),
    )


async def stage_server(node: Node) -> None:
    torch.set_num_threads(1)  # several processes share few cores
    options = node.options
    config = config_from_options(options)
    dht_config = DHTConfig(initial_peers=tuple(options.get("initial_peers", ())), rpc_timeout=2.0)
    stop = asyncio.Event()

    def ready(server: StageServer) -> None:
        stats = server.statistics()
        node.report(
            {"event": "serving", "stage": stats.stage, "loaded_version": stats.loaded_version}
        )

    async with DHT(node.peer, dht_config) as dht, asyncio.TaskGroup() as group:
        server = StageServer(dht, config)
        group.create_task(server.run(stop, ready))
        while True:
            command = await node.receive()
            if command.get("op") == "wait_private":
                await _wait_private(node, float(command.get("timeout", 30.0)))
            if command.get("op") in ("stats", "wait_private"):
                report = {"event": "stats", **_stats(server)}
                report["reachability"] = node.peer.nat.reachability.value
                report["advertised_addrs"] = [str(a) for a in node.peer.advertised_addrs]
                node.report(report)


async def _wait_private(node: Node, timeout: float) -> None:
    """Until the peer knows it is behind NAT and announces relayed addresses (bounded)."""
    peer = node.peer

    def done() -> bool:
        return peer.nat.reachability.value == "private" and bool(peer.circuit_addrs)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while not done():
                await peer.nat.wait_changed()


def _stats(server: StageServer) -> dict[str, Any]:
    stats = server.statistics()
    modules = stats.server.modules if stats.server is not None else {}
    replica = stats.replica
    return {
        "stage": stats.stage,
        "forward_samples": sum(m.num_forward_samples for m in modules.values()),
        "backward_samples": sum(m.num_backward_samples for m in modules.values()),
        "steps": sum(m.num_optimizer_steps for m in modules.values()),
        "compute_seconds": sum(m.compute_seconds for m in modules.values()),
        "rounds": 0 if replica is None else replica.num_rounds,
        "alone": 0 if replica is None else replica.num_alone,
        "moves": stats.num_moves,
    }
