"""``RemoteExpert``: a torch module whose forward and backward run on a server.

For plain (non-async) training code: calls go through a :class:`peers.BlockingPeer`,
whose event loop runs in its own thread, and block until the server answers or the
deadline passes. Autograd works across the network: ``loss.backward()`` sends the
inputs and output gradients back to the server, which returns the input gradients and
takes an optimizer step on its parameters. From async code, use
:func:`swarm.experts.call_forward` and :func:`swarm.experts.call_backward` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch
from torch import nn
from torch.autograd.function import FunctionCtx, once_differentiable

from peers.dht import BlockingDHT
from peers.facade import BlockingPeer
from swarm.experts.announce import ExpertLocation, find_experts
from swarm.experts.calls import ExpertCallConfig, call_backward, call_forward, call_info
from swarm.experts.errors import ExpertError, ExpertInputError
from swarm.experts.schema import ExpertInfo, check_batch

T = TypeVar("T")

#: Requires grad, so autograd calls our backward (and the server trains the expert)
#: even when no input requires grad, as in hivemind.
DUMMY = torch.empty(0, requires_grad=True)


def run_blocking(peer: BlockingPeer, coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the peer's loop and wait. ExpertError if this thread runs an
    event loop itself: waiting there would stop it (and, on the peer's loop, deadlock)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return peer.run(coro)
    coro.close()
    raise ExpertError(
        "remote expert modules block until the server answers: call them from a thread "
        "without a running event loop (e.g. asyncio.to_thread), or await call_forward / "
        "call_backward directly"
    )


def get_remote_experts(
    dht: BlockingDHT,
    uids: Sequence[str],
    config: ExpertCallConfig | None = None,
    *,
    timeout: float = 30.0,
) -> dict[str, RemoteExpert | None]:
    """A :class:`RemoteExpert` for each uid announced in the DHT (its least loaded
    server), ``None`` for uids nobody serves. ValueError for an invalid uid;
    TimeoutError after ``timeout`` seconds."""
    found = run_blocking(dht.peer, asyncio.wait_for(find_experts(dht.node, uids), timeout))
    return {
        uid: RemoteExpert(entries[0].location, dht.peer, config) if entries else None
        for uid, entries in found.items()
    }


class RemoteExpert(nn.Module):
    """The expert at ``location``, called through ``peer``."""

    def __init__(
        self,
        location: ExpertLocation,
        peer: BlockingPeer,
        config: ExpertCallConfig | None = None,
        *,
        info: ExpertInfo | None = None,
    ) -> None:
        super().__init__()
        self.location = location
        self.peer = peer
        self.config = config or ExpertCallConfig()
        self._info = info

    @property
    def uid(self) -> str:
        return self.location.uid

    @property
    def info(self) -> ExpertInfo:
        """The expert's schema, fetched from its server on first use."""
        if self._info is None:
            coro = call_info(self.peer.peer, self.location, timeout=self.config.info_timeout)
            self._info = run_blocking(self.peer, coro)
        return self._info

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Outputs of the remote module (one tensor, or a tuple for several). Raises
        :class:`ExpertInputError` before sending if ``inputs`` do not match the schema;
        otherwise the errors of :func:`swarm.experts.call_forward`."""
        info = self.info
        try:
            check_batch("inputs", inputs, info.inputs, info.max_batch_size)
        except ValueError as e:
            raise ExpertInputError(f"{self.uid}: {e}") from None
        keep = torch.is_grad_enabled()  # a backward will follow: let the server keep the graph
        outputs: tuple[torch.Tensor, ...] = _RemoteCall.apply(DUMMY, self, keep, *inputs)  # type: ignore[no-untyped-call]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def extra_repr(self) -> str:
        return f"uid={self.uid}, server={self.location.peer_id}"


class _RemoteCall(torch.autograd.Function):
    """One remote forward; its backward is one remote backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        dummy: torch.Tensor,
        expert: RemoteExpert,
        keep: bool,
        *inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        device = inputs[0].device
        sent = [t.detach().cpu() for t in inputs]
        coro = call_forward(
            expert.peer.peer,
            expert.location,
            sent,
            config=expert.config,
            info=expert.info,
            keep=keep,
        )
        outputs, token = run_blocking(expert.peer, coro)
        ctx.expert = expert  # type: ignore[attr-defined]
        ctx.forward_token = token  # type: ignore[attr-defined]
        ctx.device = device  # type: ignore[attr-defined]
        ctx.save_for_backward(*sent)
        return tuple(t.to(device) for t in outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        expert: RemoteExpert = ctx.expert
        inputs = ctx.saved_tensors
        grads = [g.detach().cpu() for g in grad_outputs]
        coro = call_backward(
            expert.peer.peer,
            expert.location,
            inputs,
            grads,
            config=expert.config,
            info=expert.info,
            forward_token=ctx.forward_token,
        )
        grad_inputs = run_blocking(expert.peer, coro)
        return (None, None, None, *(None if g is None else g.to(ctx.device) for g in grad_inputs))
