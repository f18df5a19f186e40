"""A LocalSwarm target: a hostile trainer that trains honestly and sends its true
gradients, but publishes every part it reduces in a round plus ``lie`` (default 1000):
the averaged gradient every other member takes from it."""

from __future__ import annotations

import dataclasses

from averaging import ButterflyRound, OutgoingAveraged
from peers.testing import Node
from swarm.testing import trainer_node


async def lying_reducer(node: Node) -> None:
    lie = float(node.options.get("lie", 1000.0))
    honest = ButterflyRound.publishable_chunks

    def lying(self: ButterflyRound, part_index: int) -> list[OutgoingAveraged]:
        return [dataclasses.replace(o, values=o.values + lie) for o in honest(self, part_index)]

    ButterflyRound.publishable_chunks = lying  # type: ignore[method-assign]
    node.report({"event": "attacking"})
    await trainer_node(node)
