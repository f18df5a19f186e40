"""One butterfly all-reduce round from one peer's point of view: a pure state machine
(CONTRIBUTING.md, "Protocols are pure state machines"). Messages and failures go in,
events come out; no sockets, no clocks. The wire layer moves the chunks and turns its
deadlines into ``on_*_failed`` calls.

Member ``i`` reduces part ``i`` of the flat vector (sized by bandwidth,
:func:`~averaging.allreduce.partition.split_parts`) from every member's chunks as they stream in,
and sends each chunk's average back as soon as every live member's copy of it is in
(docs/design/averaging.md, "Parts sized by bandwidth" and "Reduction overlaps
transfer"). The fault rules (the same page, "Faults"):

1. A peer that dies, stalls (the caller's deadline) or sends garbage is *excluded*: one
   failure set per round, for both roles. Its chunks are dropped from every part I have
   not finalised yet (exactly: :class:`~averaging.allreduce.reduction.PartReduction`), and I stop
   waiting for it. Garbage is whatever :class:`RejectReason` marks ``excludes_peer``.
2. A part is final once every non-excluded member's whole contribution is in; its
   contributors are then fixed. A chunk published before (:class:`ChunksAveraged`) is
   averaged over every member not excluded at the time; if one is excluded before the
   part is final, such chunks are averaged again without it and published again with
   the smaller set, which replaces them at the receivers. Within a part the set may
   only shrink, and a part is received once all its chunks carry the same set.
3. A failed reducer's part, whatever of it arrived, is discarded and re-reduced by
   :func:`plan_reassignment`'s choice, a pure function of the failure set; senders send
   it their chunks again. If no member can reduce it, it stays at my own value.
4. A published part must list every member I have not excluded. Members it leaves out
   I exclude too: the reducer saw them fail before I did, the common race when a peer
   crashes. Every exclusion is also told to the other members
   (:meth:`ButterflyRound.on_exclusion_notice`), once by each member, which reaches
   peers that would never learn otherwise (e.g. ones already holding every part) even
   when the first witness dies: survivors converge on one failure set.
5. A part or notice that leaves *me* out means the others count me as failed: I
   *withdraw* (:class:`Withdrawn`), keep my own vector and stop taking part, rather than
   exclude its sender; excluding it would drag an honest peer out after me and split
   the group in two.

Hence survivors that end with the same failure set hold bitwise-identical averaged
parts (one reducer computes each, everyone copies it), each averaged over a set that
contains every survivor; :meth:`RoundResult.fingerprint` lets them check it cheaply.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import fields
from types import MappingProxyType

import torch

from averaging.allreduce.buffers import empty_float32
from averaging.allreduce.partition import chunk_ranges
from averaging.allreduce.records import (
    AveragedPart,
    ChunkDeferred,
    ChunksAveraged,
    Outgoing,
    OutgoingAveraged,
    PartAbandoned,
    PartReady,
    PartReassigned,
    PartReport,
    PeerExcluded,
    RejectedChunk,
    RejectReason,
    RoundError,
    RoundEvent,
    RoundReport,
    RoundResult,
    RoundSpec,
    RoundStatistics,
    Withdrawn,
    is_positive_finite,
    plan_reassignment,
)
from averaging.allreduce.reduction import PartReceipt, PartReduction
from averaging.allreduce.robust import CenteredClipReduction
from averaging.compression.base import all_finite
from peers.identity import PeerID

#: Largest weight (sample count) a sender may claim. A float32 sum that overflows is
#: recomputed in float64 (``PartReduction.finalize``), where 2**64 * (float32 max ~
#: 2**128) * any group size stays far below float64's 2**1024, so no weighted mean is
#: lost to overflow; no batch has 2**64 samples.
MAX_SAMPLE_WEIGHT = 2.0**64

#: Failed parts whose chunks I hold (as a reducer that may inherit them) before I learn
#: of the failure myself. Honest senders send a dead reducer's part to its heir as soon
#: as *they* see the death, so the heir holds up to (members - 1) copies of that part;
#: room for two such parts covers two reducers dying at once, and bounds what peers can
#: make me hold to 2 * (members - 1) * (largest part). Past it, a chunk is rejected (not
#: the sender's fault).
DEFERRED_PARTS = 2


class ButterflyRound:
    """The state of one all-reduce round at one peer; see the module docstring for the
    fault rules. Every method returns at once; not thread-safe."""

    def __init__(self, spec: RoundSpec, local: torch.Tensor, local_weight: float) -> None:
        """``local`` is my flat float32 vector (kept by reference, not copied: leave it
        unchanged until :meth:`result`); ``local_weight`` my sample count, > 0.

        Raises :class:`RoundError` if they do not fit ``spec`` or ``local`` is not finite.
        """
        if not isinstance(local, torch.Tensor) or local.dtype != torch.float32:
            raise RoundError("local must be a float32 tensor")
        if local.shape != (spec.total_elements,):
            raise RoundError(f"local must have shape ({spec.total_elements},)")
        if not is_positive_finite(local_weight, MAX_SAMPLE_WEIGHT):
            raise RoundError(f"local_weight must be in (0, {MAX_SAMPLE_WEIGHT:g}]")
        if not all_finite(local):
            raise RoundError("local holds NaN or infinity")
        self.spec = spec
        self._me = spec.me
        self._members = spec.members
        self._local = local.detach()
        # The result, filled as parts arrive (a pooled buffer: see averaging.allreduce.buffers).
        self._averaged = empty_float32(self._local.numel(), self._local.device)
        self._handed_out = False  # a RoundResult holds self._averaged: copy before writing
        self._weight = float(local_weight)
        self._parts = spec.parts()
        self._chunks = [chunk_ranges(s, e, spec.chunk_elements) for s, e in self._parts]
        self._can_reduce = spec.weights[spec.members.index(spec.me)] > 0
        self._failed: dict[PeerID, str] = {}
        self._excluded_by: set[PeerID] = set()
        self._assignee: list[PeerID] = [spec.members[o] for o in spec.owners]
        self._reductions: dict[int, PartReduction | CenteredClipReduction] = {}
        self._finals: dict[int, AveragedPart] = {}
        # Parts I reduce: chunk -> the contributors it was last published with.
        self._chunk_sets: dict[int, dict[int, frozenset[PeerID]]] = {}
        self._published: dict[int, torch.Tensor] = {}
        self._receipts: dict[int, PartReceipt] = {}
        self._abandoned: dict[int, str] = {}
        self._weights: dict[PeerID, float] = {spec.me: self._weight}
        self._deferred: dict[tuple[int, PeerID, int], torch.Tensor] = {}
        self._num_deferred_elements = 0
        shares = [0] * len(spec.members)  # a member's parts together (several cells)
        for owner, (start, end) in zip(spec.owners, self._parts, strict=True):
            shares[owner] += end - start
        self._deferred_limit = DEFERRED_PARTS * (len(spec.members) - 1) * max(shares)
        self._counts = {f.name: 0 for f in fields(RoundStatistics)}
        for i, reducer in enumerate(self._assignee):
            if self._chunks[i] and reducer == spec.me:
                self._start_reduction(i)
            elif self._chunks[i]:
                self._receipts[i] = PartReceipt(reducer, len(self._chunks[i]))

    # --- as a sender ------------------------------------------------------------------

    def outgoing_chunks(self) -> Iterator[Outgoing]:
        """My chunks of every part that a live member other than me reduces."""
        for i, receipt in list(self._receipts.items()):
            if not self._excluded_by:
                yield from self._outgoing_to(i, receipt.reducer)

    def _outgoing_to(self, part: int, to: PeerID) -> Iterator[Outgoing]:
        for c, (s, e) in enumerate(self._chunks[part]):
            yield Outgoing(to, part, c, s, e, self._local[s:e], self._weight)

    # --- as a reducer -----------------------------------------------------------------

    def on_chunk(
        self,
        sender: PeerID,
        round_id: bytes,
        part_index: int,
        chunk_index: int,
        values: torch.Tensor,
        weight: float,
    ) -> list[RoundEvent]:
        """A sender's chunk of a part I reduce (or may soon: :class:`ChunkDeferred`).

        Accumulates it if valid; otherwise returns :class:`RejectedChunk` and, for proof
        of a faulty sender, :class:`PeerExcluded` and its consequences (rule 1, 3).
        :class:`PartReady` when a part becomes final. Ignored (``[]``) once withdrawn.
        """
        if self._excluded_by:
            return []
        reason = self._check_origin(sender, round_id, part_index)
        reason = reason or self._check_values(part_index, chunk_index, values)
        if reason is None and not is_positive_finite(weight, MAX_SAMPLE_WEIGHT):
            reason = RejectReason.BAD_WEIGHT
        if reason is None and self._weights.get(sender, weight) != weight:
            reason = RejectReason.INCONSISTENT_WEIGHT
        if reason is None and not all_finite(values):
            reason = RejectReason.NON_FINITE
        reduction = self._reductions.get(part_index)
        key = (part_index, sender, chunk_index)
        if reason is None and (
            part_index in self._finals
            or (reduction is not None and reduction.has(sender, chunk_index))
            or key in self._deferred
        ):
            reason = RejectReason.DUPLICATE
        room = self._deferred_limit - self._num_deferred_elements
        if reason is None and reduction is None:
            if part_index in self._abandoned or not self._can_reduce or values.numel() > room:
                reason = RejectReason.NOT_MY_PART
        if reason is not None:
            return self._reject(sender, part_index, chunk_index, reason)
        values = values.to(self._local.device)
        self._weights[sender] = float(weight)
        if reduction is None:
            self._deferred[key] = values
            self._num_deferred_elements += values.numel()
            self._counts["num_chunks_deferred"] += 1
            return [ChunkDeferred(sender, part_index, chunk_index)]
        reduction.add(sender, chunk_index, values, float(weight))
        self._counts["num_chunks_accepted"] += 1
        return self._try_finalize(part_index, (chunk_index,))

    def my_part_ready(self) -> bool:
        """True when my own parts are final (or empty: a client-mode member reduces
        nothing)."""
        me = self._members.index(self._me)
        return all(
            i in self._finals or not self._chunks[i]
            for i, owner in enumerate(self.spec.owners)
            if owner == me
        )

    def ready_parts(self) -> frozenset[int]:
        """Indices of the parts I reduce (mine and inherited ones) that are final."""
        return frozenset(self._finals)

    def reduced_part(self, part_index: int | None = None) -> AveragedPart:
        """A final part I reduced (default: my own first). Raises :class:`RoundError`
        if I do not reduce it or it is not final yet."""
        index = (
            self.spec.owners.index(self._members.index(self._me))
            if part_index is None
            else part_index
        )
        if index not in self._finals:
            raise RoundError(f"part {index} is not a final part of mine")
        return self._finals[index]

    def publishable_chunks(self, part_index: int) -> list[OutgoingAveraged]:
        """The averaged chunks of a part I reduce not yet published over the members
        they average now, for every live member but me, marked published: call on
        :class:`ChunksAveraged` and :class:`PartReady`. A chunk published early and
        averaged again after an exclusion comes out again, with fewer contributors.
        Empty once withdrawn."""
        reduction = self._reductions.get(part_index)
        if reduction is None or self._excluded_by:
            return []
        final = self._finals.get(part_index)
        if final is not None:
            contributors, values = final.contributors, final.values
        elif isinstance(reduction, PartReduction):
            live = frozenset(m for m in self._members if m not in self._failed)
            contributors, values = live, reduction.values
        else:
            return []
        sent = self._chunk_sets.setdefault(part_index, {})
        start = self._parts[part_index][0]
        out = []
        for c, (s, e) in enumerate(self._chunks[part_index]):
            if sent.get(c) == contributors:
                continue
            if final is None and not (
                isinstance(reduction, PartReduction) and reduction.averaged(c)
            ):
                continue
            if c in sent:
                self._counts["num_chunks_republished"] += 1
            elif final is None:
                self._counts["num_chunks_published_early"] += 1
            sent[c] = contributors
            chunk = values[s - start : e - start]
            out += [
                OutgoingAveraged(to, part_index, c, s, e, chunk, contributors)
                for to in self._members
                if to != self._me and to not in self._failed
            ]
        return out

    def published_chunks(self, part_index: int) -> Iterator[OutgoingAveraged]:
        """The averaged chunks of a final part of mine, for every live member but me
        (none once withdrawn). Raises :class:`RoundError` as :meth:`reduced_part`."""
        part = self.reduced_part(part_index)
        for to in self._members:
            if to == self._me or to in self._failed or self._excluded_by:
                continue
            for c, (s, e) in enumerate(self._chunks[part_index]):
                values = part.values[s - part.start : e - part.start]
                yield OutgoingAveraged(to, part_index, c, s, e, values, part.contributors)

    def set_published_chunk(self, part_index: int, chunk_index: int, values: torch.Tensor) -> None:
        """Hold ``values`` for one chunk of a part I reduce instead of its exact mean:
        when averaged chunks travel through a lossy codec, pass what receivers decode,
        each time a chunk is published, so that I hold the same tensor they do. Raises
        :class:`RoundError` for a chunk not of mine, a wrong shape or dtype, or values
        that are not finite."""
        if part_index not in self._reductions or not 0 <= chunk_index < len(
            self._chunks[part_index]
        ):
            raise RoundError(f"part {part_index} chunk {chunk_index} is not a chunk of mine")
        start = self._parts[part_index][0]
        s, e = self._chunks[part_index][chunk_index]
        if values.dtype != torch.float32 or values.shape != (e - s,):
            raise RoundError("published values must match the chunk's float32 shape")
        if not all_finite(values):
            raise RoundError("published values hold NaN or infinity")
        held = self._published.get(part_index)
        if held is None:
            held = self._published[part_index] = empty_float32(
                self._parts[part_index][1] - start, self._local.device
            )
        held[s - start : e - start].copy_(values)

    def held_part(self, part_index: int) -> tuple[PeerID, frozenset[PeerID], torch.Tensor] | None:
        """``(reducer, contributors, values)`` of a part I hold in full (one I finalised,
        or one received whole from its reducer), as :meth:`result` would report it;
        None for a part still missing, abandoned, or once withdrawn. The values are a
        view: read them before the next call into the round."""
        if self._excluded_by or part_index in self._abandoned:
            return None
        start, end = self._parts[part_index]
        if part_index in self._finals:
            final = self._finals[part_index]
            return self._me, final.contributors, self._published.get(part_index, final.values)
        receipt = self._receipts.get(part_index)
        if receipt is not None and receipt.complete:
            contributors = receipt.contributors or frozenset()
            return receipt.reducer, contributors, self._averaged[start:end]
        if end == start:
            return self._assignee[part_index], frozenset(), self._local[start:end]
        return None

    # --- as a receiver of averaged parts ----------------------------------------------

    def on_averaged_chunk(
        self,
        reducer: PeerID,
        round_id: bytes,
        part_index: int,
        chunk_index: int,
        values: torch.Tensor,
        contributors: frozenset[PeerID],
    ) -> list[RoundEvent]:
        """An averaged chunk of a part another member reduces. Validated like
        :meth:`on_chunk`, plus: the sender must be the part's current reducer, and the
        contributors must be members, include the reducer and agree across the part's
        chunks. Members they leave out are excluded here too (rule 4); leaving me out
        withdraws me (rule 5)."""
        if self._excluded_by:
            return []
        reason = self._check_origin(reducer, round_id, part_index)
        members_only = isinstance(contributors, frozenset) and contributors <= set(self._members)
        if reason is None and members_only and self._me not in contributors:
            # Whatever else is wrong with the chunk, its sender counts me out (rule 5),
            # e.g. it publishes my own part as its heir: do not exclude it in return.
            rejected = self._reject(reducer, part_index, chunk_index, RejectReason.EXCLUDES_ME)
            return rejected + self._withdraw(reducer)
        if reason is None and part_index in self._abandoned:
            reason = RejectReason.PART_ABANDONED
        elif reason is None and self._assignee[part_index] != reducer:
            reason = RejectReason.NOT_PART_REDUCER
        reason = reason or self._check_values(part_index, chunk_index, values)
        receipt = self._receipts.get(part_index)
        if reason is None and receipt is not None:  # always one past the checks above
            reason = self._check_contributors(reducer, contributors, receipt)
            if reason is None and not all_finite(values):
                reason = RejectReason.NON_FINITE
            if reason is None and chunk_index in receipt.chunks:
                if contributors == receipt.contributors:
                    reason = RejectReason.DUPLICATE
        if reason is not None or receipt is None:
            return self._reject(reducer, part_index, chunk_index, reason or RejectReason.DUPLICATE)
        events: list[RoundEvent] = []
        for member in self._members:
            if member not in contributors and member not in self._failed:
                events += self._exclude(member, f"excluded by reducer {reducer}")
        if receipt.contributors != contributors:
            # Fewer contributors than the chunks before (the reducer dropped a member
            # and averages the part again): those chunks are replaced as they come.
            receipt.chunks.clear()
        receipt.contributors = contributors
        receipt.chunks.add(chunk_index)
        # Into the result now, while the values are hot in cache (they were just
        # decoded); result() then copies nothing for received parts.
        start, end = self._chunks[part_index][chunk_index]
        self._result_buffer()[start:end].copy_(values)
        self._counts["num_averaged_chunks_accepted"] += 1
        return events

    # --- failures ---------------------------------------------------------------------

    def on_sender_failed(self, sender: PeerID, reason: str = "sender failed") -> list[RoundEvent]:
        """``sender`` died, stalled or sent garbage: exclude it (rules 1 and 3). Raises
        :class:`RoundError` for a non-member or myself."""
        return self._exclude_checked(sender, reason)

    def on_reducer_failed(
        self, reducer: PeerID, reason: str = "reducer failed"
    ) -> list[RoundEvent]:
        """``reducer`` died or stalled: exclude it and reassign its parts (rules 1 and 3).
        Raises :class:`RoundError` for a non-member or myself."""
        return self._exclude_checked(reducer, reason)

    def on_exclusion_notice(
        self, reporter: PeerID, round_id: bytes, excluded: frozenset[PeerID]
    ) -> list[RoundEvent]:
        """A member tells whom it excluded (its :class:`PeerExcluded` events): I exclude
        them too (rule 4); a notice naming me withdraws me (rule 5). Ignored from a
        stale round, a non-member or a member I excluded."""
        if round_id != self.spec.round_id or reporter not in self._members:
            return []
        if self._excluded_by or reporter == self._me or reporter in self._failed:
            return []
        if not isinstance(excluded, frozenset) or not excluded <= set(self._members):
            return self._exclude(reporter, str(RejectReason.BAD_CONTRIBUTORS))
        if self._me in excluded:
            return self._withdraw(reporter)
        events: list[RoundEvent] = []
        for member in self._members:
            if member in excluded and member != reporter and member not in self._failed:
                events += self._exclude(member, f"reported by {reporter}")
        return events

    def on_accusation(self, accused: PeerID, accuser: PeerID) -> list[RoundEvent]:
        """An accusation that counts (:mod:`averaging.allreduce.accusations`: signed by
        ``accuser``, and its first or a corroborated one): exclude ``accused`` (rule 4),
        or withdraw if it names me (rule 5). Raises :class:`RoundError` for a
        non-member."""
        if accused not in self._members or accuser not in self._members:
            raise RoundError(f"{accused} or {accuser} is not a member of this round")
        if self._excluded_by or accused in self._failed:
            return []
        if accused == self._me:
            return self._withdraw(accuser)
        return self._exclude(accused, f"accused by {accuser}")

    def reducer_of(self, part_index: int) -> PeerID:
        """Who reduces part ``part_index`` now, in my view (its heir once reassigned)."""
        return self._assignee[part_index]

    def reassign_part(self, part_index: int, new_reducer: PeerID) -> list[RoundEvent]:
        """Move a failed reducer's part to ``new_reducer``: discard what arrived of it,
        and either send it my chunks or, if it is me, start reducing it. The failure
        handlers call this with :func:`plan_reassignment`'s choice; call it directly only
        to apply that same plan. Raises :class:`RoundError` if the part is empty or its
        reducer alive, or ``new_reducer`` is failed, client-mode or not a member."""
        if not 0 <= part_index < len(self._parts) or not self._chunks[part_index]:
            raise RoundError(f"part {part_index} does not exist or is empty")
        old = self._assignee[part_index]
        if old not in self._failed or part_index in self._abandoned or self._excluded_by:
            raise RoundError(f"part {part_index}'s reducer {old} has not failed")
        if new_reducer not in self._members or new_reducer in self._failed:
            raise RoundError(f"{new_reducer} is not a live member")
        if self.spec.weights[self._members.index(new_reducer)] <= 0:
            raise RoundError(f"{new_reducer} is client-mode and cannot reduce")
        self._assignee[part_index] = new_reducer
        self._receipts.pop(part_index, None)
        self._counts["num_parts_reassigned"] += 1
        if new_reducer == self._me:
            moved = PartReassigned(part_index, old, new_reducer, ())
            return [moved, *self._start_reduction(part_index)]
        self._receipts[part_index] = PartReceipt(new_reducer, len(self._chunks[part_index]))
        outgoing = tuple(self._outgoing_to(part_index, new_reducer))
        return [PartReassigned(part_index, old, new_reducer, outgoing)]

    def abandon_part(self, part_index: int, reason: str = "abandoned") -> list[RoundEvent]:
        """Give up on a part another member reduces (at the round's final deadline): it
        stays at my own value. Raises :class:`RoundError` for a part I reduce (exclude
        its stalled senders instead) or one already averaged."""
        receipt = self._receipts.get(part_index)
        if part_index in self._reductions or (receipt is not None and receipt.complete):
            raise RoundError(f"part {part_index} is mine or already averaged")
        if receipt is None:
            return []
        return self._abandon(part_index, reason)

    def give_up(self, reason: str = "still missing at the round deadline") -> list[RoundEvent]:
        """The round's final deadline: exclude the senders my parts still lack and leave
        the parts others reduce that have not fully arrived at my own value, until every
        part is resolved. One pass is not enough: excluding a sender that was also a
        reducer can hand me its part, whose other senders never sent me their chunks of
        it. Afterwards :meth:`is_done` holds; it never raises."""
        events: list[RoundEvent] = []
        for _ in range(len(self._members) + 1):  # each pass excludes someone, or ends
            if self.is_done():
                break
            for member in sorted(self.missing_senders()):
                events += self.on_sender_failed(member, reason)
            for part_index in sorted(self.undelivered_parts()):
                events += self.abandon_part(part_index, reason)
        return events

    # --- the outcome ------------------------------------------------------------------

    def is_done(self) -> bool:
        """True when every part is resolved (final, received in full or abandoned), or I
        withdrew."""
        receipts_done = all(r.complete for r in self._receipts.values())
        finals_done = len(self._finals) == len(self._reductions)
        return bool(self._excluded_by) or (receipts_done and finals_done)

    def waiting_for(self) -> frozenset[PeerID]:
        """Live members whose chunks or averaged parts I still need."""
        return self.missing_senders() | self.missing_reducers()

    def missing_senders(self) -> frozenset[PeerID]:
        """Live members whose chunks a part I reduce still lacks: at the reducer's
        deadline (restarted when I inherit a part), report them with
        :meth:`on_sender_failed`."""
        if self._excluded_by:
            return frozenset()
        live = [m for m in self._members if m not in self._failed]
        pending = [r for i, r in self._reductions.items() if i not in self._finals]
        return frozenset(m for r in pending for m in live if not r.complete(m))

    def sender_progress(self, sender: PeerID) -> tuple[int, int]:
        """Chunks of ``sender``'s contribution that the parts I still reduce hold, and
        how many they need: with the time they took, how fast it sends."""
        pending = [r for i, r in self._reductions.items() if i not in self._finals]
        return sum(r.received(sender) for r in pending), sum(len(r.ranges) for r in pending)

    def missing_reducers(self) -> frozenset[PeerID]:
        """Reducers whose averaged parts have not fully arrived: at the receiver's
        deadline (longer than the reducers', which wait for the slowest sender, and
        restarted when a part moves), report them with :meth:`on_reducer_failed`."""
        if self._excluded_by:
            return frozenset()
        return frozenset(r.reducer for r in self._receipts.values() if not r.complete)

    def undelivered_parts(self) -> frozenset[int]:
        """Parts other members reduce whose averaged values have not fully arrived: what
        :meth:`abandon_part` gives up at the round's final deadline."""
        if self._excluded_by:
            return frozenset()
        return frozenset(i for i, r in self._receipts.items() if not r.complete)

    @property
    def failed(self) -> Mapping[PeerID, str]:
        """Members excluded so far, with the reason (read-only)."""
        return MappingProxyType(self._failed)

    @property
    def excluded_by(self) -> frozenset[PeerID]:
        """Members that left me out; non-empty once I withdrew (rule 5)."""
        return frozenset(self._excluded_by)

    def result(self) -> RoundResult:
        """The averaged flat vector (never my local vector itself) and the report; my own
        values if I withdrew. A result handed out is never changed afterwards. Raises
        :class:`RoundError` unless :meth:`is_done`."""
        if not self.is_done():
            raise RoundError("the round is not done: some parts are unresolved")
        # Every coordinate is written once: received parts as they arrived, my own
        # averaged parts from where they are held, the rest from my own vector.
        averaged = self._result_buffer()
        self._handed_out = True
        reports: list[PartReport] = []
        for i, (start, end) in enumerate(self._parts):
            reducer: PeerID | None = None if self._excluded_by else self._assignee[i]
            contributors: frozenset[PeerID] = frozenset()
            receipt = self._receipts.get(i)
            if reducer is None or i in self._abandoned:
                reducer = None
                averaged[start:end] = self._local[start:end]
            elif i in self._finals:
                contributors = self._finals[i].contributors
                averaged[start:end] = self._published.get(i, self._finals[i].values)
            elif receipt is not None:  # written as its chunks arrived
                contributors = receipt.contributors or frozenset()
            else:
                averaged[start:end] = self._local[start:end]
            reports.append(PartReport(i, start, end, reducer, contributors, reducer is not None))
        total = self.spec.total_elements
        num_averaged = sum(p.end - p.start for p in reports if p.averaged)
        report = RoundReport(
            round_id=self.spec.round_id,
            me=self._me,
            members=self._members,
            failed=MappingProxyType(dict(self._failed)),
            excluded_by=frozenset(self._excluded_by),
            parts=tuple(reports),
            fraction_averaged=num_averaged / total if total else float(not self._excluded_by),
        )
        return RoundResult(averaged, report)

    def _result_buffer(self) -> torch.Tensor:
        """The result being filled; a copy of it once a result was handed out (a round
        reopened by a late exclusion must not change what a caller already holds)."""
        if self._handed_out:
            self._averaged = empty_float32(self._local.numel(), self._local.device).copy_(
                self._averaged
            )
            self._handed_out = False
        return self._averaged

    def statistics(self) -> RoundStatistics:
        return RoundStatistics(**self._counts)

    # --- internals --------------------------------------------------------------------

    def _check_origin(self, peer: PeerID, round_id: bytes, part: int) -> RejectReason | None:
        if round_id != self.spec.round_id:
            return RejectReason.STALE_ROUND
        if peer not in self._members:
            return RejectReason.NOT_A_MEMBER
        if peer == self._me:
            return RejectReason.FROM_MYSELF
        if peer in self._failed:
            return RejectReason.PEER_EXCLUDED
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < len(self._parts):
            return RejectReason.PART_OUT_OF_RANGE
        return None

    def _check_values(self, part: int, chunk: int, values: object) -> RejectReason | None:
        ranges = self._chunks[part]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 <= chunk < len(ranges):
            return RejectReason.CHUNK_OUT_OF_RANGE
        start, end = ranges[chunk]
        if not isinstance(values, torch.Tensor) or values.dtype != torch.float32:
            return RejectReason.BAD_VALUES
        return None if values.shape == (end - start,) else RejectReason.BAD_VALUES

    def _check_contributors(
        self, reducer: PeerID, contributors: object, receipt: PartReceipt
    ) -> RejectReason | None:
        if not isinstance(contributors, frozenset) or not contributors <= set(self._members):
            return RejectReason.BAD_CONTRIBUTORS
        if reducer not in contributors:
            return RejectReason.BAD_CONTRIBUTORS
        if receipt.contributors is None or contributors == receipt.contributors:
            return None
        if contributors > receipt.contributors:
            return RejectReason.SUPERSEDED  # sent before the reducer dropped a member
        if contributors < receipt.contributors and not receipt.complete:
            return None  # averaged again without a member: replaces what came before
        # A whole part came with its final contributors: an honest reducer never
        # changes them after (it excludes nobody from a final part).
        return RejectReason.INCONSISTENT_CONTRIBUTORS

    def _reject(
        self, peer: PeerID, part: int, chunk: int, reason: RejectReason
    ) -> list[RoundEvent]:
        self._counts["num_chunks_rejected"] += 1
        events: list[RoundEvent] = [RejectedChunk(peer, part, chunk, reason)]
        if reason.excludes_peer:  # only ever for a member other than me (_check_origin)
            events += self._exclude(peer, str(reason))
        return events

    def _withdraw(self, by: PeerID) -> list[RoundEvent]:
        self._excluded_by.add(by)
        self._deferred.clear()
        self._num_deferred_elements = 0
        return [Withdrawn(by)]

    def _exclude_checked(self, peer: PeerID, reason: str) -> list[RoundEvent]:
        if peer not in self._members or peer == self._me:
            raise RoundError(f"{peer} is not another member of this round")
        return [] if self._excluded_by else self._exclude(peer, reason)

    def _exclude(self, peer: PeerID, reason: str) -> list[RoundEvent]:
        if peer in self._failed:
            return []
        self._failed[peer] = reason
        self._counts["num_peers_excluded"] += 1
        events: list[RoundEvent] = [PeerExcluded(peer, reason)]
        for key in [k for k in self._deferred if k[1] == peer]:
            self._num_deferred_elements -= self._deferred.pop(key).numel()
        for i, reduction in list(self._reductions.items()):
            if i not in self._finals:
                reduction.drop(peer, self._members, self._weights)
                # What I published of it counted the dropped peer: every such chunk is
                # published again (and held again as decoded) or, if no one is left to
                # send it to, held exact.
                self._published.pop(i, None)
                events += self._try_finalize(i)
        plan = plan_reassignment(self.spec, self._failed.keys())
        for i, reducer in enumerate(self._assignee):
            if reducer not in self._failed or i in self._abandoned or not self._chunks[i]:
                continue
            if i in plan:
                events += self.reassign_part(i, plan[i])
            else:
                events += self._abandon(i, "no surviving member can reduce it")
        return events

    def _abandon(self, part: int, reason: str) -> list[RoundEvent]:
        self._abandoned[part] = reason
        self._receipts.pop(part, None)
        for key in [k for k in self._deferred if k[0] == part]:
            self._num_deferred_elements -= self._deferred.pop(key).numel()
        self._counts["num_parts_abandoned"] += 1
        return [PartAbandoned(part, reason)]

    def _start_reduction(self, part: int) -> list[RoundEvent]:
        config = self.spec.aggregation
        reduction: PartReduction | CenteredClipReduction
        ratio = self.spec.max_weight_ratio
        if config is None:
            reduction = PartReduction(
                self._chunks[part], self._local.device, max_weight_ratio=ratio
            )
        else:
            start, end = self._parts[part]
            tau = config.part_tau(end - start, self.spec.total_elements)
            reduction = CenteredClipReduction(
                self._chunks[part],
                self._local.device,
                config=config,
                tau=tau,
                max_weight_ratio=ratio,
            )
        self._reductions[part] = reduction
        for c, (s, e) in enumerate(reduction.ranges):
            reduction.add(self._me, c, self._local[s:e], self._weight)
        for key in sorted(k for k in self._deferred if k[0] == part):
            values = self._deferred.pop(key)
            self._num_deferred_elements -= values.numel()
            reduction.add(key[1], key[2], values, self._weights[key[1]])
            self._counts["num_chunks_accepted"] += 1
        return self._try_finalize(part)

    def _try_finalize(self, part: int, chunks: Iterable[int] | None = None) -> list[RoundEvent]:
        """Average what is complete of ``part`` (``chunks``: the ones that may have
        changed; default every chunk): :class:`PartReady` once every live member's
        whole contribution is in, else :class:`ChunksAveraged` for chunks every live
        member has sent (mean reductions only: a robust one needs the whole part)."""
        reduction = self._reductions[part]
        live = frozenset(m for m in self._members if m not in self._failed)
        if part in self._finals:
            return []
        if all(reduction.complete(m) for m in live):
            start, end = self._parts[part]
            self._finals[part] = AveragedPart(part, start, end, reduction.finalize(), live)
            return [PartReady(part)]
        if not isinstance(reduction, PartReduction):
            return []
        averaged = []
        for chunk in range(len(reduction.ranges)) if chunks is None else chunks:
            if not reduction.averaged(chunk) and reduction.chunk_complete(chunk, live):
                reduction.average_chunk(chunk)
                averaged.append(chunk)
        return [ChunksAveraged(part, tuple(averaged))] if averaged else []
