"""Top-k sparsification: send the k largest-magnitude values and their indices.

Alone it simply drops the rest; wrapped in :class:`ErrorFeedback` the dropped part is
carried into the next round, which is how top-k is meant to be used (Stich, Cordonnier
and Jaggi, "Sparsified SGD with Memory", NeurIPS 2018).
"""

from __future__ import annotations

import math
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
    tensor_bytes,
)

#: Up to this many elements we select on the whole tensor; past it, on candidates.
_DIRECT_SELECT_ELEMENTS = 1 << 16
#: Elements sampled to estimate the selection threshold on large tensors.
_SAMPLE_ELEMENTS = 1 << 16
#: How many more candidates than k the sampled threshold aims for, so that a sample
#: that happens to overestimate the threshold rarely leaves us short (then we select on
#: the whole tensor, slower but still exact).
_OVERSAMPLE = 1.25


def largest(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending, int64) of ``k`` largest entries of a 1-D float32 array.

    Selecting k of many values with a full partition or ``torch.topk`` is slow, so on big
    arrays a strided sample estimates a threshold and the k-th largest value is found
    among the few candidates above it; a mask then keeps the values above it and the
    first of those equal to it, in index order (no sort).
    """
    numel = magnitudes.size
    if k >= numel:
        return np.arange(numel)
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    candidates: np.ndarray | None = None
    if numel > _DIRECT_SELECT_ELEMENTS:
        stride = numel // _SAMPLE_ELEMENTS
        sample = magnitudes[::stride]
        wanted = min(sample.size, math.ceil(k / stride * _OVERSAMPLE) + 8)
        threshold = np.partition(sample, sample.size - wanted)[sample.size - wanted]
        candidates = np.flatnonzero(magnitudes >= threshold)
        if candidates.size < k:  # the sample overestimated the threshold
            candidates = None
    values = magnitudes if candidates is None else magnitudes[candidates]
    kth = np.partition(values, values.size - k)[values.size - k]  # the k-th largest
    mask = values > kth
    mask[np.flatnonzero(values == kth)[: k - int(np.count_nonzero(mask))]] = True
    chosen = np.flatnonzero(mask)
    return chosen if candidates is None else candidates[chosen]


@dataclass(frozen=True, kw_only=True)
class TopKCodec(Codec):
    """Keeps the ``ceil(fraction * n)`` largest-magnitude values (at least one).

    Bound: the largest magnitude among the dropped values (the sent ones are exact).
    Ratio: ``k * (index_bytes + 4) / (n * itemsize)``, with 4-byte indices below 2**31
    elements: ``2 k / n`` for float32.
    """

    name = "topk"
    round_safe = False  # drops 99% of coordinates: for error feedback across steps
    fraction: float = 0.01
    """Share of the values sent. 1% is the usual choice with error feedback (Stich et
    al. 2018 and Lin et al., Deep Gradient Compression, use 0.1% - 1%)."""
    max_decoded_elements: int = MAX_DECODED_ELEMENTS
    """Most elements a payload may claim (see ``MAX_DECODED_ELEMENTS``)."""

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError("fraction must be in (0, 1]")

    def num_kept(self, numel: int) -> int:
        """How many values of an ``numel``-element tensor are sent."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        check_range(self.name, *min_max(flat), magnitude_limit(dtype))
        values = flat.to(torch.float32).numpy()
        indices = largest(np.abs(values), self.num_kept(values.size))
        index_dtype = np.int32 if values.size < 2**31 else np.int64
        return EncodedTensor(
            codec=self.name,
            dtype=dtype,
            shape=list(tensor.shape),
            payload={"indices": indices.astype(index_dtype), "values": values[indices]},
        )

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        dtype, shape, numel = check_header(
            encoded, self.name, LOSSY_DTYPES, self.max_decoded_elements
        )
        check_keys(encoded, self.name, frozenset({"indices", "values"}))
        raw_indices = encoded.payload["indices"]
        if not isinstance(raw_indices, np.ndarray) or raw_indices.ndim != 1:
            raise CompressionError(f"{self.name}: payload 'indices' is not a 1-D array")
        num_kept = raw_indices.size
        if num_kept > numel:
            raise CompressionError(f"{self.name}: {num_kept} indices for {numel} elements")
        indices = payload_array(encoded, self.name, "indices", ["int32", "int64"], (num_kept,))
        values = payload_array(encoded, self.name, "values", ["float32"], (num_kept,))
        if num_kept:
            if not (0 <= int(indices[0]) and int(indices[-1]) < numel):
                raise CompressionError(f"{self.name}: an index is outside [0, {numel})")
            if num_kept > 1 and not bool(np.all(indices[1:] > indices[:-1])):
                raise CompressionError(f"{self.name}: indices are not strictly increasing")
            limit = magnitude_limit(dtype) * (1 + DECODE_SLACK)
            if not float(np.max(np.abs(values))) <= limit:  # NaN fails too
                raise CompressionError(f"{self.name}: values must be finite and within {limit:.3g}")
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(indices.astype(np.int64))] = torch.from_numpy(values.copy())
        return finish(out, dtype, shape)

    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        magnitudes = np.abs(flat.to(torch.float32).numpy())
        kept = self.num_kept(magnitudes.size)
        if kept >= magnitudes.size:
            return 0.0
        # The largest dropped magnitude is the smallest of the k + 1 largest.
        return float(magnitudes[largest(magnitudes, kept + 1)].min())

    def compression_ratio(self, tensor: torch.Tensor) -> float:
        numel = tensor.numel()
        if numel == 0:
            return 1.0
        index_bytes = 4 if numel < 2**31 else 8
        return self.num_kept(numel) * (index_bytes + 4) / tensor_bytes(tensor)
