"""Robust aggregation: CenteredClip, as an option of a butterfly round.

Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization"
(ICML 2021): the centered clipping step

    v <- v + sum_i w_i * (x_i - v) * min(1, tau / ||x_i - v||) / sum_i w_i

moves ``v`` towards every input, but each by at most ``tau``, so one sender's pull on the
result is bounded by its share of the weight times ``tau`` whatever it sends. Iterated,
it is gradient descent with step ``1 / sum_i w_i`` on the convex, ``sum_i w_i``-smooth
``sum_i w_i * huber_tau(||x_i - v||)``, so it converges and never overshoots. At its fixed
point, with the honest inputs within ``tau`` of it, one outlier of weight ``w_o`` moves the
result exactly ``tau * w_o / W_honest`` from the honest mean (docs/averaging-robust.md).

The paper starts from the previous round's momentum; a butterfly round has no history,
so we start from the weighted coordinate-wise median, which a minority cannot drag out of
the honest inputs' range in any coordinate. From the weighted mean, an outlier of size
``M`` would start ``v`` about ``M * w_o / W`` away, and each step moves at most ``tau``.

A round clips each part over the whole part (norms over the part, not per chunk):
:class:`CenteredClipReduction` keeps every sender's part and runs :func:`centered_clip`
once all are in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from averaging.allreduce.reduction import capped_sample_weights
from peers.identity import PeerID

#: Elements of the ``[n, columns]`` float64 temporaries that :func:`centered_clip` works
#: on at a time (8 MiB): the inputs are swept in column blocks so that its memory beyond
#: one float64 copy of the inputs stays bounded whatever the part size.
BLOCK_ELEMENTS = 1 << 20

#: Inputs whose largest magnitude lies outside ``[2**-SAFE_EXPONENT, 2**SAFE_EXPONENT]``
#: are first scaled by a power of two (exact): a squared norm of float64 values below
#: 2**400 over at most 2**63 elements stays below 2**863, far from overflow, and values
#: above 2**-400 do not vanish when squared. Any float32 input is inside the range.
SAFE_EXPONENT = 400


@dataclass(frozen=True, kw_only=True)
class CenteredClipConfig:
    """CenteredClip for every part of a butterfly round (``RoundSpec.aggregation``)."""

    tau: float | None = None
    """The paper's clipping radius tau, in the units of the averaged vector and for the
    whole flat vector: a part of ``d_p`` of its ``d`` elements clips at
    ``tau * sqrt(d_p / d)`` (:meth:`part_tau`), so that a vector whose spread is even over
    its coordinates is clipped alike in every part, and one sender's pull on the whole
    vector stays within ``tau`` times its weight share however the parts are cut. Pick
    it about twice the honest inputs' distance from their mean: smaller clips honest
    inputs too (the result is then pulled by up to the honest spread times the outlier's
    share, rather than tau times it), larger lets an outlier pull further.

    None (the default): the *spread rule*. Each reducer sets its part's radius from the
    inputs it holds: ``spread_factor`` times the median distance of the senders' parts
    from their coordinate-wise median (:func:`spread_radius`). Scale-free (gradients
    shrink as training converges; a fixed tau would stop clipping anything, or clip
    everything), and a minority cannot inflate it: with fewer than half the senders
    hostile, the median distance is at most the farthest honest one."""
    spread_factor: float = 2.0
    """The spread rule's multiple of the median distance (``tau=None`` only). 2: honest
    inputs, whose distances from the median are alike in high dimension, are not clipped,
    so an honest round is the mean."""
    num_iterations: int = 20
    """Clipping steps at most, from the coordinate-wise median. The paper iterates the
    step from its starting point; without an outlier the first step already gives the
    mean, and one outlier of weight share ``s`` leaves an error shrinking by about ``s``
    per step. At most 1000: each step is two passes over the part, inside the round."""
    tolerance: float = 1e-6
    """Stop early once a step moves the result by at most ``tolerance * tau``."""
    weigh_by_samples: bool = False
    """False (the paper's setting): every sender counts once. Sample counts are what
    each sender claims, and a weighted aggregate gives a peer that claims a huge one
    the whole say. True: weigh by sample count as the plain mean does, when peers are
    trusted about their counts but not about their values."""

    def __post_init__(self) -> None:
        for name in ("tau", "spread_factor"):
            value = getattr(self, name)
            if value is None and name == "tau":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite")
        if isinstance(self.num_iterations, bool) or not isinstance(self.num_iterations, int):
            raise ValueError("num_iterations must be an int")
        if not 1 <= self.num_iterations <= 1000:
            raise ValueError("num_iterations must be in [1, 1000]")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, int | float):
            raise ValueError("tolerance must be a number")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError("tolerance must be non-negative and finite")
        if not isinstance(self.weigh_by_samples, bool):
            raise ValueError("weigh_by_samples must be a bool")

    def part_tau(self, part_elements: int, total_elements: int) -> float | None:
        """The radius for a part of ``part_elements`` of ``total_elements``; None under
        the spread rule (each reducer measures its part's)."""
        if self.tau is None:
            return None
        return self.tau * math.sqrt(part_elements / total_elements) if total_elements else 0.0


def centered_clip(
    vectors: torch.Tensor,
    weights: torch.Tensor,
    *,
    tau: float | None,
    num_iterations: int,
    tolerance: float = 0.0,
    spread_factor: float = 2.0,
) -> torch.Tensor:
    """CenteredClip of the rows of ``vectors`` (``[n, d]``) with ``weights`` (``[n]``).

    Starts from the weighted coordinate-wise (lower) median and takes up to
    ``num_iterations`` clipping steps of radius ``tau`` (the paper's tau), stopping early
    once a step moves it by at most ``tolerance * tau``. ``num_iterations=0`` returns
    the median. ``tau=None``: the spread rule, ``spread_factor`` times
    :func:`spread_radius` of these rows (0 when most rows equal the median: then the
    median is the result). Computes in float64 and returns ``vectors``' dtype. Every coordinate of
    the result lies within the inputs' range in that coordinate, so finite inputs give a
    finite result. Memory: one float64 copy of ``vectors`` (none if already float64 and
    of moderate magnitude) and ``BLOCK_ELEMENTS`` temporaries.

    Raises ValueError for a shape mismatch, no rows, non-float or non-finite vectors,
    weights that are not positive and finite, or a bad ``tau``, ``num_iterations`` or
    ``tolerance``.
    """
    if vectors.dim() != 2 or not vectors.is_floating_point() or vectors.shape[0] < 1:
        raise ValueError("vectors must be a float tensor of shape [n >= 1, d]")
    if weights.shape != (vectors.shape[0],):
        raise ValueError(f"weights must have shape ({vectors.shape[0]},)")
    if tau is not None and not (math.isfinite(tau) and tau > 0):
        raise ValueError("tau must be positive and finite")
    if not (math.isfinite(spread_factor) and spread_factor > 0):
        raise ValueError("spread_factor must be positive and finite")
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int):
        raise ValueError("num_iterations must be an int")
    if num_iterations < 0 or not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError("num_iterations and tolerance must not be negative")
    w = weights.to(device=vectors.device, dtype=torch.float64)
    if not bool(torch.isfinite(w).all()) or not bool((w > 0).all()):
        raise ValueError("weights must be positive and finite")
    if not bool(torch.isfinite(vectors).all()):
        raise ValueError("vectors hold NaN or infinity")
    if vectors.shape[1] == 0:
        return vectors.new_zeros((0,))
    w = w / w.max()  # at most n, so the sum cannot overflow
    w = w / w.sum()
    x = vectors.to(torch.float64)
    max_abs = float(x.abs().max())
    if max_abs == 0.0:
        return vectors.new_zeros((vectors.shape[1],))
    exponent = math.frexp(max_abs)[1]
    scaled = not -SAFE_EXPONENT <= exponent <= SAFE_EXPONENT
    if scaled:  # by 2**-exponent, in two exact factors that each stay in float64's range
        half = -exponent // 2
        x = x * math.ldexp(1.0, half) * math.ldexp(1.0, -exponent - half)
        if tau is not None:
            try:
                tau = math.ldexp(tau, -exponent)
            except OverflowError:  # larger than any distance: nothing is ever clipped
                tau = math.inf
    v = _weighted_median(x, w)
    if tau is None:  # measured in the scaled units, so nothing overflows
        tau = spread_factor * _median_distance(x, v)
        if tau == 0.0:  # most rows are the median itself
            num_iterations = 0
    for _ in range(num_iterations):
        step_norm = _clip_step(x, w, v, tau)
        if step_norm <= tolerance * tau:
            break
    # A convex combination of v and the inputs at every step keeps v in their range;
    # clamping removes the last rounding, so that unscaling and the cast stay finite.
    v = torch.minimum(torch.maximum(v, x.amin(dim=0)), x.amax(dim=0))
    if scaled:
        v = v * math.ldexp(1.0, -half) * math.ldexp(1.0, exponent + half)
    return v.to(vectors.dtype)


def spread_radius(vectors: torch.Tensor, weights: torch.Tensor) -> float:
    """The spread rule's unit: the upper median, over the rows of ``vectors``, of their
    distance from the weighted coordinate-wise median. With fewer than half the rows
    hostile, it is at most the largest honest row's distance from that median (which
    itself lies within the honest rows' range in every coordinate): a minority cannot
    inflate it, whatever it sends. Rows must be finite; float64 internally."""
    if vectors.dim() != 2 or vectors.shape[0] < 1 or weights.shape != (vectors.shape[0],):
        raise ValueError("vectors must be [n >= 1, d] and weights [n]")
    x = vectors.to(torch.float64)
    w = weights.to(dtype=torch.float64)
    return _median_distance(x, _weighted_median(x, w / w.sum()))


def _median_distance(x: torch.Tensor, v: torch.Tensor) -> float:
    distances = torch.sort(_distances(x, v)).values
    return float(distances[x.shape[0] // 2])


def _distances(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each row's Euclidean distance from ``v``, swept in column blocks."""
    n, d = x.shape
    step = max(1, BLOCK_ELEMENTS // n)
    squares = x.new_zeros(n)
    for start in _blocks(n, d):
        squares += (x[:, start : start + step] - v[start : start + step]).square().sum(dim=1)
    return squares.sqrt()


def _blocks(n: int, d: int) -> range:
    return range(0, d, max(1, BLOCK_ELEMENTS // n))


def _weighted_median(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per column, the smallest value whose cumulative weight reaches half the total."""
    n, d = x.shape
    median = x.new_empty(d)
    step = max(1, BLOCK_ELEMENTS // n)
    for start in _blocks(n, d):
        values, order = torch.sort(x[:, start : start + step], dim=0, stable=True)
        cumulative = torch.cumsum(w[order], dim=0)
        index = (cumulative < 0.5 * cumulative[-1:]).sum(dim=0, keepdim=True)
        median[start : start + step] = values.gather(0, index.clamp_(max=n - 1)).squeeze(0)
    return median


def _clip_step(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor, tau: float) -> float:
    """One clipping step, applied to ``v`` in place; returns the step's norm."""
    n, d = x.shape
    step = max(1, BLOCK_ELEMENTS // n)
    norms = _distances(x, v)
    # min(1, tau / norm) without dividing by a zero norm (an input equal to v).
    factor = torch.where(norms > tau, tau / norms.clamp_min(torch.finfo(x.dtype).tiny), 1.0)
    coefficients = w * factor
    step_squares = 0.0
    for start in _blocks(n, d):
        block = coefficients @ (x[:, start : start + step] - v[start : start + step])
        v[start : start + step] += block
        step_squares += float(block.square().sum())
    return math.sqrt(step_squares)


class CenteredClipReduction:
    """CenteredClip of one part over the senders whose chunks arrived: the interface of
    :class:`~averaging.allreduce.reduction.PartReduction`, but every sender's chunks are kept until
    :meth:`finalize`, which clips over whole parts. Holds at most members x part size
    values, as ``PartReduction`` does to make dropping exact."""

    def __init__(
        self,
        ranges: Sequence[tuple[int, int]],
        device: torch.device,
        *,
        config: CenteredClipConfig,
        tau: float | None,
        max_weight_ratio: float | None = None,
    ) -> None:
        """``tau`` is this part's radius (``config.part_tau``; None: the spread rule over
        the inputs, at finalize); ``config`` gives the iterations and whether sample
        counts weigh; weighed, a count above ``max_weight_ratio`` times the senders'
        median counts as that much."""
        self.max_weight_ratio = max_weight_ratio
        self.ranges = list(ranges)
        """The part's chunks, as absolute ``(start, end)`` ranges of the flat vector."""
        self._device = device
        self._config = config
        self._tau = tau
        self._received: dict[PeerID, dict[int, torch.Tensor]] = {}
        self._weights: dict[PeerID, float] = {}

    def has(self, sender: PeerID, chunk: int) -> bool:
        return chunk in self._received.get(sender, {})

    def received(self, sender: PeerID) -> int:
        """Chunks of ``sender``'s contribution added so far."""
        return len(self._received.get(sender, {}))

    def complete(self, sender: PeerID) -> bool:
        """True when every chunk of ``sender``'s contribution has been added."""
        return self.received(sender) == len(self.ranges)

    def add(self, sender: PeerID, chunk: int, values: torch.Tensor, weight: float) -> None:
        """Keep ``values`` (by reference) as chunk ``chunk`` of ``sender``'s part; the
        round has checked that a sender's chunks all carry one weight."""
        self._received.setdefault(sender, {})[chunk] = values
        self._weights[sender] = weight

    def drop(
        self, sender: PeerID, order: Sequence[PeerID], weights: Mapping[PeerID, float]
    ) -> None:
        """Forget ``sender`` (``order`` and ``weights`` are unused: nothing is summed
        before :meth:`finalize`)."""
        self._received.pop(sender, None)
        self._weights.pop(sender, None)

    def finalize(self) -> torch.Tensor:
        """The float32 CenteredClip of the whole part over the senders whose whole part
        is in (the round finalizes only once every live sender's is), in PeerID order so
        that the result does not depend on arrival order; frees the chunks."""
        senders = sorted(s for s in self._received if self.complete(s))
        start, end = self.ranges[0][0], self.ranges[-1][1]
        matrix = torch.empty(len(senders), end - start, dtype=torch.float64, device=self._device)
        for row, sender in enumerate(senders):
            chunks = self._received.pop(sender)  # freed as copied: one float64 copy at most
            for c, (s, e) in enumerate(self.ranges):
                matrix[row, s - start : e - start] = chunks[c]
        self._received.clear()
        if self._config.weigh_by_samples:
            capped = capped_sample_weights(
                {s: self._weights[s] for s in senders}, self.max_weight_ratio
            )
            weights = torch.tensor([capped[s] for s in senders], dtype=torch.float64)
        else:
            weights = torch.ones(len(senders), dtype=torch.float64)
        values = centered_clip(
            matrix,
            weights,
            tau=self._tau,
            num_iterations=self._config.num_iterations,
            tolerance=self._config.tolerance,
            spread_factor=self._config.spread_factor,
        )
        return values.to(torch.float32)
