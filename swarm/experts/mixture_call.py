"""Calling many experts at once, as one autograd operation of a mixture of experts.

Each chosen expert is called once with all the samples routed to it (hivemind makes one
call per sample and expert). Calls run concurrently and are collected under a
:class:`Quorum`; an expert that fails or misses the deadline contributes nothing: its
slots stay zero and masked in the forward, its gradients zero in the backward. A
sample left with fewer than ``k_min`` answers fails the call with
:class:`NotEnoughExperts`, naming the experts that failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.autograd.function import once_differentiable

from peers.errors import RemoteError
from peers.facade import BlockingPeer
from swarm.experts.announce import ExpertLocation
from swarm.experts.calls import ExpertCallConfig, Forwarded, call_backward, call_forward
from swarm.experts.dispatch import Quorum
from swarm.experts.errors import NotEnoughExperts
from swarm.experts.remote import run_blocking
from swarm.experts.schema import ExpertInfo

logger = logging.getLogger(__name__)
T = TypeVar("T")
Plan = dict[ExpertLocation, list[tuple[int, int]]]


@dataclass(kw_only=True)
class MixtureCall:
    """What one forward of the mixture needs, and what it learned (``failed``): each
    failure, forward or backward, is also reported to ``on_failure`` (with whether the
    server could not be reached at all) as it is found."""

    peer: BlockingPeer
    plan: Plan
    info: ExpertInfo
    num_slots: int
    calls: ExpertCallConfig
    k_min: int
    backward_k_min: int
    timeout_after_k_min: float
    keep: bool
    """A backward will follow: ask the servers to keep the forward graphs for it."""
    on_failure: Callable[[ExpertLocation, bool], None] | None = None
    failed: set[ExpertLocation] = field(default_factory=set)


async def gather_quorum(
    work: dict[ExpertLocation, Callable[[], Awaitable[T]]],
    rows: dict[ExpertLocation, list[int]],
    k_min: int,
    *,
    timeout: float,
    timeout_after_k_min: float,
) -> tuple[dict[ExpertLocation, T], dict[ExpertLocation, BaseException], Quorum[ExpertLocation]]:
    """Run every call; return the answers that came before the quorum stopped waiting,
    the errors, and the quorum. Calls still running then are cancelled (their servers
    drop them)."""
    loop = asyncio.get_running_loop()
    quorum = Quorum(
        rows, k_min, start=loop.time(), timeout=timeout, timeout_after_k_min=timeout_after_k_min
    )
    tasks = {asyncio.ensure_future(start()): key for key, start in work.items()}
    results: dict[ExpertLocation, T] = {}
    errors: dict[ExpertLocation, BaseException] = {}
    try:
        while tasks and not quorum.finished(loop.time()):
            done, _ = await asyncio.wait(
                tasks,
                timeout=max(0.0, quorum.deadline - loop.time()),
                return_when="FIRST_COMPLETED",
            )
            for task in done:
                key = tasks.pop(task)
                error = task.exception()
                if error is None:
                    results[key] = task.result()
                else:
                    errors[key] = error
                    logger.info("expert %s at %s failed: %r", key.uid, key.peer_id, error)
                quorum.on_done(key, error is None, loop.time())
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
    return results, errors, quorum


def _check_quorum(
    what: str,
    call: MixtureCall,
    plan: Plan,
    quorum: Quorum[ExpertLocation],
    answered: dict[ExpertLocation, Any],
    errors: dict[ExpertLocation, BaseException],
) -> None:
    for loc in set(plan) - set(answered):
        call.failed.add(loc)
        if call.on_failure is not None:
            # A server that answered with an error is alive; one we could not reach (or
            # that broke the protocol) is unreachable: its other experts are likely gone.
            error = errors.get(loc)
            call.on_failure(loc, error is not None and not isinstance(error, RemoteError))
    short = quorum.short_samples()
    if short:
        failed = frozenset(loc.uid for loc in call.failed)
        raise NotEnoughExperts(
            f"{what}: {len(short)} samples (first: {short[:4]}) got fewer than "
            f"{quorum.k_min} expert answers; failed or late: {sorted(failed)[:8]}",
            failed,
        )


class RemoteCallMany(torch.autograd.Function):
    """Outputs ``(mask, *outputs)``: ``mask[i, j]`` says sample i's slot j answered;
    ``outputs[o][i, j]`` is that expert's o-th output (zeros where it did not)."""

    @staticmethod
    def forward(
        ctx: Any, dummy: torch.Tensor, call: MixtureCall, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        sent = [t.detach().cpu() for t in inputs]
        peer = call.peer.peer
        num_samples = sent[0].shape[0]

        def start(loc: ExpertLocation) -> Callable[[], Awaitable[Forwarded]]:
            rows = torch.tensor([s for s, _ in call.plan[loc]])
            part = [t[rows] for t in sent]
            return lambda: call_forward(
                peer, loc, part, config=call.calls, info=call.info, keep=call.keep
            )

        answered, errors, quorum = run_blocking(
            call.peer, _gather(call, call.plan, start, call.k_min, call.calls.forward_timeout)
        )
        _check_quorum("forward", call, call.plan, quorum, answered, errors)
        mask = torch.zeros(num_samples, call.num_slots, dtype=torch.bool)
        outputs = [spec.zeros(num_samples, call.num_slots) for spec in call.info.outputs]
        for loc, (results, _) in answered.items():
            rows, slots = _index(call.plan[loc])
            mask[rows, slots] = True
            for out, result in zip(outputs, results, strict=True):
                out[rows, slots] = result.to(out.dtype)
        ctx.call = call
        ctx.tokens = {loc: token for loc, (_, token) in answered.items()}
        ctx.device = inputs[0].device
        ctx.save_for_backward(*sent)
        mask = mask.to(ctx.device)
        ctx.mark_non_differentiable(mask)
        return (mask, *(t.to(ctx.device) for t in outputs))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_mask: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        call: MixtureCall = ctx.call
        sent = ctx.saved_tensors
        grads = [g.detach().cpu() for g in grad_outputs]
        peer = call.peer.peer
        plan = {loc: call.plan[loc] for loc in ctx.tokens}

        def start(loc: ExpertLocation) -> Callable[[], Awaitable[list[torch.Tensor | None]]]:
            rows, slots = _index(plan[loc])
            part = [t[rows] for t in sent]
            grad_part = [g[rows, slots] for g in grads]
            token = ctx.tokens[loc]
            return lambda: call_backward(
                peer, loc, part, grad_part, config=call.calls, info=call.info, forward_token=token
            )

        answered, errors, quorum = run_blocking(
            call.peer, _gather(call, plan, start, call.backward_k_min, call.calls.backward_timeout)
        )
        _check_quorum("backward", call, plan, quorum, answered, errors)
        grad_inputs: list[torch.Tensor | None] = [
            torch.zeros_like(t) if t.is_floating_point() else None for t in sent
        ]
        for loc, results in answered.items():
            rows, _ = _index(plan[loc])
            for total, grad in zip(grad_inputs, results, strict=True):
                if total is not None and grad is not None:
                    total.index_add_(0, rows, grad.to(total.dtype))
        return (None, None, *(None if g is None else g.to(ctx.device) for g in grad_inputs))


def _gather(
    call: MixtureCall,
    plan: Plan,
    start: Callable[[ExpertLocation], Callable[[], Awaitable[T]]],
    k_min: int,
    timeout: float,
) -> Coroutine[
    Any,
    Any,
    tuple[dict[ExpertLocation, T], dict[ExpertLocation, BaseException], Quorum[ExpertLocation]],
]:
    return gather_quorum(
        {loc: start(loc) for loc in plan},
        {loc: [s for s, _ in pairs] for loc, pairs in plan.items()},
        k_min,
        timeout=timeout,
        timeout_after_k_min=call.timeout_after_k_min,
    )


def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([s for s, _ in pairs]), torch.tensor([j for _, j in pairs])
