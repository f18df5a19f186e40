"""The end of a round: members vote for the result they hold, and a strict majority of
the whole group decides (a pure tally: no sockets, no clocks; CONTRIBUTING.md,
"Protocols are pure state machines").

Each member votes once, for the fingerprint (``records.fingerprint_of``) of
the first complete result it holds, its own or one it copied from a voter. A
fingerprint voted by more than half of the round's members is *decided*: every member
that holds it reports agreement, and every other member that can reach one of its
voters copies it and then does too. Since no member votes twice, two fingerprints can
never both reach a majority, which gives the round's two safety properties:

- peers that report agreement hold bitwise identical tensors (P1);
- of two sides of a partition, at most one holds a majority, so at most one side
  reports agreement (P2).

The price: a group split in halves (two against two) agrees on nothing, where a
failure-set agreement would let each half agree with itself. A member counts as absent
until its vote arrives; a group whose votes are split so that no fingerprint can reach
a majority any more is *hopeless* and ends at once without agreement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from averaging.allreduce.partition import chunk_ranges
from averaging.allreduce.records import (
    PartDigest,
    PartReport,
    RoundError,
    RoundReport,
    RoundResult,
    RoundSpec,
    fingerprint_of,
    values_digest,
)
from peers.identity import KeyPair, PeerID

#: What a vote's signature covers besides its fingerprint: a vote signature can never
#: pass for a signature of anything else a peer signs (DHT records, handshakes).
VOTE_SIGNATURE_DOMAIN = b"swarmtrain/averaging/vote\0"


class Ballot:
    """The votes one member has seen in one round."""

    def __init__(self, members: Sequence[PeerID]) -> None:
        self.members = tuple(members)
        self._member_set = frozenset(self.members)
        self._votes: dict[PeerID, bytes] = {}
        self._counts: Counter[bytes] = Counter()

    @property
    def quorum(self) -> int:
        """Votes a fingerprint needs: more than half of every member, present or not."""
        return len(self.members) // 2 + 1

    def cast(self, voter: PeerID, fingerprint: bytes) -> bool:
        """Count ``voter``'s vote; False (and nothing counted) for a non-member or a
        member that already voted (a member votes once; a second, different vote from
        it is a fault of its own, never counted)."""
        if voter not in self._member_set or voter in self._votes:
            return False
        self._votes[voter] = fingerprint
        self._counts[fingerprint] += 1
        return True

    def vote_of(self, voter: PeerID) -> bytes | None:
        return self._votes.get(voter)

    def voters_for(self, fingerprint: bytes) -> frozenset[PeerID]:
        return frozenset(m for m, f in self._votes.items() if f == fingerprint)

    @property
    def num_votes(self) -> int:
        return len(self._votes)

    @property
    def decided(self) -> bytes | None:
        """The fingerprint a strict majority voted for, if any (at most one can be)."""
        for fingerprint, count in self._counts.items():
            if count >= self.quorum:
                return fingerprint
        return None

    def leading(self) -> bytes | None:
        """The fingerprint with most votes (ties: the smallest), None before any vote:
        what a member that has not voted yet copies, so that votes gather rather than
        split."""
        if not self._counts:
            return None
        return min(self._counts, key=lambda f: (-self._counts[f], f))

    @property
    def hopeless(self) -> bool:
        """True when no fingerprint can reach a majority any more, whatever the members
        yet to vote do."""
        if self.decided is not None:
            return False
        best = max(self._counts.values(), default=0)
        return best + len(self.members) - len(self._votes) < self.quorum


class Adoption:
    """Copying a voted result: the parts I already hold with the voted digest are taken
    from what I hold, the others are fetched chunk by chunk from the result's voters and
    checked against their digest before they count. Pure bookkeeping; the runner picks
    the voters and moves the chunks."""

    def __init__(
        self,
        spec: RoundSpec,
        fingerprint: bytes,
        digests: Sequence[PartDigest],
        held: Callable[[int], tuple[PeerID, frozenset[PeerID], torch.Tensor] | None],
    ) -> None:
        self.spec = spec
        self.fingerprint = fingerprint
        self.digests = tuple(digests)
        self._parts = spec.parts()
        self._chunks = [chunk_ranges(s, e, spec.chunk_elements) for s, e in self._parts]
        self.values = torch.empty(spec.total_elements, dtype=torch.float32)
        self._arrived: dict[int, set[int]] = {}
        for i, (start, end) in enumerate(self._parts):
            if end == start:
                continue  # nothing to copy: the vote's digest names it all
            mine = held(i)
            if mine is not None:
                reducer, contributors, values = mine
                if self._digest_of(i, reducer, contributors, values) == self.digests[i]:
                    self.values[start:end].copy_(values)
                    continue
            self._arrived[i] = set()
        self.num_parts_copied = 0

    def _digest_of(
        self, i: int, reducer: PeerID, contributors: frozenset[PeerID], values: torch.Tensor
    ) -> PartDigest:
        members = sorted(m.to_bytes() for m in contributors)
        return PartDigest(i, reducer.to_bytes(), members, values_digest(values))

    @property
    def missing_parts(self) -> frozenset[int]:
        """Parts still to fetch."""
        return frozenset(self._arrived)

    @property
    def complete(self) -> bool:
        return not self._arrived

    def num_chunks(self, part_index: int) -> int:
        return len(self._chunks[part_index])

    def chunk_range(self, part_index: int, chunk_index: int) -> tuple[int, int] | None:
        """The ``[start, end)`` of a chunk still awaited, None for one not awaited (a
        duplicate, a part held already, an index out of range)."""
        arrived = self._arrived.get(part_index)
        if arrived is None or not 0 <= chunk_index < len(self._chunks[part_index]):
            return None
        if chunk_index in arrived:
            return None
        return self._chunks[part_index][chunk_index]

    def offer(
        self,
        part_index: int,
        reducer: PeerID,
        contributors: frozenset[PeerID],
        values: torch.Tensor,
    ) -> bool:
        """A part still missing here that I now hold myself (it arrived from its reducer
        meanwhile): taken, and True, if it matches the voted digest."""
        if part_index not in self._arrived:
            return False
        if self._digest_of(part_index, reducer, contributors, values) != self.digests[part_index]:
            return False
        start, end = self._parts[part_index]
        self.values[start:end].copy_(values)
        del self._arrived[part_index]
        return True

    def on_copy(self, part_index: int, chunk_index: int, values: torch.Tensor) -> bool | None:
        """Take a fetched chunk whose range :meth:`chunk_range` gave. Returns None while
        the part is incomplete, True once it is complete and matches its digest, False
        when complete and not matching (its chunks are then forgotten: fetch it again
        from another voter)."""
        span = self.chunk_range(part_index, chunk_index)
        if span is None or values.dtype != torch.float32 or values.shape != (span[1] - span[0],):
            raise ValueError("a copied chunk that was not awaited or has the wrong shape")
        self.values[span[0] : span[1]].copy_(values)
        arrived = self._arrived[part_index]
        arrived.add(chunk_index)
        if len(arrived) < len(self._chunks[part_index]):
            return None
        start, end = self._parts[part_index]
        if values_digest(self.values[start:end]) != self.digests[part_index].values:
            arrived.clear()
            return False
        del self._arrived[part_index]
        self.num_parts_copied += 1
        return True

    def result(self, failed: Mapping[PeerID, str]) -> RoundResult:
        """The copied result, once :meth:`complete`: the voted tensor, reported by the
        reducers and contributors its digests name."""
        if not self.complete:
            raise RoundError("the adoption is not complete")
        reports = []
        num_averaged = 0
        for i, (digest, (start, end)) in enumerate(zip(self.digests, self._parts, strict=True)):
            contributors = frozenset(PeerID(m) for m in digest.contributors)
            reducer = PeerID(digest.reducer)
            averaged = contributors != {reducer}  # a voter's own value is not averaged
            num_averaged += (end - start) if averaged else 0
            reports.append(PartReport(i, start, end, reducer, contributors, averaged))
        total = self.spec.total_elements
        report = RoundReport(
            round_id=self.spec.round_id,
            me=self.spec.me,
            members=self.spec.members,
            failed=MappingProxyType(dict(failed)),
            excluded_by=frozenset(),
            parts=tuple(reports),
            fraction_averaged=num_averaged / total if total else 1.0,
        )
        return RoundResult(self.values, report)


def sign_vote(identity: KeyPair, fingerprint: bytes) -> bytes:
    """``identity``'s signature of its vote for ``fingerprint``. The fingerprint commits
    to the round id and every part digest, so the signature binds the whole vote to
    one round."""
    return identity.sign(VOTE_SIGNATURE_DOMAIN + fingerprint)


def vote_signed_by(voter: PeerID, fingerprint: bytes, signature: bytes) -> bool:
    """True if ``signature`` is ``voter``'s signature of a vote for ``fingerprint``
    (checked against the public key inside its PeerID; an id without one cannot vote
    through a relay, and swarmtrain's own ids always carry it)."""
    key = voter.inline_public_key()
    return key is not None and key.verify(signature, VOTE_SIGNATURE_DOMAIN + fingerprint)


def check_vote(spec: RoundSpec, fingerprint: bytes, digests: Sequence[PartDigest]) -> str | None:
    """Why a vote is malformed, or None: one digest per part in order, members only,
    the fingerprint matching its digests."""
    if len(digests) != len(spec.parts()):
        return "a vote must hold one digest per part"
    members = {m.to_bytes() for m in spec.members}
    for i, digest in enumerate(digests):
        if digest.part_index != i or len(digest.values) != 16:
            return "a vote's part digests must be in part order with 16-byte digests"
        if digest.reducer not in members or not set(digest.contributors) <= members:
            return "a vote names a non-member"
    if fingerprint_of(spec.round_id, digests) != fingerprint:
        return "a vote's fingerprint does not match its digests"
    return None


def contradiction(mine: Sequence[PartDigest], theirs: Sequence[PartDigest]) -> int | None:
    """The first part that ``theirs`` holds with other values than ``mine`` from the same
    reducer over the same contributors, or None. Results legitimately differ where faults
    gave members different reducers or contributors for a part (which a member that has
    not voted resolves by copying the leading vote rather than splitting the round); a
    part with the same origin and other values means that someone lied: its reducer sent
    different values to different members, or the voter reports something else than it
    received. A member then votes for what it holds instead of copying (a single lying
    reducer that votes first cannot draw honest members away from one another)."""
    for a, b in zip(mine, theirs, strict=True):
        same_origin = a.reducer == b.reducer and set(a.contributors) == set(b.contributors)
        if same_origin and a.values != b.values:
            return a.part_index
    return None
