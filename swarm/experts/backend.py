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

Gradients are clipped by default (:data:`DEFAULT_CLIP_GRAD_NORM`), twice: each caller's
*contribution* to a step (the gradients of its requests in the batch, closed by
:meth:`ModuleBackend.end_contribution`) on its own, then, if a batch held several
callers, their sum. So an SGD step moves the parameters by at most ``lr *
clip_grad_norm`` whatever the callers sent, and one caller's huge gradient cannot drown
out the others' in a step they share. A contribution whose norm is not finite (finite
values can overflow in the backward) is dropped. See docs/experts-trust.md.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from swarm.experts.schema import FLOAT_DTYPES, ExpertInfo, TensorSpec
from swarm.experts.uids import check_uid

#: Default bound on the gradient norm of each caller's contribution to an optimizer step,
#: and of the step's whole gradient. 1.0 is the usual bound of large-model recipes (GPT-3,
#: Llama, torchtitan's ``max_norm``): honest gradients of a well-scaled loss are mostly
#: below it, so it seldom changes an honest step; and it is what makes a step's size
#: independent of what a caller sends: a backward with gradients a million times too
#: large moves SGD's parameters by at most ``lr * 1.0``, and cannot fill Adam's second
#: moment with a value that freezes the module's training for thousands of steps.
DEFAULT_CLIP_GRAD_NORM = 1.0
#: Samples of the trial forward that finds a module's output specs: 2, not 1, so that
#: a module that squeezes its batch dimension by mistake is caught.
TRIAL_BATCH_SIZE = 2
#: Most tags :attr:`ModuleBackend.counted` keeps (one per backward pass named by its
#: caller, until the step): past it, the rest are one :data:`COUNTED_OVERFLOW`.
MAX_COUNTED_PASSES = 1 << 16
COUNTED_OVERFLOW = "more passes than MAX_COUNTED_PASSES"


@dataclass(frozen=True, slots=True)
class BackendStatistics:
    num_forward_samples: int
    num_backward_samples: int
    num_recomputed_samples: int
    """Backward samples whose forward had to be recomputed (none kept, or stale)."""
    num_batches: int
    num_optimizer_steps: int
    compute_seconds: float
    num_contributions: int = 0
    """Callers' contributions to optimizer steps (see :meth:`ModuleBackend.end_contribution`)."""
    num_clipped_contributions: int = 0
    """Contributions whose gradient norm exceeded ``clip_grad_norm`` (scaled down to it).
    Most of them clipped, from honest callers, means the bound is too low for the loss."""
    num_dropped_contributions: int = 0
    """Contributions dropped because their gradient norm was not finite."""


@dataclass(frozen=True, slots=True)
class KeptForward:
    """A forward's autograd graph, kept for its backward."""

    leaves: list[torch.Tensor]
    outputs: list[torch.Tensor]
    step: int
    """The parameters' version (see :meth:`ModuleBackend.parameters_changed`): a later
    optimizer step or outside change makes it stale."""


class ModuleBackend:
    """A torch module hosted under ``uid``, with its input specs and its optimizer.

    ``clip_grad_norm`` bounds the gradient norm of each caller's contribution to a step
    and of the step's sum (:data:`DEFAULT_CLIP_GRAD_NORM`); ``None`` turns clipping off,
    for a module whose callers are all trusted. ValueError for one that is not finite
    and positive. With ``step_on_backward=False`` the server's worker does not step after
    a backward: gradients accumulate until the owner steps (a synchronous pipeline
    stage, :mod:`swarm.pipeline.sync`)."""

    def __init__(
        self,
        uid: str,
        module: nn.Module,
        *,
        inputs: Sequence[TensorSpec],
        max_batch_size: int,
        optimizer: torch.optim.Optimizer | None = None,
        clip_grad_norm: float | None = DEFAULT_CLIP_GRAD_NORM,
        step_on_backward: bool = True,
    ) -> None:
        check_clip_grad_norm(clip_grad_norm)
        self.step_on_backward = step_on_backward
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
        # The step's gradient so far: each closed contribution, clipped, summed (held by
        # reference: the first one's tensors become the sum, so one caller costs no copy).
        self._summed: dict[nn.Parameter, torch.Tensor] = {}
        self._num_summed = 0
        self._num_contributions = self._num_clipped = self._num_dropped = 0
        self._counted: list[Hashable] = []  # the tags of the backward passes in the sum

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
        tags: Sequence[Hashable] = (),
    ) -> list[torch.Tensor | None]:
        """Gradients of the inputs (``None`` for integer ones) given the outputs';
        accumulates parameter gradients for the next :meth:`step`. Starts from ``kept``
        if it is fresh, else recomputes the forward. All or nothing: the parameters'
        gradients are computed apart and added only once all are, so a backward that
        fails leaves those accumulated before it as they were. ``tags`` name the passes
        the batch holds: once added, they are in :attr:`counted`."""
        if kept is None or not self.is_fresh(kept):
            self._num_recomputed += inputs[0].shape[0]
            with torch.enable_grad():
                leaves = _leaves(self._here(inputs))
                kept = KeptForward(leaves, _as_list(self.module(*leaves)), self._version)
        grads = [
            g.to(o.device, o.dtype, non_blocking=True)
            for g, o in zip(grad_outputs, kept.outputs, strict=True)
        ]
        params = [p for p in self.module.parameters() if p.requires_grad]
        leaves = [leaf for leaf in kept.leaves if leaf.requires_grad]
        found = torch.autograd.grad(
            kept.outputs, [*params, *leaves], grad_outputs=grads, allow_unused=True
        )
        with torch.no_grad():
            for p, g in zip(params, found[: len(params)], strict=True):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        self._counted.extend(tags)
        if len(self._counted) > MAX_COUNTED_PASSES:  # bounded: the rest is one mark
            del self._counted[MAX_COUNTED_PASSES - 1 :]
            self._counted.append(COUNTED_OVERFLOW)
        self._num_backward += inputs[0].shape[0]
        self._num_batches += 1
        of_leaf = {id(leaf): g for leaf, g in zip(leaves, found[len(params) :], strict=True)}
        out: list[torch.Tensor | None] = []
        for leaf, spec in zip(kept.leaves, self.info.inputs, strict=True):
            leaf_grad = of_leaf.get(id(leaf))
            if spec.dtype not in FLOAT_DTYPES:
                out.append(None)
            else:
                out.append((leaf_grad if leaf_grad is not None else torch.zeros_like(leaf)).cpu())
        return out

    def end_contribution(self) -> None:
        """The gradients accumulated since the last call are one caller's contribution
        to the next step: clip them to ``clip_grad_norm`` on their own (drop them if
        their norm is not finite) and add them to the step's sum. Without clipping, or
        without an optimizer, it does nothing: the gradients simply accumulate."""
        if self.clip_grad_norm is None or self.optimizer is None:
            return
        params = [p for p in self.module.parameters() if p.grad is not None]
        if not params:
            return
        self._num_contributions += 1
        norm = clip_gradients([p.grad for p in params if p.grad is not None], self.clip_grad_norm)
        if not math.isfinite(norm):
            self._num_dropped += 1
        else:
            if norm > self.clip_grad_norm:
                self._num_clipped += 1
            self._num_summed += 1
            for p in params:
                assert p.grad is not None
                total = self._summed.get(p)
                if total is None:
                    self._summed[p] = p.grad
                else:
                    total.add_(p.grad)
        for p in params:
            p.grad = None

    def take_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """The gradients accumulated for the next step (each caller's contribution
        clipped, as :meth:`step` would use them), taken: the module holds none after.
        For an owner that steps with them itself (a synchronous stage)."""
        params = list(self.module.parameters())
        if self.clip_grad_norm is not None and self.optimizer is not None:
            self.end_contribution()
            taken, self._summed, self._num_summed = self._summed, {}, 0
        else:
            taken = {p: p.grad for p in params if p.grad is not None}
        for p in params:
            p.grad = None
        self._counted.clear()
        return taken

    @property
    def counted(self) -> tuple[Hashable, ...]:
        """The tags of the backward passes whose gradients the module holds for the
        next step (as :meth:`backward` was given them; a pass counted twice is here
        twice), until they are taken, stepped or discarded. Past
        :data:`MAX_COUNTED_PASSES` the rest are one :data:`COUNTED_OVERFLOW`."""
        return tuple(self._counted)

    def step_with(self, grads: Mapping[nn.Parameter, torch.Tensor]) -> bool:
        """Step the optimizer on ``grads`` (clipped as a whole to ``clip_grad_norm``)
        instead of accumulated ones; False, and nothing stepped, if their norm is not
        finite. Any gradients accumulated meanwhile are dropped."""
        self.discard_gradients()
        if self.optimizer is None:
            return True
        with torch.no_grad():
            for p, grad in grads.items():
                p.grad = grad.to(p.device, p.dtype, copy=True)
            present = [p.grad for p in grads if p.grad is not None]
            if self.clip_grad_norm is not None and present:
                if not math.isfinite(clip_gradients(present, self.clip_grad_norm)):
                    self.discard_gradients()
                    return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._num_steps += 1
        self._version += 1
        return True

    def discard_gradients(self) -> None:
        """Forget the gradients accumulated for the next step (a failed batch's)."""
        self._summed.clear()
        self._num_summed = 0
        self._counted.clear()
        for p in self.module.parameters():
            p.grad = None

    def step(self) -> None:
        """Apply the accumulated gradients (clipped if configured), then clear them.
        Gradients not yet closed by :meth:`end_contribution` count as one contribution."""
        if self.optimizer is None:
            self.discard_gradients()  # nothing trains it: do not let grads pile up
            return
        if self.clip_grad_norm is not None:
            self.end_contribution()
            for p, total in self._summed.items():
                p.grad = total
            if self._num_summed > 1:  # one contribution is clipped already
                clip_gradients(list(self._summed.values()), self.clip_grad_norm)
            empty = not self._summed  # every contribution was dropped
            self._summed = {}
            self._num_summed = 0
            self._counted.clear()
            if empty:
                return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._counted.clear()
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
            num_contributions=self._num_contributions,
            num_clipped_contributions=self._num_clipped,
            num_dropped_contributions=self._num_dropped,
        )


def check_clip_grad_norm(value: float | None) -> float | None:
    """``value`` itself; ValueError unless it is ``None`` (no clipping) or finite and
    positive (infinity would be clipping that never clips: say ``None``)."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"clip_grad_norm must be finite and positive, or None for no clipping; got {value!r}"
        )
    return value


def clip_gradients(grads: Sequence[torch.Tensor], max_norm: float) -> float:
    """The total 2-norm of ``grads``; if it is finite and over ``max_norm``, scales them in
    place to ``max_norm``. Unlike ``nn.utils.clip_grad_norm_``, gradients under the bound
    are left alone rather than multiplied by 1: a second pass over them that most honest
    steps need not pay. Half-precision gradients are summed in float32, so an honest
    norm past 65504 is not taken for an overflow."""
    norms = [
        torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
        for g in grads
    ]
    norm = float(torch.linalg.vector_norm(torch.stack([n.double() for n in norms])))
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


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
