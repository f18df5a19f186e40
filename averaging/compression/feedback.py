"""Error feedback: what a lossy codec dropped this round is added to the next round.

Seide et al., "1-Bit Stochastic Gradient Descent" (Interspeech 2014) and Karimireddy et
al., "Error Feedback Fixes SignSGD" (ICML 2019), Algorithm 2: send ``C(t + e)`` and keep
``e <- (t + e) - D(C(t + e))``. After T rounds the sum of what was sent is
``sum(t) - e``, so nothing is lost, only delayed; for a contracting codec (top-k,
PowerSGD, any quantizer) the residual ``e`` stays bounded.

State is per ``key`` (one residual per tensor), bounded in keys and bytes; the least
recently used residual is dropped first, which costs that tensor only what its residual
held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from averaging.compression.base import (
    Codec,
    EncodedTensor,
    EncodeError,
    dtype_name,
    tensor_bytes,
)


@dataclass(frozen=True, kw_only=True)
class ErrorFeedbackConfig:
    """How much residual state :class:`ErrorFeedback` keeps."""

    max_keys: int = 4096
    """Residuals kept (one per tensor key). A model has at most a few thousand tensors;
    more keys than that means keys are being made up per round, and old ones go."""
    max_residual_bytes: int = 1 << 32
    """Bytes of residuals kept (float32, so 1 GiB of elements): one copy of the largest
    models we average. A tensor whose residual alone is larger gets no feedback."""

    def __post_init__(self) -> None:
        if self.max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        if self.max_residual_bytes < 0:
            raise ValueError("max_residual_bytes must not be negative")


@dataclass(frozen=True, slots=True)
class ErrorFeedbackStatistics:
    """A snapshot of an :class:`ErrorFeedback`'s state."""

    num_keys: int
    """Residuals held."""
    residual_bytes: int
    """Bytes they take."""
    num_evictions: int
    """Residuals dropped to stay within the bounds, since creation."""
    num_resets: int
    """Residuals dropped because their key's shape or dtype changed, since creation."""


class ErrorFeedback:
    """Wraps a codec with per-key error feedback. Not thread-safe.

    ``encode(t, key=k)`` sends ``codec.encode(t + residual[k])`` and keeps what that
    encoding lost as the new residual; ``decode`` is the codec's (the receiver needs no
    state). The residual is float32 whatever the tensor's dtype.
    """

    def __init__(self, codec: Codec, config: ErrorFeedbackConfig | None = None) -> None:
        self.codec = codec
        self.config = config or ErrorFeedbackConfig()
        self._residuals: OrderedDict[str, tuple[tuple[int, ...], str, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._evictions = 0
        self._resets = 0

    @property
    def name(self) -> str:
        return self.codec.name

    def encode(self, tensor: torch.Tensor, *, key: str) -> EncodedTensor:
        """Encode ``tensor`` plus the residual kept under ``key``; update the residual.

        A residual kept for another shape or dtype is dropped. Raises
        :class:`EncodeError` as the codec does; the residual is then unchanged.
        """
        if not isinstance(tensor, torch.Tensor):
            raise EncodeError(f"error feedback encodes torch tensors, not {type(tensor).__name__}")
        shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
        corrected = tensor.detach().to("cpu", torch.float32)
        kept = self._residuals.get(key)
        matches = kept is not None and kept[:2] == (shape, dtype)
        if kept is not None and matches:
            corrected = corrected + kept[2]
        encoded = self.codec.encode(corrected.to(tensor.dtype), key=key)
        residual = corrected.reshape(-1) - self.codec.decode(encoded).to(torch.float32).reshape(-1)
        if kept is not None and not matches:  # a new shape or dtype: the old residual is moot
            self._resets += 1
        self._store(key, shape, dtype, residual.reshape(shape))
        return encoded

    def decode(self, encoded: EncodedTensor) -> torch.Tensor:
        """The codec's decode (raises ``CompressionError`` for a bad payload)."""
        return self.codec.decode(encoded)

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual kept for ``key`` (do not modify it), or None."""
        kept = self._residuals.get(key)
        return None if kept is None else kept[2]

    def reset(self, key: str | None = None) -> None:
        """Forget the residual of ``key``, or all of them."""
        if key is None:
            self._residuals.clear()
            self._bytes = 0
        else:
            self._drop(key)

    def statistics(self) -> ErrorFeedbackStatistics:
        return ErrorFeedbackStatistics(
            num_keys=len(self._residuals),
            residual_bytes=self._bytes,
            num_evictions=self._evictions,
            num_resets=self._resets,
        )

    def _drop(self, key: str) -> None:
        kept = self._residuals.pop(key, None)
        if kept is not None:
            self._bytes -= tensor_bytes(kept[2])

    def _store(self, key: str, shape: tuple[int, ...], dtype: str, residual: torch.Tensor) -> None:
        self._drop(key)
        if tensor_bytes(residual) > self.config.max_residual_bytes:
            self._evictions += 1
            return
        self._residuals[key] = (shape, dtype, residual)
        self._bytes += tensor_bytes(residual)
        while len(self._residuals) > self.config.max_keys or (
            self._bytes > self.config.max_residual_bytes
        ):
            _, (_, _, dropped) = self._residuals.popitem(last=False)
            self._bytes -= tensor_bytes(dropped)
            self._evictions += 1
