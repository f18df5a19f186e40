"""``digits``: classify 8x8 handwritten digits with a small MLP.

The data ships with the package (``swarm/data/digits.npz``: the UCI optdigits images
that scikit-learn bundles, 1797 images, pixels 0..16; provenance and licence in
``swarm/data/README.md``). It is split once, by a fixed permutation that no training
seed changes, into 1437 training and 360 test images.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import TaskError
from swarm.optim_spec import OptimizerSpec
from swarm.tasks.base import Batch, Recipe, Task, evaluating

DATA_FILE = "digits.npz"
NUM_IMAGES = 1797
NUM_CLASSES = 10
NUM_PIXELS = 64
MAX_PIXEL = 16
_SPLIT_SEED = 20240601
"""Fixed: the test split must not move with the training seed, or runs would not compare."""


@dataclass(frozen=True, kw_only=True)
class DigitsConfig:
    """Shape of the ``digits`` task."""

    hidden: int = 128
    """Width of the MLP's one hidden layer (64 -> hidden -> 10)."""
    num_test: int = 360
    """Images held out for evaluation (about 20%)."""

    def __post_init__(self) -> None:
        if self.hidden < 1:
            raise TaskError(f"hidden must be >= 1, got {self.hidden}")
        if not 0 < self.num_test < NUM_IMAGES:
            raise TaskError(f"num_test must be in (0, {NUM_IMAGES}), got {self.num_test}")


@cache
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: uint8 arrays of shape (1797, 8, 8) and (1797,), as shipped.

    Raises :class:`TaskError` if the bundled file is missing or not what we ship.
    """
    try:
        raw = resources.files("swarm").joinpath("data", DATA_FILE).read_bytes()
        with np.load(io.BytesIO(raw), allow_pickle=False) as data:
            images, labels = data["images"], data["labels"]
    except (OSError, KeyError, ValueError) as e:
        raise TaskError(f"bundled data swarm/data/{DATA_FILE} is missing or unreadable: {e}") from e
    if (
        images.shape != (NUM_IMAGES, 8, 8)
        or labels.shape != (NUM_IMAGES,)
        or images.dtype != np.uint8
        or labels.dtype != np.uint8
        or int(images.max()) > MAX_PIXEL
        or int(labels.max()) >= NUM_CLASSES
    ):
        raise TaskError(f"bundled data swarm/data/{DATA_FILE} is not the optdigits set we ship")
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


class DigitsTask(Task):
    """An MLP (64 -> 128 -> 10, ReLU) on 8x8 digits; metrics: loss, accuracy."""

    name = "digits"

    def __init__(self, config: DigitsConfig | None = None) -> None:
        self.config = config or DigitsConfig()
        images, labels = load_digits()
        pixels = torch.from_numpy(images.reshape(NUM_IMAGES, NUM_PIXELS).astype(np.float32))
        pixels /= MAX_PIXEL
        targets = torch.from_numpy(labels.astype(np.int64))
        order = torch.from_numpy(np.random.default_rng(_SPLIT_SEED).permutation(NUM_IMAGES))
        test, train = order[: self.config.num_test], order[self.config.num_test :]
        self.train_inputs, self.train_targets = pixels[train], targets[train]
        self.test_inputs, self.test_targets = pixels[test], targets[test]

    @property
    def num_train(self) -> int:
        return len(self.train_targets)

    @property
    def recipe(self) -> Recipe:
        # About 14 epochs: 96-97% test accuracy in about a second of one CPU core.
        return Recipe(
            batch_size=64,
            num_samples=20_480,
            optimizer=OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9),
        )

    def build_model(self) -> nn.Module:
        hidden = self.config.hidden
        return nn.Sequential(
            nn.Linear(NUM_PIXELS, hidden), nn.ReLU(), nn.Linear(hidden, NUM_CLASSES)
        )

    def examples(self, indices: np.ndarray) -> Batch:
        index = torch.from_numpy(indices)
        return self.train_inputs[index], self.train_targets[index]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(model(inputs), targets)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with evaluating(model):
            logits = model(self.test_inputs)
            loss = F.cross_entropy(logits, self.test_targets).item()
            accuracy = (logits.argmax(dim=1) == self.test_targets).float().mean().item()
        return {"loss": loss, "accuracy": accuracy}
