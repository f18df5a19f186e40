"""Picking a codec for a tensor by its size and role, and decoding by codec name.

The table :func:`choose_codec` follows (n = number of elements):

=================  ===========  ======================  ==============
role               n < 4096     4096 <= n < 65536       n >= 65536
=================  ===========  ======================  ==============
gradient           none         16-bit                  blockwise8
delta              none         16-bit                  blockwise8
parameter          none         16-bit                  16-bit
optimizer_state    none         bfloat16                bfloat16
=================  ===========  ======================  ==============

"16-bit" is float16 for float32 tensors whose values fit it (max|t| <= 65504; it is
three bits more precise than bfloat16) and bfloat16 otherwise, and for 16-bit tensors
their own dtype (exact). Optimizer state is bfloat16 because Adam's second moment spans
many decades and float16 flushes its small values to zero. float64 tensors always go
uncompressed (only "none" carries them exactly).

Why: small tensors (biases, norms) are a sliver of the bytes, and the most sensitive to
error; large gradients and parameter deltas are averaged every round and tolerate
8-bit noise (hivemind's examples quantize gradients to 8 bits past 2**16 elements);
parameters are averaged rarely and their error stays in the model, so they keep 16 bits.
Top-k and PowerSGD are never chosen here: they need :class:`ErrorFeedback` state owned
by the caller, who opts in.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal, get_args

import torch

from averaging.compression.base import (
    LOSSY_DTYPES,
    Codec,
    CompressionError,
    EncodedTensor,
    dtype_name,
)
from averaging.compression.casts import BFloat16Codec, Float16Codec, NoneCodec
from averaging.compression.powersgd import PowerSGDCodec
from averaging.compression.quantization import Blockwise8BitCodec, Uniform8BitCodec
from averaging.compression.sparse import TopKCodec

Role = Literal["gradient", "parameter", "optimizer_state", "delta"]
ROLES: tuple[str, ...] = get_args(Role)

#: Below this many elements (16 KiB of float32) a tensor goes uncompressed: halving it
#: saves at most 8 KiB, nothing next to a message's latency, and small tensors (biases,
#: norm scales) are the most sensitive to error.
MIN_COMPRESSED_ELEMENTS = 1 << 12
#: From this many elements (256 KiB of float32) gradients and deltas are quantized to
#: 8 bits: the threshold hivemind's examples use for the same switch.
MIN_QUANTIZED_ELEMENTS = 1 << 16

_FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_NONE = NoneCodec()
_FLOAT16 = Float16Codec()
_BFLOAT16 = BFloat16Codec()
_BLOCKWISE8 = Blockwise8BitCodec()


def _sixteen_bit(tensor: torch.Tensor) -> Codec:
    if tensor.dtype == torch.bfloat16:
        return _BFLOAT16
    if tensor.dtype == torch.float16:
        return _FLOAT16
    fits = tensor.numel() == 0 or float(tensor.detach().abs().max()) <= _FLOAT16_MAX
    return _FLOAT16 if fits else _BFLOAT16


def choose_codec(tensor: torch.Tensor, role: Role) -> Codec:
    """The codec for ``tensor`` in ``role`` (see the module's table).

    Raises ValueError for an unknown role. The codec may still refuse the tensor
    (:class:`EncodeError`) if it holds NaN or infinity.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    numel = tensor.numel()
    if numel < MIN_COMPRESSED_ELEMENTS or dtype_name(tensor.dtype) not in LOSSY_DTYPES:
        return _NONE
    if role == "optimizer_state":
        return _BFLOAT16
    if role in ("gradient", "delta") and numel >= MIN_QUANTIZED_ELEMENTS:
        return _BLOCKWISE8
    return _sixteen_bit(tensor)


#: A decoder for each codec name. Decoding needs no state, and the default limits apply.
DECODERS: Mapping[str, Codec] = MappingProxyType(
    {
        codec.name: codec
        for codec in (
            _NONE,
            _FLOAT16,
            _BFLOAT16,
            Uniform8BitCodec(),
            _BLOCKWISE8,
            TopKCodec(),
            PowerSGDCodec(),
        )
    }
)


def decode_tensor(encoded: EncodedTensor) -> torch.Tensor:
    """Decode with the codec ``encoded`` names; raises :class:`CompressionError` for an
    unknown codec or a bad payload."""
    codec = DECODERS.get(encoded.codec) if isinstance(encoded, EncodedTensor) else None
    if codec is None:
        name = encoded.codec if isinstance(encoded, EncodedTensor) else type(encoded).__name__
        raise CompressionError(f"unknown codec {name!r}; known: {sorted(DECODERS)}")
    return codec.decode(encoded)
