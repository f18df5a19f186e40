"""Issue 22's P5 (and issue 21's training-level defence) with real processes: one of
four peers trains honestly but publishes the averaged gradient of every part it reduces
plus 1000. With one reducer per part every other peer takes that and the run learns
nothing; with ``--reducers-per-part 3`` the median of three reducers' copies outvotes
it and the swarm trains on."""

from __future__ import annotations

from pathlib import Path

from peers.testing import LocalSwarm
from tests.swarm.test_hostile_gradients import _start, attacked, trained_together

TARGETS = Path(__file__).parent / "targets"
LIAR = f"{TARGETS / 'lying_reducer.py'}:lying_reducer"
STEPS = 30


def test_three_reducers_per_part_outvote_a_peer_that_publishes_wrong_averages() -> None:
    """(That the attack works with one reducer per part is shown by real Averagers in
    ``tests/averaging/test_replicated.py``; a swarm of these four stayed at a loss of
    2.30, a guess among the ten digits, through 10 steps.)"""
    with LocalSwarm() as swarm:
        honest, liar = _start(
            swarm, centered_clip=False, steps=STEPS, hostile=LIAR, reducers_per_part=3
        )
        # (0.914 here, the liar's copies outvoted in every round)
        trained_together(honest, STEPS, accuracy=0.85)
        attacked(liar)
