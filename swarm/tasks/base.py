"""What a training task is, and how its training examples are dealt out to peers.

A :class:`Task` owns a fixed train/test split, builds a freshly initialised model from a
seed, computes the training loss of a batch and evaluates a model on its test split.

Examples reach peers through one shuffled stream per seed (:class:`SampleStream`): an
endless concatenation of permutations of the training set, one permutation per epoch.
Global step ``t`` of a run with ``num_peers`` peers of ``batch_size`` examples each uses
stream positions ``[t * G, (t + 1) * G)`` with ``G = num_peers * batch_size``, and peer
``rank`` takes the ``rank``-th slice of ``batch_size`` of them. So:

- no stream position is ever given to two (peer, step) pairs: within an epoch, peers'
  shards are disjoint;
- the peers' batches of step ``t``, concatenated in rank order, are exactly the batch of
  step ``t`` of a single process with ``batch_size = G`` and the same seed; this is what
  lets a swarm run be compared with (and, done synchronously, match) the baseline
  (CONTRIBUTING.md, "Numerics are checked as exact properties").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from swarm.errors import TaskError
from swarm.optim_spec import OptimizerSpec

Batch = tuple[torch.Tensor, torch.Tensor]
"""``(inputs, targets)`` as the task's model and loss take them."""

MAX_SEED = 2**63 - 1
"""Seeds are non-negative and fit a signed 64-bit int (torch.manual_seed's range)."""

_SHUFFLE_STREAM = 0x5EED_5A3B
"""Tag mixed into every shuffle's seed, so it never coincides with another use of a seed."""


def check_seed(seed: int) -> int:
    """``seed`` itself; raises :class:`TaskError` unless it is an int in [0, 2**63)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise TaskError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return seed


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """How a task trains well by default: what the demo and the examples use."""

    batch_size: int
    """Global batch size (examples per optimizer step, summed over all peers)."""
    num_samples: int
    """Training examples in a whole run (``num_samples // batch_size`` steps)."""
    optimizer: OptimizerSpec
    """The optimizer, for the baseline and for every peer of a swarm."""


class SampleStream:
    """The endless shuffled stream of training-example indices for one seed.

    Position ``p`` holds ``perm_e[p % n]`` where ``e = p // n`` is the epoch and
    ``perm_e`` a permutation of ``range(n)`` drawn from ``(seed, e)`` alone (numpy's
    PCG64 via SeedSequence), so every process computes the same stream.
    """

    def __init__(self, num_examples: int, seed: int) -> None:
        if num_examples < 1:
            raise TaskError(f"a stream needs at least one example, got {num_examples}")
        self.num_examples = num_examples
        self.seed = check_seed(seed)
        self._cache: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._cache.get(epoch)
        if perm is None:
            rng = np.random.default_rng([_SHUFFLE_STREAM, self.seed, epoch])
            perm = rng.permutation(self.num_examples)
            if len(self._cache) >= 2:  # a batch spans at most two epochs in turn
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        return perm

    def indices(self, start: int, stop: int) -> np.ndarray:
        """The example indices at stream positions ``[start, stop)`` (int64)."""
        if not 0 <= start <= stop:
            raise TaskError(f"need 0 <= start <= stop, got [{start}, {stop})")
        n = self.num_examples
        parts: list[np.ndarray] = []
        position = start
        while position < stop:
            epoch, offset = divmod(position, n)
            take = min(stop - position, n - offset)
            parts.append(self._permutation(epoch)[offset : offset + take])
            position += take
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts).astype(np.int64, copy=False)


def peer_positions(step: int, rank: int, num_peers: int, batch_size: int) -> tuple[int, int]:
    """Stream positions ``[start, stop)`` of peer ``rank``'s batch at global step ``step``."""
    if num_peers < 1 or batch_size < 1:
        raise TaskError(f"need num_peers >= 1 and batch_size >= 1, got {num_peers}, {batch_size}")
    if not 0 <= rank < num_peers:
        raise TaskError(f"rank must be in [0, {num_peers}), got {rank}")
    if step < 0:
        raise TaskError(f"step must be >= 0, got {step}")
    start = (step * num_peers + rank) * batch_size
    return start, start + batch_size


class Task(ABC):
    """A built-in training task: data split, model, loss, evaluation, default recipe."""

    name: ClassVar[str]
    """The task's name in the registry (``swarm.tasks.get_task``)."""

    @property
    @abstractmethod
    def num_train(self) -> int:
        """Number of training examples (the length of one epoch of the stream)."""

    @property
    @abstractmethod
    def recipe(self) -> Recipe:
        """Default global batch size, run length and optimizer."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A model with torch's default initialisation from the global RNG."""

    @abstractmethod
    def examples(self, indices: np.ndarray) -> Batch:
        """The training examples at ``indices``, as one batch."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean training loss of ``model`` on ``batch`` (a scalar with a graph)."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Metrics of ``model`` on the fixed test split (always includes ``"loss"``)."""

    def make_model(self, seed: int) -> nn.Module:
        """A new model, initialised from ``seed`` alone; the global torch RNG is untouched."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(check_seed(seed))
            return self.build_model()

    def batches(
        self, rank: int, num_peers: int, batch_size: int, seed: int, *, start_step: int = 0
    ) -> Iterator[Batch]:
        """Peer ``rank``'s batches of ``batch_size`` examples, from ``start_step`` on (endless).

        See the module docstring: peers' batches never overlap, and together they form
        the batches of one process with ``batch_size * num_peers`` and the same ``seed``.
        ``start_step`` lets a peer resume (or join late) at a global step. Raises
        :class:`TaskError` at once for an invalid argument.
        """
        peer_positions(start_step, rank, num_peers, batch_size)  # validates the arguments
        stream = SampleStream(self.num_train, seed)

        def generate() -> Iterator[Batch]:
            step = start_step
            while True:
                start, stop = peer_positions(step, rank, num_peers, batch_size)
                yield self.examples(stream.indices(start, stop))
                step += 1

        return generate()


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode and no autograd inside; the model's previous mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
