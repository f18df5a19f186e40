"""What a hosted module takes and returns, and the checks every request passes first.

A module declares one :class:`TensorSpec` per input (shape without the batch dimension,
dtype); its outputs' specs come from one trial forward. A request is checked against
them *before* anything is decoded or computed
(CONTRIBUTING.md, "Bound everything a peer controls"): number of tensors, dtype,
per-sample shape, one batch size shared by all tensors, ``1 <= batch <= max``. The same
checks run on a caller's inputs before sending, and on a server's replies.

Tensors are checked by their header only: a ``torch.Tensor``'s own dtype and shape, or
an :class:`averaging.compression.EncodedTensor`'s declared ones (before its payload is
decoded, so a claimed shape cannot make us allocate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from averaging.compression import EncodedTensor
from swarm.experts.uids import check_uid

#: dtypes a hosted module's inputs and outputs may have. Integer inputs (token ids)
#: are fine; gradients flow only to floating ones.
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}
FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64"})
#: Most inputs or outputs one module may have; bounds every tensor list on the wire.
MAX_TENSORS = 16
#: Most dimensions of one sample (numpy allows 64; modules use a handful).
MAX_SAMPLE_DIMS = 8
#: Most elements of one sample of one tensor (64 Mi: a 8192-token sequence of width
#: 8192). Bounds what ``max_batch_size`` samples can make a peer allocate.
MAX_SAMPLE_ELEMENTS = 1 << 26
#: Largest ``max_batch_size`` a module may declare.
MAX_BATCH_SIZE = 1 << 16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output of a hosted module (a ``peers.wire`` message)."""

    shape: list[int]
    """Shape of one sample, without the leading batch dimension."""
    dtype: str
    """dtype name, one of :data:`DTYPES`."""
    high: int | None = None
    """Integer inputs: every value must be in ``[0, high)`` (token ids and a vocabulary:
    an embedding indexed out of range would fail inside the module); ``None``: any."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.high is not None and (
            self.dtype in FLOAT_DTYPES
            or not isinstance(self.high, int)
            or not 1 <= self.high <= 2**62
        ):
            raise ValueError(f"high={self.high!r}: only integer specs, in [1, 2**62]")
        if len(self.shape) > MAX_SAMPLE_DIMS or not all(
            isinstance(d, int) and 1 <= d <= MAX_SAMPLE_ELEMENTS for d in self.shape
        ):
            raise ValueError(f"sample shape {self.shape} is invalid")
        if self.numel > MAX_SAMPLE_ELEMENTS:
            raise ValueError(f"a sample of shape {self.shape} exceeds {MAX_SAMPLE_ELEMENTS}")

    @classmethod
    def of_sample(cls, batch: torch.Tensor) -> TensorSpec:
        """The spec of one sample of a batch-first tensor."""
        return cls(shape=list(batch.shape[1:]), dtype=dtype_name(batch.dtype))

    @property
    def numel(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count

    @property
    def sample_bytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    def zeros(self, *batch_dims: int) -> torch.Tensor:
        return torch.zeros(*batch_dims, *self.shape, dtype=DTYPES[self.dtype])


@dataclass(frozen=True, slots=True)
class ExpertInfo:
    """What a server says about one hosted module (a ``peers.wire`` message)."""

    uid: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int

    def __post_init__(self) -> None:
        check_uid(self.uid)
        if not 1 <= len(self.inputs) <= MAX_TENSORS or not 1 <= len(self.outputs) <= MAX_TENSORS:
            raise ValueError(f"a module has 1 to {MAX_TENSORS} inputs and outputs")
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be in [1, {MAX_BATCH_SIZE}]")

    @property
    def max_request_bytes(self) -> int:
        """Bytes of the largest valid request or reply, uncompressed (a backward carries
        inputs and output gradients)."""
        per_sample = sum(s.sample_bytes for s in (*self.inputs, *self.outputs))
        return self.max_batch_size * per_sample


def check_values(what: str, tensors: Sequence[torch.Tensor], specs: Sequence[TensorSpec]) -> None:
    """ValueError naming ``what`` if an integer tensor holds a value outside its spec's
    ``[0, high)`` (decoded tensors, after :func:`check_batch`)."""
    for i, (tensor, spec) in enumerate(zip(tensors, specs, strict=True)):
        if spec.high is not None and tensor.numel():
            low, high = int(tensor.min()), int(tensor.max())
            if low < 0 or high >= spec.high:
                raise ValueError(
                    f"{what}[{i}]: values must be in [0, {spec.high}), got {low} to {high}"
                )


def header(item: torch.Tensor | EncodedTensor) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a tensor or of an encoded tensor as it claims."""
    if isinstance(item, torch.Tensor):
        return dtype_name(item.dtype), tuple(item.shape)
    return item.dtype, tuple(item.shape)


def check_batch(
    what: str,
    items: Sequence[torch.Tensor | EncodedTensor],
    specs: Sequence[TensorSpec],
    max_batch_size: int,
    batch_size: int | None = None,
) -> int:
    """The batch size shared by ``items``; ValueError naming ``what`` and the first
    mismatch (count, dtype, per-sample shape, batch size, ``batch_size`` if given)."""
    if len(items) != len(specs):
        raise ValueError(f"{what}: expected {len(specs)} tensors, got {len(items)}")
    for i, (item, spec) in enumerate(zip(items, specs, strict=True)):
        dtype, shape = header(item)
        if dtype != spec.dtype:
            raise ValueError(f"{what}[{i}]: expected dtype {spec.dtype}, got {dtype}")
        if len(shape) != len(spec.shape) + 1 or list(shape[1:]) != spec.shape:
            expected = ["batch", *spec.shape]
            raise ValueError(f"{what}[{i}]: expected shape {expected}, got {list(shape)}")
        if batch_size is None:
            batch_size = shape[0]
        elif shape[0] != batch_size:
            raise ValueError(f"{what}[{i}]: batch size {shape[0]} differs from {batch_size}")
    assert batch_size is not None
    if batch_size < 1:
        raise ValueError(f"{what}: empty batch")
    if batch_size > max_batch_size:
        raise ValueError(
            f"{what}: batch of {batch_size} samples exceeds this expert's "
            f"max_batch_size {max_batch_size}"
        )
    return batch_size
