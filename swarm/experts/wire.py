"""The experts protocol: typed messages, protocol ids, and tensor (de)compression.

Three unary RPCs, one stream each (``peers.rpc``): ``info`` (a module's schema),
``forward`` (inputs -> outputs) and ``backward`` (inputs and output gradients -> input
gradients; the server backpropagates and steps its optimizer, recomputing the forward
as hivemind's ``ModuleBackend`` does unless the forward kept its graph for it). Tensors
travel as ``torch.Tensor`` (raw bytes after the msgpack head, no copy on the way out)
or, compressed, as an :class:`averaging.compression.EncodedTensor`. A request names the
codec its reply should use, so one call compresses both ways. Fields added later have
defaults, so older peers still decode newer messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from averaging.compression import (
    BFloat16Codec,
    Blockwise8BitCodec,
    Codec,
    CompressionError,
    EncodedTensor,
    EncodeError,
    Float16Codec,
    Uniform8BitCodec,
)
from averaging.compression.base import all_finite
from swarm.experts.schema import ExpertInfo

INFO_PROTOCOL = "/swarmtrain/experts/info/1.0.0"
FORWARD_PROTOCOL = "/swarmtrain/experts/forward/1.0.0"
BACKWARD_PROTOCOL = "/swarmtrain/experts/backward/1.0.0"

#: Codecs activations and gradients may travel with. "none" is a plain tensor. Top-k and
#: PowerSGD are left out: they need error-feedback state across calls, which a stateless
#: request cannot carry.
CODECS: Mapping[str, Codec | None] = MappingProxyType(
    {
        "none": None,
        "float16": Float16Codec(),
        "bfloat16": BFloat16Codec(),
        "uint8": Uniform8BitCodec(),
        "blockwise8": Blockwise8BitCodec(),
    }
)

WireTensor = torch.Tensor | EncodedTensor


@dataclass(frozen=True, slots=True)
class InfoRequest:
    uid: str


@dataclass(frozen=True, slots=True)
class ForwardRequest:
    uid: str
    inputs: list[WireTensor]
    reply_codec: str = "none"
    keep: bool = False
    """The caller will send a backward: keep this forward's graph for it if possible."""
    step: int = -1
    """A synchronous pipeline stage's step the caller computes for; -1: none named."""


@dataclass(frozen=True, slots=True)
class ForwardResponse:
    outputs: list[WireTensor]
    forward_token: int = 0
    """Names the kept graph in the caller's backward; 0 if none was kept."""


@dataclass(frozen=True, slots=True)
class BackwardRequest:
    uid: str
    inputs: list[WireTensor]
    grad_outputs: list[WireTensor]
    reply_codec: str = "none"
    forward_token: int = 0
    """From the forward's response; the server recomputes the forward without it."""
    step: int = -1
    """A synchronous pipeline stage's step the caller computes for; -1: none named."""
    pass_id: int = 0
    """Names this backward pass among the caller's (the same in each retry of it), so
    a synchronous stage can tell which passes its gradients hold; 0: none named."""


@dataclass(frozen=True, slots=True)
class BackwardResponse:
    grad_inputs: list[WireTensor | None]
    """One per input; ``None`` for inputs that take no gradient (integer ones)."""


InfoResponse = ExpertInfo


def check_codec(name: str) -> str:
    """``name`` itself; ValueError if it is not one of :data:`CODECS`."""
    if name not in CODECS:
        raise ValueError(f"codec {name!r} is not one of {sorted(CODECS)}")
    return name


def encode(tensor: torch.Tensor, codec: str) -> WireTensor:
    """``tensor`` ready to send with ``codec``. A tensor the codec cannot carry (float16
    past 65504, an integer tensor) goes uncompressed rather than failing the call."""
    compressor = CODECS[codec]
    if compressor is not None and tensor.is_floating_point() and tensor.numel():
        try:
            return compressor.encode(tensor)
        except EncodeError:
            pass
    return tensor.detach().contiguous()


def decode(item: WireTensor) -> torch.Tensor:
    """A received tensor; ValueError for an encoded one with an unknown codec or a bad
    payload (whoever sent it is at fault; callers wrap it in their error)."""
    if isinstance(item, torch.Tensor):
        return item
    codec = CODECS.get(item.codec)
    if codec is None:
        raise ValueError(f"tensor encoded with {item.codec!r}, not one of {sorted(CODECS)}")
    try:
        return codec.decode(item)
    except CompressionError as e:
        raise ValueError(f"bad {item.codec} payload: {e}") from e


def check_finite(what: str, tensors: Sequence[torch.Tensor | None]) -> None:
    """ValueError if a floating tensor holds NaN or infinity: one such value in a
    backward would poison the module's parameters for everyone. (A finite sum proves a
    tensor finite: one pass, no mask, far cheaper than ``isfinite().all()``
    (docs/benchmarks.md, "Figures behind constants").)"""
    for i, t in enumerate(tensors):
        if t is not None and t.is_floating_point() and not all_finite(t):
            raise ValueError(f"{what}[{i}] holds NaN or infinite values")
