"""Calling one expert: the async core under :class:`RemoteExpert` and the mixture.

Each call is one unary RPC with the config's deadline; the server gets the same
deadline and drops the request when it passes (``peers.rpc``). Raises ``TimeoutError``
when the deadline passes, :class:`peers.RemoteError` when the server refused the
request (``BadExpertRequest``, ``ServerBusy``) or its module raised, the dial errors of
``peers`` when the server cannot be reached, and :class:`ExpertProtocolError` when its
reply does not match the expert's schema.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from peers.host import Peer
from peers.serialization import MAX_FRAME_BYTES
from swarm.experts.announce import ExpertLocation
from swarm.experts.errors import ExpertProtocolError
from swarm.experts.schema import ExpertInfo, TensorSpec, check_batch
from swarm.experts.wire import (
    BACKWARD_PROTOCOL,
    FORWARD_PROTOCOL,
    INFO_PROTOCOL,
    BackwardRequest,
    BackwardResponse,
    ForwardRequest,
    ForwardResponse,
    InfoRequest,
    WireTensor,
    check_codec,
    check_finite,
    decode,
    encode,
)

#: Room in a reply frame beyond its tensors' bytes (msgpack head, descriptors).
REPLY_SLACK_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class ExpertCallConfig:
    """Deadlines and compression of calls to remote experts."""

    forward_timeout: float = 30.0
    """Seconds a forward call may take, dial included."""
    backward_timeout: float = 60.0
    """Seconds a backward call may take (the server recomputes the forward in it)."""
    info_timeout: float = 10.0
    """Seconds to fetch an expert's schema."""
    codec: str = "none"
    """How activations and gradients travel, both ways: ``none``, ``float16``,
    ``bfloat16``, ``uint8`` or ``blockwise8`` (see ``swarm.experts.wire.CODECS``)."""

    def __post_init__(self) -> None:
        check_codec(self.codec)
        for name in ("forward_timeout", "backward_timeout", "info_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and positive, got {value!r}")


class Forwarded(NamedTuple):
    outputs: list[torch.Tensor]
    forward_token: int
    """Names the graph the server kept for the backward (0: none)."""


def learn_addresses(peer: Peer, location: ExpertLocation) -> None:
    """Give ``peer`` the announced addresses of ``location``'s server if it must dial."""
    # Only while not connected: a call over a live connection needs no address, and the
    # hot path stays a dictionary lookup. A server's addresses change (one behind NAT
    # first announces its bound address, then relayed ones once AutoNAT finds it
    # private), so the newest announced ones are added each time we must dial.
    if location.addrs and peer.connection_to(location.peer_id) is None:
        peer.add_addresses(location.peer_id, location.addrs)


def _frame_bytes(info: ExpertInfo | None) -> int:
    largest = 0 if info is None else info.max_request_bytes
    return max(MAX_FRAME_BYTES, largest + REPLY_SLACK_BYTES)


async def call_info(peer: Peer, location: ExpertLocation, *, timeout: float) -> ExpertInfo:
    """The expert's schema, as its server declares it."""
    learn_addresses(peer, location)
    info = await peer.call_unary(
        location.peer_id, INFO_PROTOCOL, InfoRequest(location.uid), ExpertInfo, timeout=timeout
    )
    if info.uid != location.uid:
        raise ExpertProtocolError(f"{location.peer_id} answered for {info.uid}, not {location.uid}")
    return info


async def call_forward(
    peer: Peer,
    location: ExpertLocation,
    inputs: Sequence[torch.Tensor],
    *,
    config: ExpertCallConfig,
    info: ExpertInfo | None = None,
    keep: bool = False,
    step: int = -1,
) -> Forwarded:
    """The expert's outputs for ``inputs`` (batch-first). Inputs are sent as they are:
    the server checks them (see the module docstring for errors). With ``keep`` the
    server may keep the forward's graph: pass the returned token to the backward."""
    learn_addresses(peer, location)
    wire = [encode(t, config.codec) for t in inputs]
    request = ForwardRequest(location.uid, wire, config.codec, keep, step)
    response = await peer.call_unary(
        location.peer_id,
        FORWARD_PROTOCOL,
        request,
        ForwardResponse,
        timeout=config.forward_timeout,
        max_frame_bytes=_frame_bytes(info),
    )
    specs = None if info is None else info.outputs
    outputs = _receive(location, "outputs", response.outputs, specs, inputs[0].shape[0])
    return Forwarded(outputs, response.forward_token)


async def call_backward(
    peer: Peer,
    location: ExpertLocation,
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
    *,
    config: ExpertCallConfig,
    info: ExpertInfo | None = None,
    forward_token: int = 0,
    step: int = -1,
    pass_id: int = 0,
) -> list[torch.Tensor | None]:
    """Gradients of ``inputs`` given the outputs' gradients (``None`` for integer
    inputs); the server also trains the expert on them. ``forward_token`` (from the
    forward) lets it skip recomputing the forward. ``step`` (a synchronous pipeline
    stage's) is refused by a server at another step; ``pass_id`` names the pass there
    (:attr:`BackwardRequest.pass_id`)."""
    learn_addresses(peer, location)
    request = BackwardRequest(
        location.uid,
        [encode(t, config.codec) for t in inputs],
        [encode(g, config.codec) for g in grad_outputs],
        config.codec,
        forward_token,
        step,
        pass_id,
    )
    response = await peer.call_unary(
        location.peer_id,
        BACKWARD_PROTOCOL,
        request,
        BackwardResponse,
        timeout=config.backward_timeout,
        max_frame_bytes=_frame_bytes(info),
    )
    grads = response.grad_inputs
    if len(grads) != len(inputs):
        raise ExpertProtocolError(
            f"{location.uid} at {location.peer_id} sent {len(grads)} input gradients "
            f"for {len(inputs)} inputs"
        )
    present = [
        (g, TensorSpec.of_sample(t)) for g, t in zip(grads, inputs, strict=True) if g is not None
    ]
    received = iter(
        _receive(
            location,
            "grad_inputs",
            [g for g, _ in present],
            [s for _, s in present],
            inputs[0].shape[0],
        )
    )
    return [None if g is None else next(received) for g in grads]


def _receive(
    location: ExpertLocation,
    what: str,
    items: Sequence[WireTensor],
    specs: Sequence[TensorSpec] | None,
    batch_size: int,
) -> list[torch.Tensor]:
    """Check a reply's tensors (against ``specs`` if known, and ``batch_size``), then
    decode them; ExpertProtocolError (the server's fault) on any mismatch."""
    try:
        if specs is not None and len(items) != len(specs):
            raise ValueError(f"{what}: expected {len(specs)} tensors, got {len(items)}")
        if specs is not None and items:
            check_batch(what, items, specs, batch_size, batch_size)
        tensors = [decode(item) for item in items]
        if any(t.shape[:1] != (batch_size,) for t in tensors):
            raise ValueError(f"{what}: batch size differs from the {batch_size} sent")
        check_finite(what, tensors)
    except ValueError as e:
        raise ExpertProtocolError(f"{location.uid} at {location.peer_id}: {e}") from None
    return tensors
