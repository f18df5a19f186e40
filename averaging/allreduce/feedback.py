"""Error feedback for lossy codecs inside butterfly rounds.

A lossy codec (8-bit, float16) rounds the same way round after round: averaging the
same gradient direction a thousand times with 8-bit chunks adds the same rounding error
a thousand times. Error feedback keeps what the codec left out, per coordinate, and
adds it to the next round's values, so the errors cancel over rounds instead of adding
up: the sum of a peer's results stays within one rounding step of the sum of the exact
averages, whatever the number of rounds.

A round has two encodings, and so two residuals, both over the flat vector:

- **sent**: my contribution to a part another member reduces travels encoded. The
  round's local vector is ``flat + sent`` (:meth:`RoundFeedback.compensate`); what the
  reducer decoded is recorded once per chunk, the first time the chunk is encoded. A
  chunk resent to the heir of a failed reducer is the same bytes, so it is not counted
  twice.
- **published**: the averaged part I reduce travels encoded to every member (and I hold
  what they decode, so results stay identical). I encode ``average + published`` and
  keep the difference from what was decoded.

When the round ends, :meth:`RoundErrors.settle` applies what its report says: a part
whose average counts me through the codec keeps the recorded error; a part I reduced
with my own exact values, or one left at my own value, owes nothing; a part averaged
without me keeps its residual for later. A published residual is kept only where the
values this peer holds are the ones it published.
"""

from __future__ import annotations

import torch

from averaging.allreduce.records import RoundReport
from averaging.compression import EncodedTensor, decode_tensor


class RoundFeedback:
    """The residuals of one peer's rounds over a flat vector of ``size`` elements
    (float32; owned by the caller that runs the rounds, e.g. an :class:`Averager`)."""

    def __init__(self, size: int) -> None:
        self.sent = torch.zeros(size, dtype=torch.float32)
        self.published = torch.zeros(size, dtype=torch.float32)

    def compensate(self, flat: torch.Tensor) -> torch.Tensor:
        """The vector a round should average: ``flat`` plus what earlier rounds' sent
        chunks left out."""
        if flat.shape != self.sent.shape:
            raise ValueError(f"a vector of {flat.numel()} elements, not {self.sent.numel()}")
        return flat.to(torch.float32) + self.sent

    def round(self) -> RoundErrors:
        """What one round records; apply it with :meth:`RoundErrors.settle`."""
        return RoundErrors(self)


class RoundErrors:
    """One round's errors, recorded as chunks are encoded, applied when it ends."""

    def __init__(self, feedback: RoundFeedback) -> None:
        self._feedback = feedback
        self._sent: dict[int, torch.Tensor] = {}  # chunk start -> values - decoded
        self._published: dict[int, torch.Tensor] = {}

    def on_sent(self, start: int, values: torch.Tensor, encoded: EncodedTensor) -> None:
        """A chunk of my values starting at ``start`` went out as ``encoded``: the
        first time only (a resend is the same bytes)."""
        if start not in self._sent:
            self._sent[start] = values.to(torch.float32) - _decoded(encoded)

    def to_publish(self, start: int, end: int, average: torch.Tensor) -> torch.Tensor:
        """What to encode for my averaged values ``average`` of ``[start, end)``."""
        return average.to(torch.float32) + self._feedback.published[start:end]

    def on_published(self, start: int, compensated: torch.Tensor, encoded: EncodedTensor) -> None:
        """``compensated`` (from :meth:`to_publish`) went out as ``encoded``; the last
        publication of a chunk counts (a part reduced again replaces the first)."""
        self._published[start] = compensated - _decoded(encoded)

    def settle(self, report: RoundReport) -> None:
        """Apply the round's errors as its ``report`` says each part ended."""
        sent, published = self._feedback.sent, self._feedback.published
        for part in report.parts:
            if part.end == part.start:
                continue
            if not part.averaged or (part.reducer == report.me and report.me in part.contributors):
                sent[part.start : part.end] = 0.0  # my exact values went in
            elif report.me in part.contributors:
                for start, error in self._sent.items():
                    if part.start <= start < part.end:
                        sent[start : start + error.numel()] = error
            if part.reducer == report.me:
                for start, error in self._published.items():
                    if part.start <= start < part.end:
                        published[start : start + error.numel()] = error
        self._sent.clear()
        self._published.clear()


def _decoded(encoded: EncodedTensor) -> torch.Tensor:
    return decode_tensor(encoded).to(torch.float32).reshape(-1)
