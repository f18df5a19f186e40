"""A LocalSwarm target: a DHT peer that runs Averager commands from the test.

Options: ``initial_peers``. Commands, each answered by one report:

- ``{"op": "gossip", "kind": "moshpit"|"random", "rounds": R, "elements": n, "seed": s,
  "rank": r, "start_at": unix time, "period": s}``: averages ``randn(n)`` (from ``seed``
  and ``rank``) for R rounds on a :class:`GossipSchedule` (round r opens at
  ``start_at + r * period``), and reports ``gossip`` with the vector after each round (``history``).
- ``{"op": "clip", "key": k, "elements": n, "seed": s, "rank": r, "scale": x,
  "tau": t}``: one CenteredClip round of ``x * honest(n, seed, rank)``, reports
  ``clipped`` with the result.
"""

from __future__ import annotations

from typing import Any

import torch

from averaging import (
    AllReduceConfig,
    Averager,
    AveragerConfig,
    CenteredClipConfig,
    GossipSchedule,
    MatchmakingConfig,
    MoshpitConfig,
    MoshpitGrid,
    RandomGroups,
    gossip,
)
from peers.dht import DHT, DHTConfig
from peers.testing import Node

ALLREDUCE = AllReduceConfig(
    sender_timeout=5.0, reducer_timeout=10.0, round_timeout=20.0, chunk_elements=4096
)


def matchmaking(group_size: int, gather: float) -> MatchmakingConfig:
    return MatchmakingConfig(
        target_group_size=group_size,
        min_group_size=2,
        search_timeout=20.0,
        gather_timeout=gather,
        request_timeout=5.0,
        poll_interval_seconds=0.25,
    )


def honest_vector(seed: int, rank: int, elements: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return 3.0 * torch.randn(elements, generator=gen) + torch.randn(elements, generator=gen)


async def _gossip(dht: DHT, command: dict[str, Any]) -> dict[str, Any]:
    elements, seed, rank = int(command["elements"]), int(command["seed"]), int(command["rank"])
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(elements, generator=gen)
    size = int(command.get("group_size", 4))
    config = AveragerConfig(
        prefix=f"gossip{seed}", matchmaking=matchmaking(size, 1.5), allreduce=ALLREDUCE
    )
    topology: MoshpitGrid | RandomGroups
    if command["kind"] == "moshpit":
        grid = MoshpitConfig(grid_size=int(command.get("grid_size", 4)), grid_dims=2)
        topology = MoshpitGrid(grid, seed=seed + rank)
    else:
        topology = RandomGroups(int(command.get("num_groups", 4)), seed=seed + rank)
    history = []
    schedule = GossipSchedule(start=float(command["start_at"]), period=float(command["period"]))
    async with Averager(dht, {"x": x}, config) as averager:
        async for done in gossip(averager, topology, schedule, int(command["rounds"])):
            group = 0 if done.step is None else done.step.num_peers
            history.append({"x": x.tolist(), "group": group, "skipped": done.skipped})
    return {"event": "gossip", "history": history}


async def _clip(dht: DHT, command: dict[str, Any]) -> dict[str, Any]:
    elements, seed, rank = int(command["elements"]), int(command["seed"]), int(command["rank"])
    x = float(command["scale"]) * honest_vector(seed, rank, elements)
    aggregation = None
    if command.get("tau") is not None:
        aggregation = CenteredClipConfig(tau=float(command["tau"]), num_iterations=100)
    config = AveragerConfig(
        prefix=f"clip{seed}",
        matchmaking=matchmaking(int(command["group_size"]), 3.0),
        allreduce=ALLREDUCE,
        aggregation=aggregation,
    )
    async with Averager(dht, {"x": x}, config) as averager:
        step = await averager.step(command["key"])
    return {"event": "clipped", "x": x.tolist(), "num_peers": step.num_peers}


async def averager_node(node: Node) -> None:
    torch.set_num_threads(1)  # many processes share 2 cores
    config = DHTConfig(initial_peers=tuple(node.options.get("initial_peers", ())))
    async with DHT(node.peer, config) as dht:
        node.report({"event": "joined"})
        while True:
            command = await node.receive()
            if command["op"] == "gossip":
                node.report(await _gossip(dht, command))
            else:
                node.report(await _clip(dht, command))
