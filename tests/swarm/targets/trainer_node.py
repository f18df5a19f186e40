"""A LocalSwarm target: one collaborative trainer (``swarm.trainer.train``).

Options: the :class:`~swarm.trainer.TrainerConfig` fields (``diloco`` as a dict of
:class:`~swarm.optimizer_config.DiLoCoConfig` fields); ``report_every`` epochs it reports
``progress``; at the end ``trained`` with metrics and statistics.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import torch

from peers.testing import Node
from swarm.optimizer_config import DiLoCoConfig, OptimizerStatistics
from swarm.trainer import TrainerConfig, train


def _config(options: dict[str, Any]) -> TrainerConfig:
    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    kwargs = {k: v for k, v in options.items() if k in fields}
    kwargs["initial_peers"] = tuple(kwargs.get("initial_peers", ()))
    if kwargs.get("diloco") is not None:
        kwargs["diloco"] = DiLoCoConfig(**kwargs["diloco"])
    return TrainerConfig(**kwargs)


async def trainer_node(node: Node) -> None:
    torch.set_num_threads(1)  # several trainers share 2 cores
    every = int(node.options.get("report_every", 50))
    last = [-1]

    def on_step(stats: OptimizerStatistics, loss: float) -> None:
        if stats.epoch // every != last[0]:
            last[0] = stats.epoch // every
            node.report({"event": "progress", "epoch": stats.epoch, "loss": loss})

    result = await asyncio.to_thread(train, _config(node.options), on_step)
    node.report(
        {
            "event": "trained",
            "metrics": result.metrics,
            "epochs": result.epochs,
            "statistics": dataclasses.asdict(result.statistics),
        }
    )
    await asyncio.Event().wait()  # stay up until the test stops us
