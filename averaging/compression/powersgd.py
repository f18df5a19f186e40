"""PowerSGD: a rank-r approximation ``P Q^T`` from one power iteration per round.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithm 1: the tensor is viewed as a matrix
M (n x m: the first dimension by the product of the rest, as the paper does for
convolution kernels); ``P = orthonormalize(M Q)``, ``Q = M^T P``; the receiver rebuilds
``P Q^T``. Q is warm-started from the previous round of the same ``key`` (section 4.1:
one power iteration per round is then enough), and the paper's error feedback is
:class:`ErrorFeedback` around this codec.

Here each peer compresses its own tensor (the paper all-reduces P and Q; our butterfly
averages decoded parts), so the decode is stateless. 1-D tensors, small ones, and those
too narrow for the rank to save anything travel uncompressed under the same name.

On the wire M is scaled by a power of two ``scale >= max|M|`` (exact), so ``P`` has
orthonormal columns (entries within 1) and ``|Q| <= sqrt(n)``; the decoder checks both,
so a payload cannot make the product overflow.
"""

from __future__ import annotations

import math
from collections import OrderedDict
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
    rounding_error,
    tensor_bytes,
    to_numpy,
)
from averaging.compression.casts import decode_raw_values

#: Largest rank a payload may carry: the paper uses 1 - 4 (section 5); 256 leaves room
#: for other choices while bounding the decoder's matmul at 256 * n * m.
MAX_RANK = 256
_LOW_RANK_KEYS = frozenset({"p", "q", "scale"})
_RAW_KEYS = frozenset({"values"})


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig:
    """How :class:`PowerSGDCodec` compresses and how much state it keeps."""

    rank: int = 4
    """The paper's ``r``: columns of P and Q. Rank 4 matched full-precision accuracy in
    the paper's experiments (section 5)."""
    min_elements: int = 4096
    """Tensors with fewer elements go uncompressed: the saving is a few KiB."""
    max_state_keys: int = 1024
    """Warm-start Q matrices kept (least recently used dropped first); a model has a few
    hundred matrices, and a dropped one only restarts from a random Q."""
    max_state_bytes: int = 256 * 1024 * 1024
    """Bytes of warm-start Q matrices kept; Q is m x r, small next to the tensor."""
    seed: int = 0
    """Seed of the random first Q, so that encoding is deterministic."""
    max_decoded_elements: int = MAX_DECODED_ELEMENTS
    """Most elements a payload may claim (see ``MAX_DECODED_ELEMENTS``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise ValueError(f"rank must be in [1, {MAX_RANK}]")
        for name in ("min_elements", "max_state_keys", "max_state_bytes", "max_decoded_elements"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


@dataclass(frozen=True, slots=True)
class PowerSGDStatistics:
    """A snapshot of a :class:`PowerSGDCodec`'s warm-start state."""

    num_state_keys: int
    """Warm-start Q matrices held."""
    state_bytes: int
    """Bytes they take."""


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows = shape[0] if shape else 1
    return rows, math.prod(shape[1:])


class PowerSGDCodec(Codec):
    """Rank-r PowerSGD with warm-started Q per ``key``. Not thread-safe.

    Bound: the largest entry of the residual ``M - P Q^T`` of this round (at most the
    residual norm ``||M - P Q^T||_F``, which is what error feedback carries), plus the
    rounding a different BLAS could add. Ratio: ``(n + m) * r * 4 / (n * m * itemsize)``;
    1 when sent uncompressed.
    """

    name = "powersgd"
    round_safe = False  # low rank, warm-started per key: for error feedback across steps

    def __init__(self, config: PowerSGDConfig | None = None) -> None:
        self.config = config or PowerSGDConfig()
        self._warm: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._warm_bytes = 0

    def _rank(self, tensor: torch.Tensor) -> int:
        """The rank used for ``tensor``, or 0 to send it uncompressed (also when float32
        P and Q would take more bytes than the tensor)."""
        shape = tuple(tensor.shape)
        rows, cols = _matrix_shape(shape)
        rank = min(self.config.rank, rows, cols)
        if len(shape) < 2 or rows * cols < self.config.min_elements:
            return 0
        return rank if (rows + cols) * rank * 4 < tensor_bytes(tensor) else 0

    def _first_q(self, cols: int, rank: int, key: str | None) -> torch.Tensor:
        warm = self._warm.get(key) if key is not None else None
        if warm is not None and warm.shape == (cols, rank):
            return warm
        generator = torch.Generator().manual_seed(self.config.seed)
        return torch.randn(cols, rank, generator=generator)

    def _remember(self, key: str, q: torch.Tensor) -> None:
        old = self._warm.pop(key, None)
        self._warm_bytes -= tensor_bytes(old) if old is not None else 0
        if tensor_bytes(q) > self.config.max_state_bytes:
            return
        self._warm[key] = q
        self._warm_bytes += tensor_bytes(q)
        while len(self._warm) > self.config.max_state_keys or (
            self._warm_bytes > self.config.max_state_bytes
        ):
            _, dropped = self._warm.popitem(last=False)
            self._warm_bytes -= tensor_bytes(dropped)

    def statistics(self) -> PowerSGDStatistics:
        return PowerSGDStatistics(num_state_keys=len(self._warm), state_bytes=self._warm_bytes)

    def _compress(
        self, tensor: torch.Tensor, key: str | None
    ) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """``(P, Q, scale)`` for ``tensor``, or None to send it raw."""
        flat = flat_input(self.name, tensor, LOSSY_DTYPES)
        dtype = dtype_name(tensor.dtype)
        low, high = min_max(flat)
        check_range(self.name, low, high, magnitude_limit(dtype))
        rank = self._rank(tensor)
        if rank == 0:
            return None
        rows, cols = _matrix_shape(tuple(tensor.shape))
        magnitude = max(-low, high)
        scale = 2.0 ** math.frexp(magnitude)[1] if magnitude > 0 else 1.0  # >= magnitude
        matrix = (
            flat.to(torch.float32).reshape(rows, cols) / scale
        )  # a power of two: exact unless it underflows
        p = torch.linalg.qr(matrix @ self._first_q(cols, rank, key)).Q
        q = matrix.T @ p
        return p, q, scale

    def encode(self, tensor: torch.Tensor, *, key: str | None = None) -> EncodedTensor:
        compressed = self._compress(tensor, key)
        dtype = dtype_name(tensor.dtype)
        if compressed is None:
            flat = flat_input(self.name, tensor, LOSSY_DTYPES).clone()
            payload: dict[str, np.ndarray | int | float | bytes] = {"values": to_numpy(flat)}
        else:
            p, q, scale = compressed
            if key is not None:
                self._remember(key, q.clone())  # not the payload's memory
            payload = {"p": p.numpy(), "q": q.numpy(), "scale": scale}
        return EncodedTensor(
            codec=self.name, dtype=dtype, shape=list(tensor.shape), payload=payload
        )

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        dtype, shape, numel = check_header(
            encoded, self.name, LOSSY_DTYPES, self.config.max_decoded_elements
        )
        if set(encoded.payload) == _RAW_KEYS:
            return decode_raw_values(encoded, self.name, dtype, numel).reshape(shape)
        check_keys(encoded, self.name, _LOW_RANK_KEYS)
        if len(shape) < 2:
            raise CompressionError(f"{self.name}: a low-rank payload for shape {list(shape)}")
        rows, cols = _matrix_shape(shape)
        p_raw = encoded.payload["p"]
        rank = p_raw.shape[1] if isinstance(p_raw, np.ndarray) and p_raw.ndim == 2 else -1
        if not 1 <= rank <= min(MAX_RANK, rows, cols):
            raise CompressionError(f"{self.name}: payload 'p' is not an n x r matrix, r <= 256")
        p = payload_array(encoded, self.name, "p", ["float32"], (rows, rank))
        q = payload_array(encoded, self.name, "q", ["float32"], (cols, rank))
        limit = magnitude_limit(dtype)
        scale = payload_float(encoded, self.name, "scale", 2.0**-160, 2 * limit)
        # P has orthonormal columns and |Q| <= sqrt(rows) when scale >= max|M|; NaN fails.
        if not (_max_abs(p) <= 1 + DECODE_SLACK and _max_abs(q) <= math.sqrt(rows) + 1):
            raise CompressionError(f"{self.name}: P or Q entries are non-finite or too large")
        product = (torch.from_numpy(p.copy()) @ torch.from_numpy(q.copy()).T).mul_(scale)
        # Rounding can overshoot the original range a little; stay finite in its dtype.
        return finish(product.clamp_(-limit, limit), dtype, shape)

    def error_bound(self, tensor: torch.Tensor, *, key: str | None = None) -> float:
        compressed = self._compress(tensor, key)
        if compressed is None:
            return 0.0
        p, q, scale = compressed
        flat = flat_input(self.name, tensor, LOSSY_DTYPES).to(torch.float32)
        dtype = dtype_name(tensor.dtype)
        limit = magnitude_limit(dtype)
        approximation = (p @ q.T).mul_(scale).clamp_(-limit, limit).reshape(-1)
        residual = float((flat - approximation).abs().max())
        # Another BLAS may sum the r products in another order: at most (r + 2) roundings
        # of sum_k |P_ik| |Q_jk| <= max row norm of P times max row norm of Q.
        rank = p.shape[1]
        magnitude = scale * float(p.norm(dim=1).max()) * float(q.norm(dim=1).max())
        error = residual + (rank + 2) * 2.0**-23 * magnitude + 2.0**-148
        if dtype != "float32":
            error += rounding_error(dtype, float(flat.abs().max()) + error)
        return error

    def compression_ratio(self, tensor: torch.Tensor) -> float:
        rank = self._rank(tensor)
        if rank == 0:
            return 1.0
        rows, cols = _matrix_shape(tuple(tensor.shape))
        return (rows + cols) * rank * 4 / tensor_bytes(tensor)


def _max_abs(array: np.ndarray) -> float:
    return float(np.max(np.abs(array))) if array.size else 0.0
