"""The two halves of a part's life in a butterfly round, as plain data structures (no
events, no policy: ``averaging.allreduce.butterfly`` decides who is in and when a part is final).

- :class:`PartReduction`: the reducer's side. Chunks are added as they arrive into
  running weighted sums (docs/design/averaging.md, "Reduction overlaps transfer"), and
  every sender's chunks are kept until the part is final, so that dropping a sender who
  fails mid-round is exact: its chunks' sums are rebuilt from the others rather than
  subtracted (subtracting would leave rounding residue of the dropped values).
- :class:`PartReceipt`: a receiver's side: the averaged chunks of a part someone else
  reduces, and the contributor set they came with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from averaging.allreduce.buffers import empty_float32
from averaging.compression.base import all_finite
from peers.identity import PeerID


def cap_at_median(weights: Sequence[float], ratio: float) -> list[float]:
    """``weights`` with each capped at ``ratio`` times the median of the positive ones
    (0 stays 0); every member computes the same caps from the same weights."""
    positive = sorted(float(w) for w in weights if w > 0)
    if not positive:
        return [float(w) for w in weights]
    middle = len(positive) // 2
    median = (
        positive[middle] if len(positive) % 2 else (positive[middle - 1] + positive[middle]) / 2
    )
    cap = ratio * median
    return [min(float(w), cap) for w in weights]


def capped_sample_weights(
    weights: Mapping[PeerID, float], ratio: float | None
) -> dict[PeerID, float]:
    """Each sender's weight, capped at ``ratio`` times the median over ``weights`` (the
    senders of one part, the reducer included); unchanged with ``ratio`` None."""
    senders = sorted(weights)
    if ratio is None:
        return {s: weights[s] for s in senders}
    return dict(zip(senders, cap_at_median([weights[s] for s in senders], ratio), strict=True))


class PartReduction:
    """The weighted mean of one part over the senders whose chunks arrived.

    Sums are float32, in one buffer for the whole part whose chunks become their means in
    place, each when it is complete (:meth:`average_chunk`) or at :meth:`finalize` (no
    second buffer, no copy): about a third of the memory traffic of
    float64 sums, which made the reduction the largest torch cost of a round. A float32
    sum can overflow where the mean would not (``w * x`` past 3.4e38, or several values
    near the float32 maximum); a chunk whose mean comes out non-finite is then recomputed
    from the kept chunks in float64, in PeerID order, and rounded once. Rounding: a
    float32 sum of ``n`` terms is within about ``n`` ulps of the exact weighted mean;
    every member still receives the same, reducer-computed values.
    """

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        device: torch.device,
        *,
        max_weight_ratio: float | None = None,
    ) -> None:
        self.max_weight_ratio = max_weight_ratio
        """Weights above this multiple of the senders' median count as that much."""
        self.ranges = list(ranges)
        """The part's chunks, as absolute ``(start, end)`` ranges of the flat vector."""
        first, last = self.ranges[0][0], self.ranges[-1][1]
        self._buffer = empty_float32(last - first, device)
        self._sums = [self._buffer[s - first : e - first] for s, e in self.ranges]
        # A chunk's sum starts as its first contribution (w * x written over the empty
        # buffer): no zero fill, one pass less per chunk.
        self._started = [False] * len(self.ranges)
        self._totals = [0.0] * len(self.ranges)
        self._received: dict[PeerID, dict[int, torch.Tensor]] = {}
        self._weights: dict[PeerID, float] = {}
        self._averaged = [False] * len(self.ranges)

    @property
    def values(self) -> torch.Tensor:
        """The part's buffer: a chunk's weighted mean once :meth:`averaged`, its running
        sum before."""
        return self._buffer

    def averaged(self, chunk: int) -> bool:
        """True when chunk ``chunk`` holds its weighted mean (:meth:`average_chunk`)."""
        return self._averaged[chunk]

    def chunk_complete(self, chunk: int, senders: Iterable[PeerID]) -> bool:
        """True when every one of ``senders`` has sent chunk ``chunk``."""
        return all(chunk in self._received.get(s, {}) for s in senders)

    def has(self, sender: PeerID, chunk: int) -> bool:
        return chunk in self._received.get(sender, {})

    def received(self, sender: PeerID) -> int:
        """Chunks of ``sender``'s contribution added so far."""
        return len(self._received.get(sender, {}))

    def complete(self, sender: PeerID) -> bool:
        """True when every chunk of ``sender``'s contribution has been added."""
        return self.received(sender) == len(self.ranges)

    def add(self, sender: PeerID, chunk: int, values: torch.Tensor, weight: float) -> None:
        """Add ``weight * values`` to chunk ``chunk`` (``values`` is kept by reference)."""
        self._received.setdefault(sender, {})[chunk] = values
        self._weights[sender] = weight
        self._accumulate(chunk, values, weight)

    def _accumulate(self, chunk: int, values: torch.Tensor, weight: float) -> None:
        total = self._sums[chunk]
        if not self._started[chunk]:
            torch.mul(values, weight, out=total)
            self._started[chunk] = True
        else:
            total.add_(values, alpha=weight)
        self._totals[chunk] += weight

    def drop(
        self, sender: PeerID, order: Sequence[PeerID], weights: Mapping[PeerID, float]
    ) -> None:
        """Forget ``sender``: rebuild the sums of its chunks from the other senders', in
        ``order`` (``weights`` gives each sender's weight)."""
        self._weights.pop(sender, None)
        self._resum(list(self._received.pop(sender, {})), order, weights)

    def _resum(
        self, chunks: Sequence[int], order: Sequence[PeerID], weights: Mapping[PeerID, float]
    ) -> None:
        """Rebuild the sums of ``chunks`` from the kept chunks of ``order``'s senders."""
        for chunk in chunks:
            self._started[chunk] = False
            self._averaged[chunk] = False
            self._totals[chunk] = 0.0
            for member in order:
                values = self._received.get(member, {}).get(chunk)
                if values is not None:
                    self._accumulate(chunk, values, weights[member])

    def average_chunk(self, chunk: int) -> torch.Tensor:
        """Turn chunk ``chunk``'s sum into the weighted mean over the senders whose chunks
        are in, in place, and return it (a view of :attr:`values`). Its senders' chunks
        are kept: if one of them is dropped later, :meth:`drop` rebuilds the sum without
        it and the chunk must be averaged again. A sum that overflowed float32 is
        recomputed in float64 over the senders in PeerID order."""
        if self._averaged[chunk]:
            return self._sums[chunk]
        senders = sorted(s for s, chunks in self._received.items() if chunk in chunks)
        capped = capped_sample_weights(self._weights, self.max_weight_ratio)
        if capped != self._weights:  # a claim above the cap: sum again with capped weights
            self._resum([chunk], senders, capped)
        else:
            capped = self._weights
        total, weight = self._sums[chunk], self._totals[chunk]
        assert self._started[chunk]  # the reducer's own chunk is always in
        total.div_(weight)
        if not all_finite(total):  # a float32 sum overflowed: redo it exactly
            exact = torch.zeros(total.shape, dtype=torch.float64, device=total.device)
            for sender in senders:
                exact.add_(self._received[sender][chunk], alpha=capped[sender])
            total.copy_(exact.div_(weight))
        self._averaged[chunk] = True
        return total

    def finalize(self) -> torch.Tensor:
        """The float32 weighted mean of the whole part (averaging the chunks not averaged
        yet); frees the per-sender chunks. Every chunk must have a positive total weight
        (the reducer's own is always in)."""
        for chunk in range(len(self.ranges)):
            self.average_chunk(chunk)
        self._received.clear()
        self._sums = []
        return self._buffer


class PartReceipt:
    """Which averaged chunks of one part have arrived from its reducer (the values go
    straight into the round's result as they arrive)."""

    def __init__(self, reducer: PeerID, num_chunks: int) -> None:
        self.reducer = reducer
        self.num_chunks = num_chunks
        self.chunks: set[int] = set()
        self.contributors: frozenset[PeerID] | None = None
        """The set every chunk of the part must carry (fixed by the first one)."""

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.num_chunks
