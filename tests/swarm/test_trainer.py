"""One trainer alone: it trains, checkpoints atomically, and resumes where it stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peers.config import LOOPBACK_LISTEN_ADDRS as LOCAL
from swarm.checkpoint import read_state
from swarm.collaborative.config import DiLoCoConfig
from swarm.errors import CheckpointError, TaskError
from swarm.trainer import TrainerConfig, train

SWARM = [sys.executable, "-m", "swarm.cli"]
JSON = ["--progress", "json"]


@pytest.mark.parametrize(
    "fields",
    [
        {"slow_peer_seconds": -1.0},
        {"slow_peer_seconds": float("inf")},
        {"slow_peer_seconds": "30"},
        {"slow_peer_seconds": True},
        {"centered_clip": "yes"},
        {"reducers_per_part": 2},
        {"eval_every": -1},
        {"eval_every": "5"},
    ],
)
def test_bad_patience_or_aggregation_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(TaskError, match=next(iter(fields))):
        TrainerConfig(task="digits", **fields)  # type: ignore[arg-type]


def test_centered_clip_becomes_the_optimizer_aggregation() -> None:
    from averaging import CenteredClipConfig
    from swarm.trainer import _aggregation

    assert _aggregation(TrainerConfig(task="digits", centered_clip=True)) == {
        "aggregation": CenteredClipConfig()
    }
    assert _aggregation(TrainerConfig(task="digits")) == {}
    assert _aggregation(TrainerConfig(task="digits", reducers_per_part=3)) == {
        "reducers_per_part": 3
    }


def test_a_lone_peer_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = tmp_path / "digits.ckpt"
    first = train(TrainerConfig(task="digits", num_samples=64 * 20, checkpoint=path, listen=LOCAL))
    assert first.epochs == 20 and first.statistics.num_rounds_alone == 20
    assert read_state(path)["metadata"]["counters"]["epoch"] == 20
    second = train(TrainerConfig(task="digits", num_samples=64 * 60, checkpoint=path, listen=LOCAL))
    assert second.epochs == 60
    assert second.statistics.local_steps == 40  # it went on from step 20
    assert second.metrics["accuracy"] > first.metrics["accuracy"]


@pytest.mark.parametrize(
    ("diloco", "every", "epochs"),
    [
        (None, 5, [5, 10, 15, 20]),
        (DiLoCoConfig(inner_steps=5), 2, [2, 4]),
        # Overlap: a round is applied at the next outer step, the last one's at the end.
        (DiLoCoConfig(inner_steps=5, overlap=True), 1, [1, 2, 3, 4]),
    ],
)
def test_a_loss_curve_is_the_model_every_n_epochs_timed_apart_from_training(
    diloco: DiLoCoConfig | None, every: int, epochs: list[int]
) -> None:
    torch.set_num_threads(1)
    heard = []
    result = train(
        TrainerConfig(
            task="digits", num_samples=64 * 20, diloco=diloco, eval_every=every, listen=LOCAL
        ),
        on_eval=heard.append,
    )
    assert [p.epoch for p in result.eval_curve] == epochs  # global steps, or outer steps
    assert heard == list(result.eval_curve)
    assert result.eval_curve[-1].metrics == result.metrics  # the final model
    assert result.eval_curve[-1].train_seconds == result.train_seconds
    times = [p.train_seconds for p in result.eval_curve]
    assert times == sorted(times) and times[0] > 0
    assert result.eval_seconds > 0
    losses = [p.metrics["loss"] for p in result.eval_curve]
    assert losses[-1] < losses[0]  # it trains between the points


def test_a_corrupt_checkpoint_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.ckpt"
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError):
        train(TrainerConfig(task="digits", num_samples=64, checkpoint=path, listen=LOCAL))


def test_json_progress_carries_the_lines_people_read() -> None:
    """A program reading ``--progress json`` learns the join command and how the peer
    is connected from ``message`` events (stdout stays one JSON object a line)."""
    flags = ["--listen", "/ip4/127.0.0.1/tcp/0", "--num-samples", "640", "--eval-every", "4"]
    out = subprocess.run(
        [*SWARM, "train", *flags, *JSON],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    texts = [e["text"] for e in events if e["event"] == "message"]
    assert any(" join --initial-peers /ip4/127.0.0.1/tcp/" in t for t in texts), texts
    assert events[-1]["event"] == "result" and events[-1]["global_samples"] == 640
    curve = [e for e in events if e["event"] == "eval"]  # epochs 4, 8, and the last
    assert [e["epoch"] for e in curve] == [4, 8, 10], curve
    assert curve[-1]["metrics"] == events[-1]["metrics"]


def test_the_printed_join_command_carries_the_reducers_per_part() -> None:
    from swarm.train_command import join_command

    peers = ["/ip4/198.18.0.1/tcp/31337/p2p/12D3KooWLRPJAA5o6Bm8hJ4THgf1AR9kDT6KkFEXdB2hQFMBsAnt"]
    command = join_command(TrainerConfig(task="digits", reducers_per_part=3), peers)
    assert "--reducers-per-part 3" in command
    assert "--reducers-per-part" not in join_command(TrainerConfig(task="digits"), peers)


def test_the_printed_join_command_carries_every_diloco_setting_a_run_shares() -> None:
    from swarm.train_command import join_command

    peers = ["/ip4/198.18.0.1/tcp/31337/p2p/12D3KooWLRPJAA5o6Bm8hJ4THgf1AR9kDT6KkFEXdB2hQFMBsAnt"]
    diloco = DiLoCoConfig(inner_steps=7, outer_lr=0.5, outer_momentum=0.8, overlap=True)
    command = join_command(TrainerConfig(task="digits", diloco=diloco), peers)
    assert command.endswith(" --diloco 7 --outer-lr 0.5 --outer-momentum 0.8 --diloco-overlap")
    plain = join_command(TrainerConfig(task="digits", diloco=DiLoCoConfig(inner_steps=7)), peers)
    assert plain.endswith(" --diloco 7")
