"""One hosted module's computation: batched forward, backward, and the optimizer step.

Synchronous torch code, run by the server's worker. Backward takes the inputs again
with the output gradients. By default it recomputes the forward with autograd on, as
hivemind's ``ModuleBackend`` does: no activations are kept per caller, so a caller that
never comes back (a killed laptop, a skipped expert) costs nothing. A caller that will
come back can ask the forward to *keep* its autograd graph (:class:`KeptForward`); its
backward then starts from that graph and skips the recomputation (a third of a
forward+backward's compute), as long as no optimizer step has changed the parameters
since (otherwise it recomputes, on the new parameters, like hivemind).

The optimizer step is separate (:meth:`ModuleBackend.step`), so the server can send the
input gradients first and step while they travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from swarm.experts.schema import FLOAT_DTYPES, ExpertInfo, TensorSpec
from swarm.experts.uids import check_uid

#: Samples of the trial forward that finds a module's output specs: 2, not 1, so that
#: a module that squeezes its batch dimension by mistake is caught.
TRIAL_BATCH_SIZE = 2


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    num_forward_samples: int
    num_backward_samples: int
    num_recomputed_samples: int
    """Backward samples whose forward had to be recomputed (none kept, or stale)."""
    num_batches: int
    num_optimizer_steps: int
    compute_seconds: float


@dataclass(frozen=True, slots=True)
class KeptForward:
    """A forward's autograd graph, kept for its backward."""

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]
    step: int
    """The parameters' version (see :meth:`ModuleBackend.parameters_changed`): a later
    optimizer step or outside change makes it stale."""


class ModuleBackend:
    """A torch module hosted under ``uid``, with its input specs and its optimizer."""

    def __init__(
        self,
        uid: str,
        module: nn.Module,
        *,
        inputs: Sequence[TensorSpec],
        max_batch_size: int,
        optimizer: torch.optim.Optimizer | None = None,
        clip_grad_norm: float | None = None,
    ) -> None:
        self.uid = check_uid(uid)
        self.module = module
        first = next(iter(module.parameters()), None)
        self.device = torch.device("cpu") if first is None else first.device
        """Where the module lives (its first parameter's device): inputs go there,
        results come back to the CPU to be sent."""
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        trial = [spec.zeros(TRIAL_BATCH_SIZE).to(self.device) for spec in inputs]
        with torch.no_grad():
            outputs = _as_list(module(*trial))
        if any(t.shape[:1] != (TRIAL_BATCH_SIZE,) for t in outputs):
            raise ValueError(f"module {uid} must return batch-first tensors")
        self.info = ExpertInfo(
            uid=uid,
            inputs=list(inputs),
            outputs=[TensorSpec.of_sample(t) for t in outputs],
            max_batch_size=max_batch_size,
        )
        self._num_forward = self._num_backward = self._num_recomputed = 0
        self._num_batches = self._num_steps = 0
        self._version = 0  # bumped by every change of the parameters: steps and others
        self._compute_seconds = 0.0

    def forward(
        self, inputs: Sequence[torch.Tensor], *, keep: bool = False
    ) -> tuple[list[torch.Tensor], KeptForward | None]:
        """Outputs for a batch, and its graph if ``keep``."""
        self._num_forward += inputs[0].shape[0]
        self._num_batches += 1
        if not keep:
            with torch.no_grad():
                return _to_cpu(self.module(*self._here(inputs))), None
        with torch.enable_grad():
            leaves = _leaves(self._here(inputs))
            outputs = _as_list(self.module(*leaves))
        return _to_cpu(outputs), KeptForward(leaves, outputs, self._version)

    def _here(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to(self.device, non_blocking=True) for t in tensors]

    def is_fresh(self, kept: KeptForward) -> bool:
        return kept.step == self._version

    def parameters_changed(self) -> None:
        """The parameters were changed outside :meth:`step` (averaged with replicas,
        loaded from peers): graphs kept before are stale. Call it from
        :meth:`swarm.experts.worker.ModuleWorker.exclusive`, where no batch runs."""
        self._version += 1

    def backward(
        self,
        inputs: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor],
        kept: KeptForward | None = None,
    ) -> list[torch.Tensor | None]:
        """Gradients of the inputs (``None`` for integer ones) given the outputs';
        accumulates parameter gradients for the next :meth:`step`. Starts from ``kept``
        if it is fresh, else recomputes the forward."""
        if kept is None or not self.is_fresh(kept):
            self._num_recomputed += inputs[0].shape[0]
            with torch.enable_grad():
                leaves = _leaves(self._here(inputs))
                kept = KeptForward(leaves, _as_list(self.module(*leaves)), self._version)
        grads = [
            g.to(o.device, o.dtype, non_blocking=True)
            for g, o in zip(grad_outputs, kept.outputs, strict=True)
        ]
        torch.autograd.backward(kept.outputs, grad_tensors=grads)
        self._num_backward += inputs[0].shape[0]
        self._num_batches += 1
        return [
            (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).cpu()
            if spec.dtype in FLOAT_DTYPES
            else None
            for leaf, spec in zip(kept.leaves, self.info.inputs, strict=True)
        ]

    def step(self) -> None:
        """Apply the accumulated gradients (clipped if configured), then clear them."""
        if self.optimizer is None:
            for p in self.module.parameters():  # nothing trains it: do not let grads pile up
                p.grad = None
            return
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.module.parameters(), self.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._num_steps += 1
        self._version += 1

    def add_compute_seconds(self, seconds: float) -> None:
        self._compute_seconds += seconds

    def statistics(self) -> BackendStatistics:
        return BackendStatistics(
            num_forward_samples=self._num_forward,
            num_backward_samples=self._num_backward,
            num_recomputed_samples=self._num_recomputed,
            num_batches=self._num_batches,
            num_optimizer_steps=self._num_steps,
            compute_seconds=self._compute_seconds,
        )


def _leaves(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]


def _to_cpu(outputs: object) -> list[torch.Tensor]:
    return [t.detach().cpu() for t in _as_list(outputs)]


def _as_list(outputs: object) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, tuple | list) and all(isinstance(t, torch.Tensor) for t in outputs):
        return list(outputs)
    raise TypeError(f"a hosted module must return tensors, not {type(outputs).__name__}")
