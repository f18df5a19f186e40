"""A LocalSwarm target: a hostile trainer. It trains like ``trainer_node`` but sends its
gradient (or DiLoCo parameter change) times ``poison`` (default -1000) into every
averaging round; it takes the round's result like everyone else."""

from __future__ import annotations

from typing import Any

import torch

from peers.testing import Node
from swarm.collaborative.driver import CollaborativeDriver
from swarm.testing import trainer_node


async def poisoning_trainer(node: Node) -> None:
    factor = float(node.options.get("poison", -1000.0))
    # (the update is built: poison it, then send it). Read from the class, so a rename
    # fails here, before any training, and the test sees the attacker exit.
    honest_start = CollaborativeDriver._start_round

    def poisoned(self: CollaborativeDriver[Any], *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            for b in self.averaged.host:
                b.mul_(factor)
        return honest_start(self, *args, **kwargs)

    CollaborativeDriver._start_round = poisoned  # type: ignore[method-assign]
    node.report({"event": "attacking"})
    await trainer_node(node)
