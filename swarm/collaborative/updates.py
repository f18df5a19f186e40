"""What a collaborative optimizer averages, and how it applies the result: the tensor side
of its two modes. The decisions (when) are :mod:`swarm.collaborative.machine`'s.

- :class:`GradientUpdates`: each local batch's gradients accumulate (weighted by its
  size); the update is their mean; the wrapped optimizer steps once per global step.
- :class:`DiLoCoUpdates`: the wrapped optimizer steps on every local batch; the update
  is the parameters' change since the last outer step (anchor - parameters); an outer
  Nesterov SGD steps on the averaged change. With ``overlap``, the round runs while
  the next inner steps do, from a provisional start (:meth:`DiLoCoUpdates.launched`),
  and the outer step is applied under the local steps taken meanwhile
  (:meth:`DiLoCoUpdates.apply_late`).
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
        self.launch_point: list[torch.Tensor] | None = None
        """Overlap: the parameters when the round in flight took its update."""
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
        self._outer_step()
        zero_grads(self.params)

    def restart(self) -> None:
        self.buffers.zero()
        self._anchor_here()
        self.launch_point = None

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"inner": self.optimizer, "outer": self.outer}

    def launched(self) -> None:
        """Overlap: the update just built (in the host buffers) is about to be averaged
        while training goes on. Training goes on from about where the outer step will
        land (eager updates, after Kale, Douillard and Donchev 2025): the anchor moved
        as the outer optimizer will move it, with this peer's own update standing in for
        the average. (Their share of it, the update over the group size, left the
        inner steps a whole outer step behind: at 80 ms, 25% more loss than plain
        DiLoCo where this start costs 10%, docs/benchmarks.md.) Call it before the round
        starts: the round writes the average into the host buffers."""
        group = self.outer.param_groups[0]
        lr, momentum = group["lr"], group["momentum"]
        with torch.no_grad():
            for p, a, h in zip(self.params, self.anchor, self.buffers.host, strict=True):
                # Nesterov SGD moves by lr x ((1 + m) g + m^2 b) for a new gradient g and
                # the momentum b built up so far; plain SGD by lr x g.
                step = h.to(device=p.device, dtype=p.dtype) * (1 + momentum)
                built = self.outer.state.get(p, {}).get("momentum_buffer")
                if built is not None:
                    step.add_(built, alpha=momentum * momentum)
                p.copy_(a).sub_(step, alpha=lr)
        self.launch_point = [p.detach().clone() for p in self.params]

    def apply_late(self) -> None:
        """Overlap: the round started after :meth:`launched` ended with the swarm's
        average in the host buffers. The outer step moves the anchor as :meth:`apply`
        would, and the local steps taken since the launch are carried over on top of it
        (parameters := new anchor + (parameters - provisional start)). Gradients in the
        parameters (a batch not yet stepped) are left as they were."""
        if self.launch_point is None:
            raise RuntimeError("apply_late without a launched round")
        grads = [p.grad for p in self.params]
        with torch.no_grad():
            for s, p in zip(self.launch_point, self.params, strict=True):
                torch.sub(p, s, out=s)  # the local progress since the launch
        self._outer_step()
        with torch.no_grad():
            for p, s, g in zip(self.params, self.launch_point, grads, strict=True):
                p.add_(s)
                p.grad = g
        self.launch_point = None

    def _outer_step(self) -> None:
        """The outer optimizer steps from the anchor with the host buffers' average as
        its gradient; the result is the new anchor (and the parameters)."""
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                p.copy_(a)
        self.buffers.host_as_gradients(self.params)
        self.outer.step()
        self._anchor_here()

    def _anchor_here(self) -> None:
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor, strict=True):
                a.copy_(p)
