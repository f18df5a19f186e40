"""A model cut into stages: what each stage server builds, and the same model in one piece.

A :class:`PipelineModel` names its stages' count, builds stage ``i``'s module with the
per-sample specs of its inputs (what the server checks requests against), and builds
the whole model in one process (the local model a pipeline is compared with). Replicas
of a stage must start equal, and equal to the local model's part: stage ``i`` is
initialised from ``seed + i`` alone, whoever builds it.

:class:`MLPStages` is the built-in one: an MLP whose layers are grouped into stages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from swarm.experts.schema import TensorSpec

#: Most stages of a pipeline: a client reads one DHT key per stage on every refresh,
#: and a pipeline past this many stages is past anything one client drives.
MAX_STAGES = 256
#: Widest layer of a built-in MLP stage (a bound on what a config can make a server
#: allocate: 65536 x 65536 float32 is already 16 GiB).
MAX_WIDTH = 1 << 16


class PipelineModel(Protocol):
    """A model cut into stages."""

    @property
    def num_stages(self) -> int: ...

    def build_stage(self, stage: int) -> tuple[nn.Module, list[TensorSpec]]:
        """Stage ``stage``'s module (initialised from its seed) and its input specs."""
        ...

    def build_local(self) -> nn.Sequential:
        """All stages in one module, initialised exactly as the stage servers' are."""
        ...


@dataclass(frozen=True, kw_only=True)
class MLPStages:
    """An MLP cut into stages: stage ``i`` maps ``widths[i][0]`` features through
    linear layers of widths ``widths[i][1:]``, with ReLU after every layer but the
    model's last. ``((64, 128), (128, 256, 128), (128, 10))``: 64 -> 128 | 128 -> 256
    -> 128 | 128 -> 10."""

    widths: tuple[tuple[int, ...], ...]
    """Per stage, its input width then each layer's output width."""
    seed: int = 0
    """Stage ``i`` is initialised from ``seed + i``."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.widths) <= MAX_STAGES:
            raise ValueError(f"need 1 to {MAX_STAGES} stages, got {len(self.widths)}")
        for i, stage in enumerate(self.widths):
            if len(stage) < 2 or not all(1 <= w <= MAX_WIDTH for w in stage):
                raise ValueError(
                    f"stage {i}: need an input width and at least one layer width, each in "
                    f"[1, {MAX_WIDTH}], got {stage}"
                )
            if i and stage[0] != self.widths[i - 1][-1]:
                raise ValueError(
                    f"stage {i} takes {stage[0]} features but stage {i - 1} gives "
                    f"{self.widths[i - 1][-1]}"
                )
        if not 0 <= self.seed < 2**62:
            raise ValueError("seed must be in [0, 2**62)")

    @property
    def num_stages(self) -> int:
        return len(self.widths)

    def build_stage(self, stage: int) -> tuple[nn.Module, list[TensorSpec]]:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside [0, {self.num_stages})")
        widths = self.widths[stage]
        last = stage == self.num_stages - 1
        layers: list[nn.Module] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + stage)
            for j, (a, b) in enumerate(itertools.pairwise(widths)):
                layers.append(nn.Linear(a, b))
                if not (last and j == len(widths) - 2):
                    layers.append(nn.ReLU())
        return nn.Sequential(*layers), [TensorSpec(shape=[widths[0]], dtype="float32")]

    def build_local(self) -> nn.Sequential:
        return nn.Sequential(*(self.build_stage(i)[0] for i in range(self.num_stages)))


DIGITS_STAGES = MLPStages(widths=((64, 128), (128, 256, 128), (128, 10)))
"""A 3-stage MLP for the ``digits`` task (64 pixels -> 10 classes); the middle stage is
the heaviest, so it is the one a lost server hurts most."""
