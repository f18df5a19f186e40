"""The two halves of a part's life in a butterfly round, as plain data structures (no
events, no policy: ``averaging.butterfly`` decides who is in and when a part is final).

- :class:`PartReduction`: the reducer's side. Chunks are added as they arrive into
  running float64 weighted sums (reduction overlaps transfer, DESIGN.md, averaging), and
  every sender's chunks are kept until the part is final, so that dropping a sender who
  fails mid-round is exact: its chunks' sums are rebuilt from the others rather than
  subtracted (subtracting would leave rounding residue of the dropped values).
- :class:`PartReceipt`: a receiver's side: the averaged chunks of a part someone else
  reduces, and the contributor set they came with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from peers.identity import PeerID


class PartReduction:
    """The weighted mean of one part over the senders whose chunks arrived.

    Sums are float64: a float32 value times a weight of at most 2**64, summed over any
    group, cannot overflow, and the mean rounds once, to float32, at :meth:`finalize`.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]], device: torch.device) -> None:
        self.ranges = list(ranges)
        """The part's chunks, as absolute ``(start, end)`` ranges of the flat vector."""
        # A chunk's sum starts as its first contribution (w * x is exactly 0 + w * x):
        # no zero-filled buffer, one pass less per chunk.
        self._sums: list[torch.Tensor | None] = [None] * len(self.ranges)
        self._totals = [0.0] * len(self.ranges)
        self._received: dict[PeerID, dict[int, torch.Tensor]] = {}

    def has(self, sender: PeerID, chunk: int) -> bool:
        return chunk in self._received.get(sender, {})

    def complete(self, sender: PeerID) -> bool:
        """True when every chunk of ``sender``'s contribution has been added."""
        return len(self._received.get(sender, {})) == len(self.ranges)

    def add(self, sender: PeerID, chunk: int, values: torch.Tensor, weight: float) -> None:
        """Add ``weight * values`` to chunk ``chunk`` (``values`` is kept by reference)."""
        self._received.setdefault(sender, {})[chunk] = values
        self._accumulate(chunk, values, weight)

    def _accumulate(self, chunk: int, values: torch.Tensor, weight: float) -> None:
        total = self._sums[chunk]
        if total is None:
            self._sums[chunk] = values.to(torch.float64).mul_(weight)
        else:
            total.add_(values, alpha=weight)  # promoted to float64 in place
        self._totals[chunk] += weight

    def drop(
        self, sender: PeerID, order: Sequence[PeerID], weights: Mapping[PeerID, float]
    ) -> None:
        """Forget ``sender``: rebuild the sums of its chunks from the other senders', in
        ``order`` (``weights`` gives each sender's weight)."""
        for chunk in self._received.pop(sender, {}):
            self._sums[chunk] = None
            self._totals[chunk] = 0.0
            for member in order:
                values = self._received.get(member, {}).get(chunk)
                if values is not None:
                    self._accumulate(chunk, values, weights[member])

    def finalize(self) -> torch.Tensor:
        """The float32 weighted mean of the whole part; frees the per-sender chunks.
        Every chunk must have a positive total weight (the reducer's own is always in)."""
        first, last = self.ranges[0][0], self.ranges[-1][1]
        values = torch.empty(last - first, dtype=torch.float32)
        for (start, end), total, weight in zip(self.ranges, self._sums, self._totals, strict=True):
            assert total is not None  # the reducer's own chunk is always in
            values[start - first : end - first].copy_(total.div_(weight))
        self._received.clear()
        self._sums = []
        return values


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
