"""``RemoteSequential``: a model whose stages run on the swarm, as one torch module.

For plain (non-async) training code: calls run on the event loop thread of a
:class:`peers.dht.BlockingDHT` and block until done. ``model(x)`` sends ``x`` through
every stage (one micro-batch; autograd works: ``loss.backward()`` goes back through
the same servers, which train their stages); :meth:`RemoteSequential.train_step` puts
several micro-batches in flight at once, which is where a pipeline gains its speed.
From async code use :class:`swarm.pipeline.PipelineClient` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from peers.dht import BlockingDHT
from swarm.experts.remote import DUMMY, run_blocking
from swarm.pipeline.client import LossFn, PipelineClient, PipelineConfig, PipelineStatistics


class RemoteSequential(nn.Module):
    """The stages ``config`` names, served by whoever announces them in ``dht``.

    Raises, from forward, backward and :meth:`train_step`: :class:`StageUnavailable`
    when a stage has no live server within ``server_wait_timeout``, :class:`StageFailed`
    when a stage call fails ``max_attempts`` times (failed servers are banned and their
    micro-batches rerouted without an error); ``ExpertError`` when called from a thread
    that runs an event loop.
    """

    def __init__(self, dht: BlockingDHT, config: PipelineConfig) -> None:
        super().__init__()
        self.dht = dht
        self.config = config
        self.client = PipelineClient(dht.node, config)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The last stage's outputs (one tensor, or a tuple for several)."""
        keep = torch.is_grad_enabled()  # a backward will follow: let servers keep graphs
        outputs: tuple[torch.Tensor, ...] = _PipelineCall.apply(DUMMY, self, keep, *inputs)  # type: ignore[no-untyped-call]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def train_step(
        self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
    ) -> list[float]:
        """Train on every ``(inputs, targets)`` micro-batch, all in flight at once:
        forward through the stages, ``loss_fn(outputs, targets)`` computed here (on the
        event loop thread: keep it cheap), backward through the same servers. Each
        stage server steps its optimizer on every backward it serves; synchronous
        (``config.synchronous``), the micro-batches are one global batch and every
        stage steps once, after them, on its whole gradient (:meth:`end_step`). Returns
        the micro-batches' losses."""
        return run_blocking(self.dht.peer, self.client.train(micro_batches, loss_fn))

    def end_step(self) -> int:
        """Synchronous stages: step every stage on the gradients of the backward passes
        since the last step (:meth:`PipelineClient.end_step`), as ``optimizer.step()``
        would after ``loss.backward()``; returns the steps taken so far."""
        return run_blocking(self.dht.peer, self.client.end_step())

    def refresh(self) -> None:
        """Re-read the stages' servers from the DHT now."""
        run_blocking(self.dht.peer, self.client.refresh())

    def statistics(self) -> PipelineStatistics:
        return self.client.statistics()

    def extra_repr(self) -> str:
        return f"stages={self.config.uids}"


class _PipelineCall(torch.autograd.Function):
    """One micro-batch through every stage; its backward goes back through them."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        dummy: torch.Tensor,
        model: RemoteSequential,
        keep: bool,
        *inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        device = inputs[0].device
        outputs, trace = run_blocking(model.dht.peer, model.client.forward(inputs, keep=keep))
        ctx.model = model  # type: ignore[attr-defined]
        ctx.trace = trace  # type: ignore[attr-defined]
        ctx.device = device  # type: ignore[attr-defined]
        return tuple(t.to(device) for t in outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        model: RemoteSequential = ctx.model
        coro = model.client.backward(ctx.trace, grad_outputs)
        grads = run_blocking(model.dht.peer, coro)
        return (None, None, None, *(None if g is None else g.to(ctx.device) for g in grads))
