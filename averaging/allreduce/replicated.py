"""Several reducers per coordinate, so that one lying reducer cannot move a result.

In a butterfly round each part is reduced by one member, who publishes it as it likes:
the others cannot check a mean without the inputs. With ``reducers_per_part`` r > 1
(odd), the round averages r copies of the vector instead of one
(:func:`replicate`). :meth:`RoundSpec.parts <averaging.allreduce.records.RoundSpec.parts>`
gives no member a share longer than one copy, so the r copies of any coordinate lie in
r different members' shares (two positions one copy apart cannot share a contiguous
range that short). Shares are cut into cells where another share begins or ends in any
copy, so a cell's coordinates have the same r owners, and a dead reducer's cells go to
members owning no other copy of them (there is one from r + 1 members able to reduce).
:func:`fold` then takes, coordinate by coordinate, the median of the r averaged copies.
Every member folds the same agreed tensor, so results stay bitwise identical.

With at most ``(r - 1) / 2`` lying reducers, each coordinate's median lies between two
values that honest reducers computed, each of which counts every sender once (and,
with CenteredClip, bounds each sender's pull): a liar as a reducer moves nothing
beyond what it could move as a sender. The cost is r times the traffic and reduction
work of a round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Folded:
    """The median of a round's averaged copies, and how far apart the copies were."""

    values: torch.Tensor
    """One copy's length: each coordinate's median over the copies."""
    spread: float
    """Largest difference between two copies of one coordinate (0.0 for one copy). Honest
    copies differ by float rounding, or where faults gave them different contributors;
    a large spread is a reducer that published something else."""


def replicate(flat: torch.Tensor, copies: int) -> torch.Tensor:
    """``copies`` copies of the 1-D ``flat``, end to end (``flat`` itself for one)."""
    if copies == 1:
        return flat
    return flat.repeat(copies)


def fold(averaged: torch.Tensor, copies: int) -> Folded:
    """The median over the ``copies`` copies in ``averaged`` (a round's result)."""
    if copies == 1:
        return Folded(averaged, 0.0)
    if averaged.dim() != 1 or averaged.numel() % copies:
        raise ValueError(f"a vector of {averaged.numel()} elements is not {copies} copies")
    stacked = averaged.view(copies, -1)
    if stacked.shape[1] == 0:
        return Folded(stacked[0].clone(), 0.0)
    if copies == 3:  # elementwise min and max: several times faster than torch.median
        a, b, c = stacked
        median = torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    else:
        median = stacked.sort(dim=0).values[copies // 2]
    spread = float((stacked.amax(dim=0) - stacked.amin(dim=0)).max())
    return Folded(median, spread)
