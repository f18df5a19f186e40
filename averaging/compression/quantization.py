"""8-bit quantization: "uint8" (one affine min/max grid per tensor) and "blockwise8".

"blockwise8" scales each block of ``block_size`` values by its largest magnitude and
rounds the result to the nearest entry of a fixed 256-entry *dynamic* codebook: the
dynamic tree data type of Dettmers, "8-bit Approximations for Parallelism in Deep
Learning" (ICLR 2016), section 3 -- a sign, then one decade per leading zero bit
(1 .. 1e-6), then a linear fraction in [0.1, 1] with the bits left. It keeps small
values of a block to a few percent relative error where a linear grid would flush them
to zero; bitsandbytes' dynamic map and hivemind's blockwise codec use the same idea.
Here it is plain numpy and torch (no bitsandbytes), so it works on numpy 2.

Encoding finds the nearest codebook entry without a binary search: a float32's top 16
bits (sign, exponent, 7 mantissa bits) name an interval of relative width 2**-7, and
the codebook's entries are at least 1.4% apart, so at most one rounding boundary lies
in each interval. Two 65536-entry tables indexed by those bits give the lower code and
that boundary; one comparison finishes the job (see ``test_blockwise_picks_nearest``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from averaging.compression.base import (
    DECODE_SLACK,
    LOSSY_DTYPES,
    MAX_DECODED_ELEMENTS,
    Codec,
    CompressionError,
    EncodedTensor,
    check_header,
    check_keys,
    check_range,
    dtype_name,
    finish,
    flat_input,
    magnitude_limit,
    min_max,
    payload_array,
    payload_float,
    payload_int,
    rounding_error,
    tensor_bytes,
)

#: An absolute floor on every quantizer bound: four times float32's rounding error near
#: zero (half its smallest subnormal), for products and sums that underflow.
_TINY = 2.0**-148


def dynamic_codebook() -> np.ndarray:
    """The 256-entry codebook: 255 ascending values in [-1, 1], then an unused 0.

    Magnitudes are 0, then for each decade 10**-e (e = 6 .. 0) the values
    ``10**-e * (0.1 + 0.9 * k / 2**(6 - e))`` for k = 1 .. 2**(6 - e): 127 of them,
    from 1e-6 up to exactly 1. Code 127 is zero; code 255 is never produced and decodes
    to zero.
    """
    magnitudes = [0.0]
    for exponent in range(6, -1, -1):
        count = 2 ** (6 - exponent)
        magnitudes += [10.0**-exponent * (0.1 + 0.9 * k / count) for k in range(1, count + 1)]
    positive = np.array(magnitudes)
    return np.concatenate([-positive[:0:-1], positive, [0.0]]).astype(np.float32)


CODEBOOK = dynamic_codebook()
#: Half the widest gap between neighbouring codebook entries (0.9 / 64 / 2, in the top
#: decade): a value normalized into [-1, 1] lands at most this far from its code.
CODEBOOK_HALF_GAP = float(np.max(np.diff(CODEBOOK[:255].astype(np.float64)))) / 2


def _encoder_tables() -> tuple[np.ndarray, np.ndarray]:
    """For each top-16-bit prefix of a float32: its nearest code and the boundary above.

    ``code(x) = LOW[p] + (x > BOUNDARY[p])`` for ``p`` the top 16 bits of ``x``.
    """
    values = CODEBOOK[:255].astype(np.float64)
    mids = (values[:-1] + values[1:]) / 2
    prefixes = np.arange(1 << 16, dtype=np.uint32) << 16
    with np.errstate(invalid="ignore"):
        first = prefixes.view(np.float32).astype(np.float64)
        last = (prefixes | 0xFFFF).view(np.float32).astype(np.float64)
    finite = np.isfinite(first) & np.isfinite(last)
    low = np.where(finite, np.minimum(first, last), 0.0)
    high = np.where(finite, np.maximum(first, last), 0.0)
    # Codes are ordered like values, so the nearest code to ``low`` is the number of
    # midpoints below it (a value exactly on a midpoint takes the lower code).
    code = np.searchsorted(mids, low, side="left")
    boundary = mids[np.minimum(code, len(mids) - 1)]
    has_boundary = (code < len(mids)) & (boundary < high)
    beyond = mids[np.minimum(code + 1, len(mids) - 1)]
    assert not np.any(has_boundary & (code + 1 < len(mids)) & (beyond < high)), "codebook too fine"
    # Round each boundary down to float32, so ``x > boundary32`` iff ``x > boundary``.
    boundary32 = boundary.astype(np.float32)
    above = boundary32.astype(np.float64) > boundary
    boundary32[above] = np.nextafter(boundary32[above], np.float32(-np.inf))
    boundary32[~has_boundary] = np.inf
    return code.astype(np.uint8), boundary32


_LOW_CODE, _BOUNDARY = _encoder_tables()
#: Which uint16 of a float32 holds its top 16 bits.
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


def nearest_codes(normalized: np.ndarray) -> np.ndarray:
    """The nearest codebook code of each float32 value in [-1, 1] (a 1-D array)."""
    prefixes = np.ascontiguousarray(normalized.view(np.uint16)[_HIGH_HALF::2])
    codes = np.take(_LOW_CODE, prefixes)
    codes += normalized > np.take(_BOUNDARY, prefixes)
    return codes


#: Blocks normalized and coded at a time: 64 blocks of 4096 floats is 1 MiB, so the
#: temporaries of one step stay in cache.
_CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True, kw_only=True)
class Blockwise8BitCodec(Codec):
    """Per-block absmax scaling to the dynamic 8-bit codebook.

    Bound: ``max|t| * (CODEBOOK_HALF_GAP + 2**-22)`` (CODEBOOK_HALF_GAP = 0.00703) plus
    float rounding; every block's error is its own absmax times that, so one outlier
    coarsens only its block. Ratio: ``(n + 4 * ceil(n / block_size)) / (4 n)`` for
    float32, about 0.251.
    """

    name = "blockwise8"
    block_size: int = 4096
    """Values per scale. 4096 (bitsandbytes' and hivemind's choice) makes the float32
    scales 0.1% of the payload while an outlier coarsens only 4096 values."""
    max_decoded_elements: int = MAX_DECODED_ELEMENTS
    """Most elements a payload may claim (see ``MAX_DECODED_ELEMENTS``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_DECODED_ELEMENTS:
            raise ValueError(f"block_size must be in [1, {MAX_DECODED_ELEMENTS}]")

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        check_range(self.name, *min_max(flat), magnitude_limit(dtype))
        values = flat.to(torch.float32).numpy()
        numel, size = values.size, self.block_size
        num_blocks = -(-numel // size)
        absmax = np.empty(num_blocks, dtype=np.float32)
        codes = np.empty(numel, dtype=np.uint8)
        step = max(1, _CHUNK_ELEMENTS // size) * size
        for start in range(0, numel, step):
            chunk = values[start : start + step]
            first = start // size
            count = -(-chunk.size // size)
            if chunk.size != count * size:  # a last, partial block: pad it with zeros
                chunk = np.concatenate([chunk, np.zeros(count * size - chunk.size, np.float32)])
            blocks = chunk.reshape(count, size)
            scale = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))
            absmax[first : first + count] = scale
            normalized = blocks / np.where(scale > 0, scale, np.float32(1))[:, None]
            end = min(start + step, numel)
            codes[start:end] = nearest_codes(normalized.reshape(-1))[: end - start]
        return EncodedTensor(
            codec=self.name,
            dtype=dtype,
            shape=list(tensor.shape),
            payload={"codes": codes, "absmax": absmax, "block_size": size},
        )

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        dtype, shape, numel = check_header(
            encoded, self.name, LOSSY_DTYPES, self.max_decoded_elements
        )
        check_keys(encoded, self.name, frozenset({"codes", "absmax", "block_size"}))
        size = payload_int(encoded, self.name, "block_size", 1, MAX_DECODED_ELEMENTS)
        num_blocks = -(-numel // size)
        codes = payload_array(encoded, self.name, "codes", ["uint8"], (numel,))
        absmax = payload_array(encoded, self.name, "absmax", ["float32"], (num_blocks,))
        limit = magnitude_limit(dtype) * (1 + DECODE_SLACK)
        if num_blocks and not (0 <= float(absmax.min()) and float(absmax.max()) <= limit):
            # NaN fails both comparisons, so it lands here too.
            raise CompressionError(
                f"{self.name}: block scales must be finite and in [0, {limit:.3g}]"
            )
        out = np.take(CODEBOOK, codes)
        full = numel // size
        head = out[: full * size].reshape(full, size)  # a view: scaled in place
        head *= absmax[:full, None]
        if full < num_blocks:
            out[full * size :] *= absmax[full]
        return finish(torch.from_numpy(out), dtype, shape)

    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        low, high = min_max(flat)
        magnitude = max(-low, high)
        error = magnitude * (CODEBOOK_HALF_GAP + 2.0**-22) + _TINY
        if dtype != "float32":
            error += rounding_error(dtype, magnitude + error)
        return error

    def compression_ratio(self, tensor: torch.Tensor) -> float:
        numel = tensor.numel()
        if numel == 0:
            return 1.0
        return (numel + 4 * -(-numel // self.block_size)) / tensor_bytes(tensor)


@dataclass(frozen=True, kw_only=True)
class Uniform8BitCodec(Codec):
    """Affine 8-bit quantization on one grid from the tensor's min to its max.

    Bound: ``scale / 2`` with ``scale = (max - min) / 255``, plus float32 rounding
    (``scale * 2**-12 + 2**-21 * max|t|``). Ratio: ``n / (4 n)`` = 1/4 for float32.
    One outlier stretches the grid for the whole tensor; ``blockwise8`` avoids that.
    """

    name = "uint8"
    max_decoded_elements: int = MAX_DECODED_ELEMENTS
    """Most elements a payload may claim (see ``MAX_DECODED_ELEMENTS``)."""

    @staticmethod
    def _grid(low: float, high: float) -> tuple[float, float]:
        """The minimum and scale as sent: both exact float32 values."""
        return float(np.float32(low)), float(np.float32((high - low) / 255))

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        low, high = min_max(flat)
        check_range(self.name, low, high, magnitude_limit(dtype))
        minimum, scale = self._grid(low, high)
        values = flat.to(torch.float32)
        if scale > 0:
            quantized = (values - minimum).div_(scale).round_().clamp_(0, 255).to(torch.uint8)
        else:
            quantized = torch.zeros(values.shape, dtype=torch.uint8)
        return EncodedTensor(
            codec=self.name,
            dtype=dtype,
            shape=list(tensor.shape),
            payload={"codes": quantized.numpy(), "minimum": minimum, "scale": scale},
        )

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        dtype, shape, numel = check_header(
            encoded, self.name, LOSSY_DTYPES, self.max_decoded_elements
        )
        check_keys(encoded, self.name, frozenset({"codes", "minimum", "scale"}))
        limit = magnitude_limit(dtype) * (1 + DECODE_SLACK)
        minimum = payload_float(encoded, self.name, "minimum", -limit, limit)
        scale = payload_float(encoded, self.name, "scale", 0.0, 2 * limit / 255)
        if abs(minimum + 255 * scale) > limit:
            raise CompressionError(
                f"{self.name}: grid top {minimum + 255 * scale:.3g} is past the limit {limit:.3g}"
            )
        codes = payload_array(encoded, self.name, "codes", ["uint8"], (numel,))
        # minimum + code * scale in float32, rounded after the product and after the sum
        # (no fused multiply-add): bit for bit the grid lookup it replaces, and faster
        # (docs/benchmarks.md, "Figures behind constants").
        values = torch.from_numpy(codes.astype(np.float32)).mul_(scale).add_(minimum)
        return finish(values, dtype, shape)

    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        low, high = min_max(flat)
        magnitude = max(-low, high)
        _, scale = self._grid(low, high)
        error = scale * (0.5 + 2.0**-12) + 2.0**-21 * magnitude + _TINY
        if dtype != "float32":
            error += rounding_error(dtype, magnitude + error)
        return error

    def compression_ratio(self, tensor: torch.Tensor) -> float:
        return 1 / tensor.element_size() if tensor.numel() else 1.0


__all__ = ["CODEBOOK", "CODEBOOK_HALF_GAP", "Blockwise8BitCodec", "Uniform8BitCodec"]
