"""LocalSwarm targets for testing your own swarms: a trainer and a bootstrap peer.

``peers.testing.LocalSwarm`` starts each peer as its own process and talks to it by
JSON lines. Two targets ship for training runs:

- ``peers.dht.testing:dht_node``: a bootstrap peer (a DHT node that serves), reporting
  ``joined``;
- ``swarm.testing:trainer_node``: one collaborative trainer, as ``swarm train`` runs it
  (:func:`swarm.trainer.train`). Its options are :class:`~swarm.trainer.TrainerConfig`'s
  fields (``initial_peers`` as a list, ``listen`` loopback unless given, ``diloco`` as a dict of
  :class:`~swarm.collaborative.config.DiLoCoConfig` fields, ``task`` a built-in name or
  your own ``MODULE:FACTORY``), and ``report_every``: every that many epochs it reports
  ``{"event": "progress", "epoch", "loss"}`` (default 50). At the end it reports
  ``{"event": "trained", "metrics", "epochs", "statistics"}`` and stays up until the
  test stops it. Bad options end the process with an ``error`` report.

docs/training.md#testing-your-own-swarm shows a whole run.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from peers.config import LOOPBACK_LISTEN_ADDRS
from peers.testing import Node


def trainer_config_from_options(options: dict[str, Any]) -> Any:
    """The :class:`~swarm.trainer.TrainerConfig` a target's JSON options describe (keys
    that are not its fields are left to the target); raises what the config raises."""
    from swarm.collaborative.config import DiLoCoConfig
    from swarm.trainer import TrainerConfig

    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    kwargs = {k: v for k, v in options.items() if k in fields}
    kwargs["initial_peers"] = tuple(kwargs.get("initial_peers", ()))
    kwargs["listen"] = tuple(kwargs.get("listen", LOOPBACK_LISTEN_ADDRS))  # a local swarm
    if kwargs.get("diloco") is not None:
        kwargs["diloco"] = DiLoCoConfig(**kwargs["diloco"])
    return TrainerConfig(**kwargs)


async def trainer_node(node: Node) -> None:
    """The trainer target (see the module docstring)."""
    import torch

    from swarm.collaborative.config import OptimizerStatistics
    from swarm.trainer import train

    torch.set_num_threads(1)  # several trainers share the machine's cores
    every = int(node.options.get("report_every", 50))
    last = [-1]

    def on_step(stats: OptimizerStatistics, loss: float) -> None:
        if stats.epoch // every != last[0]:
            last[0] = stats.epoch // every
            node.report({"event": "progress", "epoch": stats.epoch, "loss": loss})

    config = trainer_config_from_options(node.options)
    result = await asyncio.to_thread(train, config, on_step)
    node.report(
        {
            "event": "trained",
            "metrics": result.metrics,
            "epochs": result.epochs,
            "statistics": dataclasses.asdict(result.statistics),
        }
    )
    await asyncio.Event().wait()  # stay up until the test stops us
