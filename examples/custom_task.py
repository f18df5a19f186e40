"""Your own model and data, trained by a swarm from the command line.

A task is a subclass of ``swarm.tasks.Task``: the training examples, a model, its loss,
an evaluation, and a recipe (global batch, run length, optimizer). Name it on the
command line as ``MODULE:FACTORY``, where the factory is the class or a function that
returns an instance; every peer of the run must be able to import the module (the
current directory is searched too):

    cd examples
    swarm train --task custom_task:make_task --num-peers 2   # prints the join command
    swarm join --initial-peers ... --task custom_task:make_task --run-id demo
    swarm demo --task custom_task:make_task                  # a local swarm vs one process

This task fits y = sin(3x) with a small MLP, on 1024 examples this file makes from a
fixed seed (no download). Running the file runs the demo above with two peers:

    python examples/custom_task.py                  # the recipe: 80 steps, ~20 s
    python examples/custom_task.py --steps 20       # a quick look
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from swarm.optim_spec import OptimizerSpec
from swarm.tasks import Batch, Recipe, Task
from swarm.tasks.base import evaluating

NUM_TRAIN, NUM_TEST = 1024, 256
BATCH = 32


class SineTask(Task):
    """An MLP (1 -> 32 -> 32 -> 1, tanh) fits y = sin(3x) + noise on [-1, 1]."""

    name = "sine"

    def __init__(self) -> None:
        rng = np.random.default_rng(7)  # the data is part of the task: fixed, not seeded
        x = rng.uniform(-1.0, 1.0, size=(NUM_TRAIN + NUM_TEST, 1)).astype(np.float32)
        y = np.sin(3 * x) + rng.normal(0.0, 0.05, size=x.shape).astype(np.float32)
        self.inputs, self.targets = torch.from_numpy(x), torch.from_numpy(y)

    @property
    def num_train(self) -> int:
        return NUM_TRAIN

    @property
    def recipe(self) -> Recipe:
        return Recipe(
            batch_size=BATCH,
            num_samples=BATCH * 80,
            optimizer=OptimizerSpec(kind="adam", lr=0.01),
        )

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )

    def examples(self, indices: np.ndarray) -> Batch:
        index = torch.from_numpy(indices)
        return self.inputs[index], self.targets[index]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.mse_loss(model(inputs), targets)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with evaluating(model):
            test = slice(NUM_TRAIN, None)
            loss = F.mse_loss(model(self.inputs[test]), self.targets[test]).item()
        return {"loss": loss}


def make_task() -> Task:
    """The factory named on the command line: ``--task custom_task:make_task``."""
    return SineTask()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="global steps (80)")
    args = parser.parse_args()
    # The demo's trainer processes import this module by name: let them find it.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    from swarm.demo import DemoConfig, run_demo

    run_demo(DemoConfig(task="custom_task:make_task", num_peers=2, num_samples=BATCH * args.steps))


if __name__ == "__main__":
    main()
