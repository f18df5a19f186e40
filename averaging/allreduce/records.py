"""The records of a butterfly all-reduce round: its spec, who reduces a dead reducer's
part, the events a :class:`~averaging.allreduce.butterfly.ButterflyRound` returns, and its result.

Kept apart from the state machine (``averaging.allreduce.butterfly``) so that the wire layer can
import the vocabulary without the machine, and so each module stays small
(CONTRIBUTING.md, "Small modules, one folder per subsystem").
"""

from __future__ import annotations

import enum
import functools
import hashlib
import itertools
import math
import struct
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
import xxhash

from averaging.allreduce.partition import split_parts
from averaging.allreduce.reduction import cap_at_median
from averaging.allreduce.robust import CenteredClipConfig
from averaging.compression import MAX_DECODED_ELEMENTS
from peers.errors import LocalProtocolError
from peers.identity import PeerID

#: Longest round id we accept. Round ids come from matchmaking (a hash or a random
#: 16-32 byte token); 64 bytes leaves room while bounding what every chunk carries.
MAX_ROUND_ID_BYTES = 64

#: Values of ``RoundSpec.reducers_per_part``: 1, or an odd count whose median outvotes
#: ``(count - 1) / 2`` lying reducers.
REDUCERS_PER_PART = (1, 3, 5)


class RoundError(LocalProtocolError):
    """A round was built with inconsistent inputs or used out of order (our caller's
    fault): asking for a result before every part is resolved, reassigning a part whose
    reducer is alive, excluding ourselves. A remote's bad message is never raised: it is
    returned as a :class:`RejectedChunk` event."""


#: A sample weight counts at most this many times the median weight of the senders of
#: a part (``RoundSpec.max_weight_ratio``): weights are claims nobody verifies.
DEFAULT_MAX_WEIGHT_RATIO = 4.0


@dataclass(frozen=True, kw_only=True)
class RoundSpec:
    """What every member of one round agrees on before it starts (from matchmaking)."""

    round_id: bytes
    """Unique per round; chunks carrying another id are rejected as stale."""
    members: tuple[PeerID, ...]
    """The group, in an order every member shares; member ``i`` reduces part ``i``."""
    weights: tuple[float, ...]
    """Bandwidth weights, one per member: part sizes are proportional to them. 0 for a
    client-mode member, which sends its vector but reduces nothing."""
    total_elements: int
    """Length of the flat vector being averaged."""
    chunk_elements: int
    """Elements per chunk when streaming a part (the last chunk of a part may be shorter)."""
    me: PeerID
    """The peer whose point of view a round takes; one of ``members``."""
    aggregation: CenteredClipConfig | None = None
    """How reducers combine a part: None for the weighted mean; a
    :class:`~averaging.allreduce.robust.CenteredClipConfig` for CenteredClip over whole parts."""
    max_weight_ratio: float | None = DEFAULT_MAX_WEIGHT_RATIO
    """Largest sample weight a reducer counts, as a multiple of the median weight of
    the part's contributors: a weight is each sender's own claim, and one of 2**64
    would otherwise make one sender the whole mean. None: no cap (weights that are
    trusted and legitimately far apart)."""
    reducers_per_part: int = 1
    """How many distinct members reduce each coordinate (:data:`REDUCERS_PER_PART`).
    Above 1, the vector is that many copies of the caller's (``total_elements`` is
    their total length), no member's share exceeds one copy's length, so the copies of
    each coordinate fall to distinct reducers; shares are cut into cells (:meth:`parts`)
    and a dead reducer's cells go to members that reduce no other copy of them
    (:mod:`averaging.allreduce.replicated`). The caller takes the median of the copies: one lying
    reducer cannot move it. Needs at least that many members with a positive weight."""

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, bytes) or not 0 < len(self.round_id):
            raise RoundError("round_id must be non-empty bytes")
        if len(self.round_id) > MAX_ROUND_ID_BYTES:
            raise RoundError(f"round_id is longer than {MAX_ROUND_ID_BYTES} bytes")
        if not self.members or not all(isinstance(m, PeerID) for m in self.members):
            raise RoundError("members must be a non-empty tuple of PeerIDs")
        if len(set(self.members)) != len(self.members):
            raise RoundError("members must be distinct")
        if len(self.weights) != len(self.members):
            raise RoundError(f"{len(self.weights)} weights for {len(self.members)} members")
        if self.me not in self.members:
            raise RoundError("me must be one of the members")
        if not 0 < self.chunk_elements <= MAX_DECODED_ELEMENTS:
            raise RoundError(f"chunk_elements must be in [1, {MAX_DECODED_ELEMENTS}]")
        if self.reducers_per_part not in REDUCERS_PER_PART:
            raise RoundError(f"reducers_per_part must be one of {REDUCERS_PER_PART}")
        if self.total_elements % self.reducers_per_part:
            raise RoundError(
                f"total_elements ({self.total_elements}) must be {self.reducers_per_part} "
                "equal copies"
            )
        if self.reducers_per_part > 1 and sum(1 for w in self.weights if w > 0) < (
            self.reducers_per_part
        ):
            raise RoundError(
                f"{self.reducers_per_part} reducers per part need as many members with a "
                "positive weight"
            )
        split_parts(self.total_elements, self.weights)  # raises PartitionError if invalid
        if self.aggregation is not None and not isinstance(self.aggregation, CenteredClipConfig):
            raise RoundError("aggregation must be None or a CenteredClipConfig")
        ratio = self.max_weight_ratio
        if ratio is not None and not (
            isinstance(ratio, int | float) and math.isfinite(ratio) and ratio >= 1
        ):
            raise RoundError("max_weight_ratio must be None or a finite number >= 1")

    def parts(self) -> list[tuple[int, int]]:
        """Part ``i``'s ``[start, end)``, as every member computes it. With one reducer
        per part, part ``i`` is member ``i``'s: sized by the bandwidth weights, each
        capped at :data:`MAX_SHARE_RATIO` times the median positive weight (a claim
        nobody verifies cannot buy a member the vector). With several, each member's
        share (at most one copy long) is cut into *cells*, where another member's share
        begins or ends in any copy, so that the copies of a cell's coordinates belong
        to the same members throughout (:attr:`owners` says whose each part is)."""
        return list(self._layout[0])

    @property
    def owners(self) -> tuple[int, ...]:
        """For each part, the index of the member it starts with (its reducer unless
        it dies): ``range(len(members))`` with one reducer per part."""
        return self._layout[1]

    @functools.cached_property
    def _layout(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        # Computed once: a round asks for its parts per chunk it copies or serves.
        share = Fraction(1, self.reducers_per_part) if self.reducers_per_part > 1 else None
        shares = split_parts(self.total_elements, capped_weights(self.weights), max_share=share)
        if self.reducers_per_part == 1:
            return tuple(shares), tuple(range(len(shares)))
        copy = self.copy_elements
        cuts = sorted({b % copy for s in shares for b in s} | {0})
        breaks = [c * copy + k for c in range(self.reducers_per_part) for k in cuts]
        parts: list[tuple[int, int]] = []
        owners: list[int] = []
        for member, (start, end) in enumerate(shares):
            inside = [b for b in breaks if start < b < end]
            edges = [start, *inside, end]
            for left, right in itertools.pairwise(edges):
                parts.append((left, right))  # (a client-mode member: one empty part)
                owners.append(member)
        return tuple(parts), tuple(owners)

    @property
    def copy_elements(self) -> int:
        """Length of one copy of the caller's vector (``total_elements`` when
        ``reducers_per_part`` is 1)."""
        return self.total_elements // self.reducers_per_part

    def digest(self) -> bytes:
        """What every member's spec of this round shares (all but ``me``), hashed: the
        links of a round carry it, so that members given different specs for one round
        id never exchange a chunk."""
        digest = hashlib.sha256(b"round spec")
        digest.update(len(self.round_id).to_bytes(1, "big") + self.round_id)
        for member, weight in zip(self.members, self.weights, strict=True):
            digest.update(member.to_bytes() + struct.pack(">d", float(weight)))
        digest.update(self.total_elements.to_bytes(8, "big"))
        digest.update(self.chunk_elements.to_bytes(8, "big"))
        digest.update(repr(self.aggregation).encode())
        digest.update(repr(self.max_weight_ratio).encode())
        digest.update(self.reducers_per_part.to_bytes(1, "big"))
        return digest.digest()


#: Largest part a member may get, as a multiple of the part of a member at the median
#: bandwidth: bandwidths are each member's own claim, so one claim of 1e15 would
#: otherwise hand one member nearly every coordinate to reduce (and publish as it likes).
MAX_SHARE_RATIO = 4.0


def capped_weights(weights: Sequence[float]) -> list[float]:
    """``weights`` with each capped at :data:`MAX_SHARE_RATIO` times the median of the
    positive ones (0 stays 0: a client-mode member)."""
    return cap_at_median(weights, MAX_SHARE_RATIO)


def _reassignment_rank(round_id: bytes, part_index: int, member: PeerID) -> bytes:
    """A per-round, per-part pseudo-random order of members that every peer computes
    alike; a random order spreads several dead reducers' parts over the survivors."""
    digest = hashlib.sha256()
    digest.update(len(round_id).to_bytes(1, "big") + round_id)
    digest.update(part_index.to_bytes(8, "big"))
    digest.update(member.to_bytes())
    return digest.digest()


def plan_reassignment(spec: RoundSpec, failed: Set[PeerID]) -> dict[int, PeerID]:
    """Who reduces each non-empty part whose original reducer is in ``failed``.

    Part ``i`` goes to the surviving member with a positive weight (client-mode members
    cannot accept the senders' connections) whose ``sha256(round_id, i, member)`` is
    smallest. A pure function of ``(spec, failed)``: survivors that know the same
    failures make the same plan, whatever order they learned them in; and a new reducer
    that dies too is replaced by the next in the same order. With several reducers per
    part, candidates that reduce no other copy of the part's coordinates (in their own
    part or one inherited before, in part order) come first; if there is none, any
    candidate. A part with no candidate is left out of the plan (it stays at each peer's
    own value).
    """
    candidates = [
        m for m, w in zip(spec.members, spec.weights, strict=True) if w > 0 and m not in failed
    ]
    parts = spec.parts()
    owners = spec.owners
    # With several reducers per part, each member's parts (its own, then what it
    # inherits here) must cover distinct coordinates: two copies of one coordinate in
    # one member's hands would give it two votes in their median.
    held: dict[PeerID, list[tuple[int, int]]] = {m: [] for m in candidates}
    for part, owner in zip(parts, owners, strict=True):
        if spec.members[owner] in held:
            held[spec.members[owner]].append(part)
    plan: dict[int, PeerID] = {}
    for i, (start, end) in enumerate(parts):
        if end <= start or spec.members[owners[i]] not in failed:
            continue
        fit = [
            m
            for m in candidates
            if spec.reducers_per_part == 1
            or not any(copies_overlap((start, end), other, spec.copy_elements) for other in held[m])
        ]
        if candidates:
            # Where no member is free of the part's coordinates, liveness comes first:
            # the heir then holds two of their copies (docs/design/agreement.md, limits).
            choice = fit or candidates
            plan[i] = min(choice, key=lambda m: _reassignment_rank(spec.round_id, i, m))
            held[plan[i]].append((start, end))
    return plan


def copies_overlap(a: tuple[int, int], b: tuple[int, int], copy_elements: int) -> bool:
    """Whether ranges ``a`` and ``b`` of a vector of copies (each ``copy_elements``
    long) hold a copy of one coordinate in common."""
    return any(
        x_start < y_end and y_start < x_end
        for x_start, x_end in _in_one_copy(a, copy_elements)
        for y_start, y_end in _in_one_copy(b, copy_elements)
    )


def _in_one_copy(part: tuple[int, int], copy_elements: int) -> list[tuple[int, int]]:
    """The coordinates of ``part`` as ranges of one copy (two when it wraps around)."""
    start, end = part
    if end <= start or copy_elements <= 0:
        return []
    if end - start >= copy_elements:
        return [(0, copy_elements)]
    first, last = start % copy_elements, (end - 1) % copy_elements + 1
    return [(first, last)] if first < last else [(first, copy_elements), (0, last)]


class RejectReason(enum.StrEnum):
    """Why a chunk was rejected; :attr:`excludes_peer` says whether it is proof of a
    faulty peer (which is then excluded) or a benign race (late, duplicated)."""

    STALE_ROUND = "stale round"
    NOT_A_MEMBER = "not a member"
    FROM_MYSELF = "claims to come from this peer"
    PEER_EXCLUDED = "peer already excluded"
    PART_OUT_OF_RANGE = "part index out of range"
    NOT_MY_PART = "part not assigned to this peer"
    NOT_PART_REDUCER = "not the reducer of this part"
    PART_ABANDONED = "part abandoned"
    CHUNK_OUT_OF_RANGE = "chunk index out of range"
    DUPLICATE = "duplicate chunk"
    BAD_VALUES = "not a float32 tensor of the chunk's length"
    NON_FINITE = "non-finite values"
    BAD_WEIGHT = "weight not positive and finite"
    INCONSISTENT_WEIGHT = "weight differs from the sender's earlier chunks"
    BAD_CONTRIBUTORS = "contributors are not members or omit the reducer"
    INCONSISTENT_CONTRIBUTORS = "contributors neither match nor shrink the part's earlier ones"
    SUPERSEDED = "averaged over more members than the part's later chunks"  # reordered
    EXCLUDES_ME = "contributors exclude this peer"  # not the sender's fault: I withdraw

    @property
    def excludes_peer(self) -> bool:
        return self in _EXCLUDING


_EXCLUDING = frozenset(
    {
        RejectReason.PART_OUT_OF_RANGE,
        RejectReason.NOT_PART_REDUCER,
        RejectReason.CHUNK_OUT_OF_RANGE,
        RejectReason.BAD_VALUES,
        RejectReason.NON_FINITE,
        RejectReason.BAD_WEIGHT,
        RejectReason.INCONSISTENT_WEIGHT,
        RejectReason.BAD_CONTRIBUTORS,
        RejectReason.INCONSISTENT_CONTRIBUTORS,
    }
)


@dataclass(frozen=True, slots=True)
class Outgoing:
    """Send my values of ``[start, end)`` (chunk ``chunk_index`` of part ``part_index``)
    with my ``weight`` to ``to``, which reduces that part. ``values`` is a view of the
    local vector: encode it before the vector changes."""

    to: PeerID
    part_index: int
    chunk_index: int
    start: int
    end: int
    values: torch.Tensor
    weight: float


@dataclass(frozen=True, slots=True)
class OutgoingAveraged:
    """Send the final averaged ``[start, end)`` of a part I reduced, and the set of
    members it averages over, to ``to``."""

    to: PeerID
    part_index: int
    chunk_index: int
    start: int
    end: int
    values: torch.Tensor
    contributors: frozenset[PeerID]


@dataclass(frozen=True, slots=True)
class PartReady:
    """A part I reduce is final: publish what of it is not out yet
    (:meth:`ButterflyRound.publishable_chunks`)."""

    part_index: int


@dataclass(frozen=True, slots=True)
class ChunksAveraged:
    """Chunks of a part I reduce hold the mean over every live member before the rest of
    the part is in: publish them now (:meth:`ButterflyRound.publishable_chunks`), so that
    averages flow back while contributions still arrive. If a member is excluded before
    the part is final, they are averaged again without it and published again."""

    part_index: int
    chunk_indices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RejectedChunk:
    """A chunk from ``peer`` was dropped; a :class:`PeerExcluded` follows when
    ``reason.excludes_peer``."""

    peer: PeerID
    part_index: int
    chunk_index: int
    reason: RejectReason


@dataclass(frozen=True, slots=True)
class ChunkDeferred:
    """A chunk of a part not (yet) mine, held in case its reducer's failure reaches us
    later and the part is reassigned to us (the sender learned of it first)."""

    sender: PeerID
    part_index: int
    chunk_index: int


@dataclass(frozen=True, slots=True)
class PeerExcluded:
    """``peer`` is out of the round from now on: stop reading from it, and tell every
    other live member (they take it with ``on_exclusion_notice``). Every member tells of
    each exclusion once, whether it saw the failure or learned of it, so the knowledge
    floods even when its first witness dies, and survivors converge on one failure set,
    hence one reassignment plan."""

    peer: PeerID
    reason: str


@dataclass(frozen=True, slots=True)
class PartReassigned:
    """A failed reducer's part now goes to ``new_reducer``; send ``outgoing`` (empty
    when the new reducer is me)."""

    part_index: int
    old_reducer: PeerID
    new_reducer: PeerID
    outgoing: tuple[Outgoing, ...]


@dataclass(frozen=True, slots=True)
class PartAbandoned:
    """A part stays at my own value (no surviving member can reduce it, or the caller
    gave up on it)."""

    part_index: int
    reason: str


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """``excluded_by`` left me out of a part or announced my exclusion: the others count
    me as failed, so I keep my own vector and stop taking part (stop sending; every
    later message is ignored)."""

    excluded_by: PeerID


RoundEvent = (
    PartReady
    | ChunksAveraged
    | RejectedChunk
    | ChunkDeferred
    | PeerExcluded
    | PartReassigned
    | PartAbandoned
    | Withdrawn
)


@dataclass(frozen=True, slots=True)
class AveragedPart:
    """A final part I reduced: the weighted mean over ``contributors`` (me included)."""

    part_index: int
    start: int
    end: int
    values: torch.Tensor
    contributors: frozenset[PeerID]


@dataclass(frozen=True, slots=True)
class PartReport:
    """How one part ended on this peer."""

    part_index: int
    start: int
    end: int
    reducer: PeerID | None
    """Who reduced the values this peer holds; None when they are its own (abandoned)."""
    contributors: frozenset[PeerID]
    """Whose vectors the part averages (empty when abandoned or empty)."""
    averaged: bool
    """False when the part was left at this peer's own value."""


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What happened in a round, from one peer's point of view."""

    round_id: bytes
    me: PeerID
    members: tuple[PeerID, ...]
    failed: Mapping[PeerID, str]
    """Members excluded in this peer's view, with the reason."""
    excluded_by: frozenset[PeerID]
    """Members that left this peer out. Non-empty means it withdrew: the others count it
    as failed, and its result is its own vector (every part ``averaged=False``)."""
    parts: tuple[PartReport, ...]
    fraction_averaged: float
    """Fraction of coordinates averaged (1.0 when no part was left at the own value)."""


@dataclass(frozen=True, slots=True)
class RoundResult:
    """The flat vector after the round, and how each part of it came to be."""

    averaged: torch.Tensor
    report: RoundReport

    def fingerprint(self) -> bytes:
        """A digest of the averaged parts (values, reducer, contributors): survivors of a
        round hold identical tensors exactly when their fingerprints match, so peers can
        compare 32 bytes instead of tensors. Parts left at a peer's own value are left
        out (they differ between peers by design).

        Values enter as a 128-bit XXH3 per part, several times cheaper than CRC-32 plus
        a word sum and than sha256 over the values (docs/benchmarks.md, "Figures behind constants").
        Fingerprints detect honest divergence (different failure sets, lost chunks);
        they are not a defence against a peer that lies about what it holds, which it
        could anyway."""
        digest = hashlib.sha256(self.report.round_id)
        values = self.averaged.detach().cpu().contiguous().numpy()
        for part in self.report.parts:
            if not part.averaged or part.end == part.start or part.reducer is None:
                continue
            digest.update(part.part_index.to_bytes(8, "big") + part.reducer.to_bytes())
            for member in sorted(part.contributors):
                digest.update(member.to_bytes())
            check = xxhash.xxh3_128_digest(values[part.start : part.end].view(np.uint8).data)
            digest.update(check + (part.end - part.start).to_bytes(8, "big"))
        return digest.digest()


@dataclass(frozen=True, slots=True)
class RoundStatistics:
    """Counters of one round (CONTRIBUTING.md, "Objects worth debugging have statistics()")."""

    num_chunks_accepted: int
    num_chunks_deferred: int
    num_chunks_rejected: int
    num_averaged_chunks_accepted: int
    num_chunks_published_early: int
    """Averaged chunks of parts I reduce sent before the part was final."""
    num_chunks_republished: int
    """Averaged chunks sent again over fewer members (one was excluded mid-part)."""
    num_parts_reassigned: int
    num_parts_abandoned: int
    num_peers_excluded: int


def is_positive_finite(value: object, limit: float) -> bool:
    """True for an int or float in ``(0, limit]`` (never for a bool or NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and 0 < value <= limit


@dataclass(frozen=True, slots=True)
class PartDigest:
    """What a voter holds for one part (the agreement of ``averaging.allreduce.agreement``): who
    reduced it, over whom, and a 128-bit XXH3 of its float32 values. A part the voter
    left at its own value is named as reduced by the voter over itself alone, so that a
    digest covers every coordinate: peers holding the same digests hold the same tensor
    bit for bit."""

    part_index: int
    reducer: bytes
    contributors: list[bytes]
    values: bytes


def part_digests(result: RoundResult) -> tuple[PartDigest, ...]:
    """The digest of every part of ``result``, in part order (one XXH3 pass over it)."""
    values = result.averaged.detach().cpu().contiguous().numpy()
    me = result.report.me
    digests = []
    for part in result.report.parts:
        if part.reducer is None or not part.averaged:
            reducer, contributors = me, [me.to_bytes()]
        else:
            reducer = part.reducer
            contributors = sorted(m.to_bytes() for m in part.contributors)
        check = xxhash.xxh3_128_digest(values[part.start : part.end].view(np.uint8).data)
        digests.append(PartDigest(part.part_index, reducer.to_bytes(), contributors, check))
    return tuple(digests)


def values_digest(values: torch.Tensor) -> bytes:
    """The XXH3-128 of a flat float32 tensor's bytes, as :class:`PartDigest` holds it."""
    array = values.detach().cpu().contiguous().numpy()
    return xxhash.xxh3_128_digest(array.view(np.uint8).data)


def fingerprint_of(round_id: bytes, digests: Sequence[PartDigest]) -> bytes:
    """One 32-byte name for a whole result: what members vote for."""
    digest = hashlib.sha256(round_id)
    for part in digests:
        digest.update(part.part_index.to_bytes(8, "big") + part.values)
        digest.update(len(part.reducer).to_bytes(2, "big") + part.reducer)
        for member in part.contributors:
            digest.update(len(member).to_bytes(2, "big") + member)
        digest.update(b"|")
    return digest.digest()
