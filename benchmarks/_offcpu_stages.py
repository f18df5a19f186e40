"""Pipeline stages whose compute happens off the host's CPU, as on an accelerator: what
``bench_pipeline.py`` uses to measure a pipeline's schedule apart from this machine's
two cores, which three CPU-bound stage servers and their client overcommit.

Each of the 3 stages is a 512 -> 512 linear layer followed by a hold: the forward waits
``FORWARD_HOLD_SECONDS`` and the backward twice that, sleeping with the GIL released,
as a host thread waits for its device's kernels. The local model in one process holds
for every stage in turn, so the pipeline's limit is the stages working at once: with
``m`` micro-batches through 3 stages, ``3 m / (m + 2)`` times the local model (GPipe's
schedule; 2x at 4 micro-batches).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarm.experts.schema import TensorSpec

FORWARD_HOLD_SECONDS = 0.004
WIDTH = 512


class _Hold(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_HOLD_SECONDS)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(2 * FORWARD_HOLD_SECONDS)
        return grad


class HeldLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Hold.apply(self.linear(x))  # type: ignore[no-untyped-call]
        return out


@dataclass(frozen=True)
class OffCpuStages:
    """3 stages of :class:`HeldLinear`, stage ``i`` initialised from seed ``i``."""

    @property
    def num_stages(self) -> int:
        return 3

    def build_stage(self, stage: int) -> tuple[nn.Module, list[TensorSpec]]:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside [0, {self.num_stages})")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stage)
            module = HeldLinear(WIDTH)
        return module, [TensorSpec(shape=[WIDTH], dtype="float32")]

    def build_local(self) -> nn.Sequential:
        return nn.Sequential(*(self.build_stage(i)[0] for i in range(self.num_stages)))


OFFCPU_STAGES = OffCpuStages()
