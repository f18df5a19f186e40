"""One trainer alone: it trains, checkpoints atomically, and resumes where it stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarm.checkpoint import read_state
from swarm.errors import CheckpointError
from swarm.trainer import TrainerConfig, train


def test_a_lone_peer_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = tmp_path / "digits.ckpt"
    first = train(TrainerConfig(task="digits", num_samples=64 * 20, checkpoint=path))
    assert first.epochs == 20 and first.statistics.num_rounds_alone == 20
    assert read_state(path)["metadata"]["counters"]["epoch"] == 20
    second = train(TrainerConfig(task="digits", num_samples=64 * 60, checkpoint=path))
    assert second.epochs == 60
    assert second.statistics.local_steps == 40  # it went on from step 20
    assert second.metrics["accuracy"] > first.metrics["accuracy"]


def test_a_corrupt_checkpoint_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError):
        train(TrainerConfig(task="digits", num_samples=64, checkpoint=path))
