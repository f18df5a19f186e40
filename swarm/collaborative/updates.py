"""What a collaborative optimizer averages, and how it applies the result: the tensor side
of its two modes. The decisions (when) are :mod:`swarm.collaborative.machine`'s.

- :class:`GradientUpdates`: each local batch's gradients accumulate (weighted by its
  size); the update is their mean; the wrapped optimizer steps once per global step.
- :class:`DiLoCoUpdates`: the wrapped optimizer steps on every local batch; the update
  is the parameters' change since the last outer step (anchor - parameters); an outer
  Nesterov SGD steps on the averaged change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from swarm.collaborative.buffers import AveragingBuffers
from swarm.collaborative.config import DiLoCoConfig


def zero_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


class Updates(Protocol):
    """One mode's tensor work."""

    def take_batch(self, samples: int) -> None:
        """A local batch's gradients are in the parameters: use them (and clear them)."""
        ...

    def build(self, samples: int) -> None:
        """Put this epoch's update, from ``samples`` samples, into the host buffers."""
        ...

    def apply(self) -> None:
        """The host buffers hold the swarm's average: step with it (gradients cleared)."""
        ...

    def restart(self) -> None:
        """The parameters were replaced (a state load): nothing of before counts."""
        ...

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every optimizer whose state is the run's, by name (``inner`` first)."""
        ...


class GradientUpdates:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        buffers: AveragingBuffers,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.buffers = buffers

    def take_batch(self, samples: int) -> None:
        self.buffers.add_gradients(self.params, float(samples))
        zero_grads(self.params)

    def build(self, samples: int) -> None:
        self.buffers.to_host()
        self.buffers.divide_host(float(samples))

    def apply(self) -> None:
        self.buffers.host_as_gradients(self.params)
        self.optimizer.step()
        zero_grads(self.params)

    def restart(self) -> None:
        self.buffers.zero()

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"inner": self.optimizer}


class DiLoCoUpdates:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        buffers: AveragingBuffers,
        config: DiLoCoConfig,
    ) -> None:
        self.optimizer = optimizer
        self.params = params
        self.buffers = buffers
        self.anchor = [p.detach().clone() for p in params]
        """The parameters at the last outer step."""
        self.outer = torch.optim.SGD(
            params,
            lr=config.outer_lr,
            momentum=config.outer_momentum,
            nesterov=config.outer_momentum > 0,
        )

    def take_batch(self, samples: int) -> None:
        self.optimizer.step()
        zero_grads(self.params)

    def build(self, samples: int) -> None:
        self.buffers.set_difference(self.anchor, self.params)  # the outer "gradient"
        self.buffers.to_host()

    def apply(self) -> None:
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)
        self.buffers.host_as_gradients(self.params)
        self.outer.step()
        zero_grads(self.params)
        self._anchor_here()

    def restart(self) -> None:
        self.buffers.zero()
        self._anchor_here()

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"inner": self.optimizer, "outer": self.outer}

    def _anchor_here(self) -> None:
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                a.copy_(p)
