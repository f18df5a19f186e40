"""Which stage a server should serve: the rebalancing decisions (pure).

Every micro-batch passes through every stage, so the pipeline runs at the pace of its
slowest stage (SWARM parallelism, Ryabinin et al. 2023, its "adaptive swarm
rebalancing": peers move from the least loaded stage to the most loaded one). A stage's
*pressure* is the compute time one sample costs there divided among its servers:
``seconds_per_sample / num_servers``; the stage with the highest pressure is the
bottleneck, and a server is worth most there.

- :func:`stage_to_join`: a newcomer takes the stage with the highest pressure (a stage
  with no server at all first; ties at random, so a fresh swarm spreads out);
- :func:`stage_to_move`: a serving server moves only if that lowers the bottleneck's
  pressure by more than ``hysteresis`` (a fraction), and never leaves a stage it is
  the last server of; with hysteresis, two stages of equal pressure do not trade
  servers back and forth.

A stage's cost per sample is the median of its servers' announced compute throughput
(the servers of a stage run the same module, so the median shrugs off one server's
noisy or stale figure); a stage whose servers have computed nothing yet takes the
median of the known stages' costs.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StageLoad:
    """One stage as its live servers announce it."""

    num_servers: int
    throughputs: tuple[float, ...] = ()
    """Each server's announced compute throughput (samples/s; 0 if it computed nothing)."""

    def seconds_per_sample(self) -> float | None:
        known = [t for t in self.throughputs if t > 0 and math.isfinite(t)]
        return 1.0 / statistics.median(known) if known else None


def pressures(loads: Sequence[StageLoad]) -> list[float]:
    """Each stage's ``seconds_per_sample / num_servers`` (``inf`` without servers)."""
    costs = [load.seconds_per_sample() for load in loads]
    known = [c for c in costs if c is not None]
    default = statistics.median(known) if known else 1.0
    return [
        math.inf if load.num_servers <= 0 else (default if c is None else c) / load.num_servers
        for load, c in zip(loads, costs, strict=True)
    ]


def _busiest(
    values: Sequence[float], loads: Sequence[StageLoad], rng: random.Random | None = None
) -> int:
    """Highest pressure; ties: fewest servers, then at random with ``rng`` (else the
    lowest index)."""
    best = max((values[i], -loads[i].num_servers) for i in range(len(values)))
    tied = [i for i in range(len(values)) if (values[i], -loads[i].num_servers) == best]
    return tied[0] if rng is None else rng.choice(tied)


def stage_to_join(loads: Sequence[StageLoad], rng: random.Random | None = None) -> int:
    """The stage a new server should serve. Among equally needy stages, ``rng`` picks
    (so servers of a fresh swarm, all starting at once, spread over the stages instead
    of all taking the first); without it, the first. ValueError for no stages."""
    if not loads:
        raise ValueError("a pipeline has at least one stage")
    return _busiest(pressures(loads), loads, rng)


def stage_to_move(loads: Sequence[StageLoad], current: int, hysteresis: float) -> int | None:
    """The stage the server now serving ``current`` (counted in ``loads``) should move
    to, or ``None`` to stay."""
    if not 0 <= current < len(loads):
        raise ValueError(f"stage {current} is outside the pipeline's {len(loads)} stages")
    if hysteresis < 0:
        raise ValueError("hysteresis must be >= 0")
    if loads[current].num_servers <= 1:
        return None  # its last server: leaving would break the pipeline
    before = pressures(loads)
    target = _busiest(before, loads)
    if target == current:
        return None
    if math.isinf(before[target]):
        return target  # a stage nobody serves: any move there un-breaks the pipeline
    after_loads = list(loads)
    after_loads[current] = StageLoad(loads[current].num_servers - 1, loads[current].throughputs)
    after_loads[target] = StageLoad(loads[target].num_servers + 1, loads[target].throughputs)
    if max(pressures(after_loads)) * (1.0 + hysteresis) < max(before):
        return target
    return None
