"""``swarm train --progress json``: the lines programs read."""

from __future__ import annotations

import io
import json

from swarm.collaborative.config import OptimizerStatistics
from swarm.train_display import TrainDisplay
from swarm.trainer import RunPlan


def _stats(epoch: int) -> OptimizerStatistics:
    return OptimizerStatistics(
        epoch=epoch,
        local_steps=epoch,
        local_samples=16 * epoch,
        num_rounds=epoch,
        num_rounds_alone=0,
        num_state_loads=0,
        num_splits=0,
        bytes_sent=0,
        num_peers=2,
        samples_per_second=100.0,
    )


def test_every_new_epoch_prints_a_progress_line_and_one_epoch_is_throttled() -> None:
    plan = RunPlan(
        target_batch_size=64,
        local_batch_size=0,
        num_samples=640,
        total_epochs=10,
        samples_per_epoch=64,
    )
    out = io.StringIO()
    display = TrainDisplay(plan, "json", stream=out)
    for epoch in (0, 0, 0, 1, 1, 2, 3, 3, 10, 10):  # far faster than the interval
        display.on_step(_stats(epoch), 0.5)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["event"] for r in records] == ["progress"] * 5
    assert [r["samples"] for r in records] == [0, 64, 128, 192, 640]
    assert records[-1]["total_samples"] == 640 and records[-1]["loss"] == 0.5
