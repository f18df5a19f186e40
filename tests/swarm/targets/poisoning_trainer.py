"""A LocalSwarm target: a hostile trainer. It trains like ``trainer_node`` but sends its
gradient (or DiLoCo parameter change) times ``poison`` (default -1000) into every
averaging round; it takes the round's result like everyone else."""

from __future__ import annotations

from typing import Any

import torch

from peers.testing import Node
from swarm.collaborative.optimizer import CollaborativeOptimizer
from swarm.testing import trainer_node


async def poisoning_trainer(node: Node) -> None:
    factor = float(node.options.get("poison", -1000.0))
    honest_start = CollaborativeOptimizer._start_round  # (the update is built: send it)

    def poisoned(self: CollaborativeOptimizer, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            for b in self.buffers:
                b.mul_(factor)
        return honest_start(self, *args, **kwargs)

    CollaborativeOptimizer._start_round = poisoned  # type: ignore[method-assign]
    await trainer_node(node)
