"""Which coordinates of a flat vector each peer reduces, and how they travel: one
contiguous part per peer, sized by the bandwidth it measured; client-mode peers reduce
nothing (docs/design/averaging.md, "Parts sized by bandwidth").

Everything here is pure and deterministic: every member of a round computes the same
split from the same inputs, on any platform, because :func:`split_parts` works in exact
rational arithmetic (the float weights are converted to fractions exactly, so no
rounding can make two peers disagree on a boundary).

- :func:`split_parts`: contiguous ``[start, end)`` parts, sizes proportional to weights.
- :func:`chunk_ranges`: a part cut into chunks for streaming (reduction overlaps transfer).
- :func:`flatten` / :func:`unflatten`: many tensors to one float32 vector and back.

Errors: :class:`PartitionError` (our caller's fault: bad weights, sizes or tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction

import torch

from averaging.allreduce.buffers import empty_float32
from peers.errors import LocalProtocolError


class PartitionError(LocalProtocolError, ValueError):
    """Inputs to a split or a flatten are invalid (our caller's fault).

    Raised for a negative, NaN or infinite weight, weights that are all zero, a negative
    size, a non-positive chunk size, non-floating tensors, or a flat vector whose length
    does not match the tensors it should fill.
    """


def split_parts(
    total_elements: int, weights: Sequence[float], *, max_share: Fraction | None = None
) -> list[tuple[int, int]]:
    """Split ``range(total_elements)`` into one contiguous ``(start, end)`` part per weight.

    Part ``i`` has ``floor(total * w_i / sum(w))`` elements, plus one for the
    ``total - sum(floors)`` parts with the largest fractional remainders (ties go to the
    lower index): Hamilton's largest-remainder method, computed exactly, so sizes sum to
    ``total_elements`` and every size is within one element of its exact share. A weight
    of 0 (a client-mode peer, which cannot accept connections) always gets an empty part.

    ``max_share``: no part gets more than this fraction of the total; the weights above
    it are lowered to it (water-filling, exact) and the others keep their proportions.
    When ``total * max_share`` is a whole number, no part exceeds it by even one element.

    Raises :class:`PartitionError` for a negative ``total_elements``, no weights, a
    negative, NaN or infinite weight, weights that are all zero, or fewer positive
    weights than ``1 / max_share`` (the shares could not add up).
    """
    if isinstance(total_elements, bool) or not isinstance(total_elements, int):
        raise PartitionError(f"total_elements must be an int, not {type(total_elements).__name__}")
    if total_elements < 0:
        raise PartitionError(f"total_elements must be >= 0, got {total_elements}")
    if len(weights) == 0:
        raise PartitionError("a split needs at least one weight")
    exact: list[Fraction] = []
    for i, weight in enumerate(weights):
        value = float(weight)
        if not math.isfinite(value) or value < 0:
            raise PartitionError(f"weight {i} must be finite and >= 0, got {weight!r}")
        exact.append(Fraction(value))  # exact: every float is a dyadic rational
    total_weight = sum(exact, Fraction(0))
    if total_weight == 0:
        raise PartitionError("at least one weight must be positive (someone has to reduce)")
    if max_share is not None:
        exact = _cap_shares(exact, max_share)
        total_weight = sum(exact, Fraction(0))
    quotas = [total_elements * w / total_weight for w in exact]
    sizes = [math.floor(q) for q in quotas]
    remainder = total_elements - sum(sizes)
    # Only a positive weight can have a positive fractional part, and there are more
    # positive fractional parts than ``remainder`` (they sum to it, each below 1), so a
    # zero weight never gets an extra element.
    order = sorted(range(len(quotas)), key=lambda i: (sizes[i] - quotas[i], i))
    for i in order[:remainder]:
        sizes[i] += 1
    parts: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        parts.append((start, start + size))
        start += size
    return parts


def _cap_shares(weights: list[Fraction], max_share: Fraction) -> list[Fraction]:
    """``weights`` with every share above ``max_share`` lowered to exactly it."""
    if not 0 < max_share <= 1:
        raise PartitionError(f"max_share must be in (0, 1], got {max_share}")
    if sum(1 for w in weights if w > 0) * max_share < 1:
        raise PartitionError(
            f"{sum(1 for w in weights if w > 0)} positive weights cannot each hold at most "
            f"{max_share} of the whole"
        )
    capped: set[int] = set()
    while True:
        # The capped weights hold max_share of the final total each; the others the rest.
        rest = sum((w for i, w in enumerate(weights) if i not in capped), Fraction(0))
        if len(capped) * max_share >= 1 or rest == 0:
            cap = Fraction(1)
            return [cap if i in capped else Fraction(0) for i in range(len(weights))]
        cap = max_share * rest / (1 - len(capped) * max_share)
        over = {i for i, w in enumerate(weights) if i not in capped and w > cap}
        if not over:
            return [cap if i in capped else w for i, w in enumerate(weights)]
        capped |= over


def chunk_ranges(start: int, end: int, chunk_elements: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into consecutive ``(s, e)`` chunks of ``chunk_elements``
    (the last one possibly shorter); empty for an empty range.

    Raises :class:`PartitionError` if ``0 <= start <= end`` fails or ``chunk_elements``
    is not positive.
    """
    if not 0 <= start <= end:
        raise PartitionError(f"need 0 <= start <= end, got [{start}, {end})")
    if chunk_elements <= 0:
        raise PartitionError(f"chunk_elements must be positive, got {chunk_elements}")
    return [(s, min(s + chunk_elements, end)) for s in range(start, end, chunk_elements)]


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A fresh 1-D float32 vector holding every tensor's values in order.

    Averaging accumulates in float32 or wider, whatever the tensors' dtypes (float16 and
    bfloat16 are widened exactly; float64 is rounded to float32). The tensors must share
    a device; they are not modified. Raises :class:`PartitionError` for a non-floating
    tensor (an integer counter such as BatchNorm's ``num_batches_tracked`` is not
    something to average, and would lose precision past 2**24 in float32).
    """
    pieces: list[torch.Tensor] = []
    for i, tensor in enumerate(tensors):
        if not tensor.is_floating_point():
            raise PartitionError(f"tensor {i} is {tensor.dtype}; only floating tensors average")
        pieces.append(tensor.detach().reshape(-1).to(torch.float32))
    if not pieces:
        return torch.zeros(0, dtype=torch.float32)
    if pieces[0].device.type != "cpu":
        return torch.cat(pieces)
    return torch.cat(pieces, out=empty_float32(sum(p.numel() for p in pieces)))


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut ``flat`` back into tensors with the shapes and dtypes of ``like``.

    The inverse of :func:`flatten`: ``unflatten(flatten(ts), ts)`` equals ``ts`` exactly
    for float32, float16 and bfloat16 tensors. A float32 result is a view of ``flat``
    (copy it into the model with ``target.copy_(piece)``). Raises :class:`PartitionError`
    if ``flat`` is not 1-D or its length is not the total number of elements of ``like``.
    """
    if flat.dim() != 1:
        raise PartitionError(f"flat must be 1-D, got shape {tuple(flat.shape)}")
    needed = sum(t.numel() for t in like)
    if flat.numel() != needed:
        raise PartitionError(f"flat has {flat.numel()} elements, the tensors need {needed}")
    out: list[torch.Tensor] = []
    offset = 0
    for tensor in like:
        n = tensor.numel()
        out.append(flat[offset : offset + n].view(tensor.shape).to(tensor.dtype))
        offset += n
    return out
