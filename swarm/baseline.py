"""The single-process baseline that a swarm's result is compared with.

One process trains a task with the swarm's global batch size on the same stream of
examples (:meth:`swarm.tasks.Task.batches` with one peer): step ``t`` sees exactly the
examples that the swarm's peers see at step ``t`` together.

Determinism: the result is a function of the config alone (model init from ``seed``,
data order from ``seed``, no dropout) for a given torch build and thread count. This
module never changes torch's thread count: callers that compare runs across processes
or machines call ``torch.set_num_threads(1)`` first (the tests and ``swarm demo`` do),
because a matrix product may sum in a different order with more threads.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from swarm.errors import TaskError
from swarm.optim_spec import OptimizerSpec
from swarm.tasks import TASKS, Task, get_task
from swarm.tasks.base import check_seed


@dataclass(frozen=True, kw_only=True)
class BaselineConfig:
    """One single-process training run."""

    task: str
    """A built-in task name or ``package.module:factory`` (:func:`swarm.tasks.get_task`)."""
    batch_size: int
    """Global batch size: examples per optimizer step."""
    num_samples: int
    """Training examples in the whole run; the run takes ``num_samples // batch_size``
    steps, so it uses that many times ``batch_size`` (reported in the result)."""
    optimizer: OptimizerSpec
    """The optimizer and its hyperparameters."""
    seed: int = 0
    """Seeds the model's initialisation and the order of examples."""
    eval_every_steps: int = 0
    """Evaluate on the test split every this many steps (0: only at the end)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise TaskError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_samples < self.batch_size:
            raise TaskError(
                f"num_samples {self.num_samples} is less than one batch of {self.batch_size}"
            )
        if self.eval_every_steps < 0:
            raise TaskError(f"eval_every_steps must be >= 0, got {self.eval_every_steps}")
        check_seed(self.seed)

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the run."""
        return self.num_samples // self.batch_size

    @classmethod
    def from_recipe(cls, task: str, *, seed: int = 0, eval_every_steps: int = 0) -> BaselineConfig:
        """The task's default recipe (:attr:`swarm.tasks.Task.recipe`) as a config."""
        recipe = get_task(task).recipe
        return cls(
            task=task,
            batch_size=recipe.batch_size,
            num_samples=recipe.num_samples,
            optimizer=recipe.optimizer,
            seed=seed,
            eval_every_steps=eval_every_steps,
        )


@dataclass(frozen=True, kw_only=True)
class BaselineResult:
    """What a baseline run produced."""

    metrics: dict[str, float]
    """Final test metrics (``Task.evaluate``)."""
    loss_curve: tuple[float, ...]
    """Training loss of each step's batch, before that step's update."""
    eval_curve: tuple[tuple[int, dict[str, float]], ...]
    """``(steps done, test metrics)`` every ``eval_every_steps`` steps, and at the end."""
    num_steps: int
    num_samples: int
    """Examples actually used: ``num_steps * batch_size``."""
    train_seconds: float
    """Wall-clock time of the training loop (evaluation included)."""
    model: nn.Module = field(compare=False, repr=False)
    """The trained model (to compare parameters with a swarm's, or to save)."""
    optimizer: torch.optim.Optimizer = field(compare=False, repr=False)
    """Its optimizer, with its state after the last step (to save with the model)."""


StepCallback = Callable[[int, float], None]
"""Called after each step with (steps done, that step's training loss)."""


def run_baseline(
    config: BaselineConfig, *, task: Task | None = None, on_step: StepCallback | None = None
) -> BaselineResult:
    """Train ``config.task`` in this process and evaluate it.

    ``task`` may pass an already built task instance (it must be ``config.task``), to
    reuse its loaded data. Raises :class:`TaskError` for an unknown task or a mismatch,
    and if the training loss becomes NaN or infinite (a diverged run).
    """
    if task is None:
        task = get_task(config.task)
    elif config.task in TASKS and task.name != config.task:
        raise TaskError(f"config names task {config.task!r} but got a {task.name!r} task")
    model = task.make_model(config.seed)
    model.train()
    optimizer = config.optimizer.build(model.parameters())
    batches = task.batches(0, 1, config.batch_size, config.seed)
    losses: list[float] = []
    evals: list[tuple[int, dict[str, float]]] = []
    started = time.perf_counter()
    for step, batch in enumerate(itertools.islice(batches, config.num_steps), start=1):
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        value = loss.item()
        if not math.isfinite(value):
            raise TaskError(f"training diverged at step {step}: loss {value}")
        losses.append(value)
        if on_step is not None:
            on_step(step, value)
        if config.eval_every_steps and step % config.eval_every_steps == 0:
            evals.append((step, task.evaluate(model)))
    if not evals or evals[-1][0] != config.num_steps:
        evals.append((config.num_steps, task.evaluate(model)))
    return BaselineResult(
        metrics=evals[-1][1],
        loss_curve=tuple(losses),
        eval_curve=tuple(evals),
        num_steps=config.num_steps,
        num_samples=config.num_steps * config.batch_size,
        train_seconds=time.perf_counter() - started,
        model=model,
        optimizer=optimizer,
    )
