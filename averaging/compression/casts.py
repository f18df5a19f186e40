"""Codecs that send every value: "none" (exact), "float16" and "bfloat16" (a cast).

Overflow is refused, not clamped: float16 cannot hold magnitudes past 65504, so
:class:`Float16Codec` raises :class:`EncodeError` for such a tensor instead of silently
sending infinities or clipped values; :func:`choose_codec` picks bfloat16 for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from averaging.compression.base import (
    FLOAT_DTYPES,
    LOSSY_DTYPES,
    MAX_DECODED_ELEMENTS,
    Codec,
    EncodedTensor,
    check_finite_output,
    check_header,
    check_keys,
    check_range,
    dtype_name,
    finish,
    flat_input,
    min_max,
    payload_array,
    rounding_error,
    to_numpy,
)

_FLOAT16_MAX = float(torch.finfo(torch.float16).max)
_BFLOAT16_MAX = float(torch.finfo(torch.bfloat16).max)
_VALUES = frozenset({"values"})
#: The numpy dtype each tensor dtype travels as (numpy has no bfloat16: its bits).
_WIRE_DTYPE = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "uint16",
    "float64": "float64",
}


def _max_abs(flat: torch.Tensor) -> float:
    low, high = min_max(flat)
    return max(-low, high)


def _from_wire_array(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A writable tensor of a received array of wire dtype ``dtype``: the array itself if
    it is writable (a view of a frame the receiver owns, see
    :func:`peers.serialization.unpack`), else a copy."""
    if not array.flags.writeable:
        array = array.copy()
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def decode_raw_values(
    encoded: EncodedTensor, codec: str, dtype: str, numel: int, *, check_finite: bool = True
) -> torch.Tensor:
    """The flat tensor under payload ``"values"`` sent as is (checked: size, dtype, and
    finite unless the caller checks that itself)."""
    array = payload_array(encoded, codec, "values", [_WIRE_DTYPE[dtype]], (numel,))
    values = _from_wire_array(array, dtype)
    if check_finite:
        check_finite_output(codec, values)
    return values


@dataclass(frozen=True, kw_only=True)
class NoneCodec(Codec):
    """Sends the tensor as it is: exact, ratio 1. Takes float64 too."""

    name = "none"
    max_decoded_elements: int = MAX_DECODED_ELEMENTS
    """Most elements a payload may claim (see ``MAX_DECODED_ELEMENTS``)."""

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        flat = flat_input(self.name, tensor, frozenset(FLOAT_DTYPES))
        check_range(self.name, *min_max(flat), float("inf"))
        return EncodedTensor(
            codec=self.name,
            dtype=dtype_name(tensor.dtype),
            shape=list(tensor.shape),
            payload={"values": to_numpy(flat.clone())},  # a snapshot, not a view of the input
        )

    def decode(self, encoded: EncodedTensor, *, check_finite: bool = True) -> torch.Tensor:
        """The values; ``check_finite=False`` skips the NaN/infinity check, for a caller
        that checks every value itself (the all-reduce round does), saving a pass."""
        dtype, shape, numel = check_header(
            encoded, self.name, frozenset(FLOAT_DTYPES), self.max_decoded_elements
        )
        check_keys(encoded, self.name, _VALUES)
        values = decode_raw_values(encoded, self.name, dtype, numel, check_finite=check_finite)
        return values.reshape(shape)

    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        return 0.0

    def compression_ratio(self, tensor: torch.Tensor) -> float:
        return 1.0


@dataclass(frozen=True, kw_only=True)
class _CastCodec(Codec):
    """Rounds every value to a 16-bit float type and back."""

    max_decoded_elements: int = MAX_DECODED_ELEMENTS
    """Most elements a payload may claim (see ``MAX_DECODED_ELEMENTS``)."""

    target: ClassVar[torch.dtype]
    """The 16-bit dtype values travel as."""
    max_value: ClassVar[float]
    """Largest magnitude it can carry."""

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        check_range(self.name, *min_max(flat), self.max_value)
        cast = flat.to(self.target, copy=True)
        return EncodedTensor(
            codec=self.name,
            dtype=dtype_name(tensor.dtype),
            shape=list(tensor.shape),
            payload={"values": to_numpy(cast)},
        )

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        dtype, shape, numel = check_header(
            encoded, self.name, LOSSY_DTYPES, self.max_decoded_elements
        )
        check_keys(encoded, self.name, _VALUES)
        wire = dtype_name(self.target)
        array = payload_array(encoded, self.name, "values", [_WIRE_DTYPE[wire]], (numel,))
        values = _from_wire_array(array, wire)
        if self.target == torch.float16 and dtype == "float32":
            # torch's cast, not numpy's: numpy 2.4 converts float16 one value at a time
            # (docs/benchmarks.md, "Figures behind constants").
            values = values.to(torch.float32)
        check_finite_output(self.name, values)
        if dtype == "float16" and self.target == torch.bfloat16:
            # bfloat16 rounds 65504 up to 65536, which float16 cannot hold; clamping only
            # moves values toward the original range, so the error never grows.
            values = values.float().clamp_(-_FLOAT16_MAX, _FLOAT16_MAX)
        return finish(values, dtype, shape)

    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        if flat.dtype == self.target:
            return 0.0
        magnitude = _max_abs(flat)
        error = rounding_error(dtype_name(self.target), magnitude)
        if dtype != "float32":  # rounded a second time, back to the original dtype
            error += rounding_error(dtype, magnitude + error)
        return error

    def compression_ratio(self, tensor: torch.Tensor) -> float:
        return 2 / tensor.element_size()


@dataclass(frozen=True, kw_only=True)
class Float16Codec(_CastCodec):
    """Rounds to float16: relative error 2**-11 and 2**-25 near zero; ratio 1/2.

    Raises :class:`EncodeError` for magnitudes past 65504 (float16's largest).
    """

    name = "float16"
    target = torch.float16
    max_value = _FLOAT16_MAX


@dataclass(frozen=True, kw_only=True)
class BFloat16Codec(_CastCodec):
    """Rounds to bfloat16: float32's range, relative error 2**-8; ratio 1/2."""

    name = "bfloat16"
    target = torch.bfloat16
    max_value = _BFLOAT16_MAX
