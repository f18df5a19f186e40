"""Gossip topologies and the shared round clock, in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from test_averager import averagers  # type: ignore[import-not-found]

from averaging import (
    GossipRound,
    GossipSchedule,
    MoshpitConfig,
    MoshpitGrid,
    RandomGroups,
    gossip,
)
from averaging.matchmaking.records import Group

Run = Callable[[Coroutine[Any, Any, Any]], Any]


def _group(round_id: bytes) -> Group:
    # The grid reads only the round id of the group it averaged in.
    return cast(Group, SimpleNamespace(round_id=round_id))


def test_moshpit_keys_follow_the_grid_lines() -> None:
    grid = MoshpitGrid(MoshpitConfig(grid_size=4, grid_dims=2), seed=0)
    grid.coords = [1, 3]
    assert grid.key(0) == "moshpit-0-d0-3"  # round 0 varies dimension 0: line y = 3
    assert grid.key(1) == "moshpit-1-d1-1"  # round 1 varies dimension 1: line x = 1
    grid.after_round(0, _group(b"round-a"), 2)
    assert grid.coords[1] == 3 and 0 <= grid.coords[0] < 4
    # Members of one group take distinct coordinates along the round's dimension.
    landed = set()
    for index in range(4):
        g = MoshpitGrid(MoshpitConfig(grid_size=4, grid_dims=2), seed=0)
        g.after_round(0, _group(b"round-b"), index)
        landed.add(g.coords[0])
    assert landed == {0, 1, 2, 3}


def test_random_groups_and_configs_check_their_arguments() -> None:
    keys = {RandomGroups(3, seed=s).key(5) for s in range(40)}
    assert keys == {"gossip-5-g0", "gossip-5-g1", "gossip-5-g2"}
    with pytest.raises(ValueError, match="num_groups"):
        RandomGroups(0)
    with pytest.raises(ValueError, match="grid_size"):
        MoshpitConfig(grid_size=1)
    with pytest.raises(ValueError, match="period"):
        GossipSchedule(start=0.0, period=0.0)
    with pytest.raises(ValueError, match="search_fraction"):
        GossipSchedule(start=0.0, period=1.0, search_fraction=1.5)


def test_the_schedule_places_rounds_on_one_clock() -> None:
    s = GossipSchedule(start=100.0, period=4.0, search_fraction=0.25)
    assert (s.opens(3), s.search_closes(3)) == (112.0, 113.0)
    assert [s.current_round(t) for t in (50.0, 100.0, 103.9, 104.0, 117.0)] == [0, 0, 0, 1, 4]


def test_a_late_peer_skips_closed_rounds_and_meets_the_others_in_the_current_one(
    arun: Run,
) -> None:
    """The failure this prevents: a peer alone in round 0 searched for the whole
    matchmaking timeout, then ran round 1, 2, ... late, alone under keys the others had
    left, and never averaged again (a CI run of the 16-process Moshpit test)."""
    schedule = GossipSchedule(start=1000.0, period=8.0)

    def clock() -> float:  # every peer reads the same time: inside round 2's search
        return schedule.opens(2) + 0.5

    async def main() -> list[list[GossipRound]]:
        async with averagers(2) as avgs:
            grids = [MoshpitGrid(MoshpitConfig(), seed=7) for _ in avgs]  # one grid line

            async def run(i: int) -> list[GossipRound]:
                return [r async for r in gossip(avgs[i], grids[i], schedule, 3, clock=clock)]

            expected = (avgs[0].tensors["weight"] + avgs[1].tensors["weight"]) / 2
            results = await asyncio.gather(run(0), run(1))
            for a in avgs:
                assert torch.allclose(a.tensors["weight"], expected, atol=1e-6)
            return results

    for rounds in arun(main()):
        assert [(r.index, r.skipped, r.step is None) for r in rounds] == [
            (0, True, True),
            (1, True, True),
            (2, False, False),
        ]


def test_a_clock_jump_during_the_wait_is_noticed(arun: Run) -> None:
    """The wall clock jumps past round 0's window while the peer waits for it (a laptop
    that slept): the peer notices at its next reading, not after the whole wait."""
    schedule = GossipSchedule(start=1000.0, period=8.0)
    readings = iter([0.0, schedule.search_closes(0) + 0.1])

    def clock() -> float:  # far before round 0, then (after one slice) past its window
        return next(readings, schedule.search_closes(0) + 0.1)

    async def main() -> list[GossipRound]:
        async with averagers(1) as (averager,):
            grid = MoshpitGrid(MoshpitConfig(), seed=0)
            async with asyncio.timeout(10):  # the first reading alone would wait ~1000 s
                return [r async for r in gossip(averager, grid, schedule, 1, clock=clock)]

    (only,) = arun(main())
    assert only.skipped and only.step is None
