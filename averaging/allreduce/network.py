"""The networked butterfly all-reduce: moves the chunks of a
:class:`~averaging.allreduce.butterfly.ButterflyRound` between real peers, turns its
deadlines into failures, and ends the round with a vote (``averaging.allreduce.agreement``).

One stream links each pair of members (``wire.link_opener``); every message
between the two travels on it, both ways. On a long round trip a link gains further
streams for chunks (lanes): the opener's on further connections, and one the other
member opens back (``wire.REVERSE_LANE``), so that it need not wait half a round trip for
the opener's stream before it sends. A writer task per link encodes what the round
has for that member just before it goes out (memory stays at one chunk per link); a
reader task per link decodes what arrives and feeds the state machine, which reduces
each chunk as it arrives, so reduction overlaps the transfer of the next chunks.

Failures (docs/design/averaging.md, "Faults"): a link that breaks, or a member silent past
``sender_timeout`` (as a sender) or ``reducer_timeout`` (as a reducer), is excluded;
the state machine reassigns its parts, and every exclusion is told to every member,
the excluded one included (it withdraws). A link is never reset on exclusion: votes and
copies still travel on it.

The end (docs/design/agreement.md): a member holding every part votes once for its
result's fingerprint and part digests, and relays every vote it sees. A fingerprint
voted by a strict majority of the group is decided; a member holding another result, or
none (withdrawn, stuck behind a dead reducer), copies the parts it lacks from the
decided result's voters, checking each against its digest, and then holds the decided
tensor too. A member that has not voted yet and sees a vote while an exclusion would
make it diverge, or once it is withdrawn, copies the leading result instead of reducing
parts again: a part a live member holds in full is fetched, not reduced twice. Members
that hold the decided result stay (at most ``sender_timeout``) while others may still
copy from them. Everything is bounded by ``round_timeout``: the butterfly gives up
``reducer_timeout`` before it, and votes and copies have the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from averaging.allreduce.accusations import (
    Accusation,
    AccusationBook,
    Added,
    Echo,
    accusation_signed,
    echo_signed,
    sign_accusation,
    sign_echo,
)
from averaging.allreduce.agreement import (
    Adoption,
    Ballot,
    check_vote,
    contradiction,
    sign_vote,
    vote_signed_by,
)
from averaging.allreduce.butterfly import ButterflyRound
from averaging.allreduce.config import (
    FLUSH_SECONDS,
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    TransferStatistics,
)
from averaging.allreduce.feedback import RoundErrors
from averaging.allreduce.pace import carried_rate
from averaging.allreduce.partition import chunk_ranges
from averaging.allreduce.records import (
    ChunksAveraged,
    Outgoing,
    PartDigest,
    PartReady,
    PartReassigned,
    PeerExcluded,
    RoundEvent,
    RoundResult,
    RoundSpec,
    Withdrawn,
    fingerprint_of,
    part_digests,
)
from averaging.allreduce.wire import (
    ALLREDUCE_PROTOCOL,
    MAX_LANES,
    REVERSE_LANE,
    AveragedMessage,
    ChunkMessage,
    CopyMessage,
    EchoMessage,
    FetchMessage,
    HaveMessage,
    Hello,
    Message,
    NoticeMessage,
    SuspectMessage,
    VoteMessage,
    accusations_of,
    decode_hello,
    decode_message,
    echo_from_wire,
    echo_to_wire,
    encode_hello,
    encode_message,
    link_opener,
    notice_of,
    peer_ids,
)
from averaging.compression import EncodedTensor, EncodeError, NoneCodec, decode_tensor
from peers.errors import IdentityError, LimitExceeded, PeersError, RemoteProtocolError
from peers.identity import PeerID
from peers.rpc import FramedStream
from peers.serialization import frame_buffers
from peers.stream_api import PooledStreamHost, StreamHost, StreamLike

logger = logging.getLogger(__name__)

#: Times one member may fetch one part from me: a retry after a lost link, not a way to
#: make me send a part without end.
MAX_FETCHES_PER_PART = 3


@dataclass(frozen=True, slots=True)
class _AveragedRef:
    to: PeerID
    part_index: int
    chunk_index: int
    contributors: frozenset[PeerID]


@dataclass(frozen=True, slots=True)
class _CopyRef:
    fingerprint: bytes
    part_index: int
    chunk_index: int


_Item = Outgoing | _AveragedRef | _CopyRef | Message


@dataclass(eq=False)
class _Lane:
    """One stream of a link: lane 0 carries every message, a further lane (on another
    connection) only chunks: :func:`_is_bulk` items."""

    index: int
    framed: FramedStream[StreamLike]
    writer: asyncio.Task[None] | None = None
    counted: int = 0  # bytes read up to the last frame
    unsure: list[_Item] | None = None
    """A reverse lane opened early (``RoundRunner._open_reverse``), until the member's
    answer confirms it: what was written on it, to send again if the member refuses."""


@dataclass(eq=False)
class _Link:
    peer_id: PeerID
    opened_by_me: bool
    lanes: dict[int, _Lane] = field(default_factory=dict)
    outbox: deque[_Item] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    dead: bool = False
    ignored: bool = False
    heard: asyncio.Event = field(default_factory=asyncio.Event)  # a first frame came

    def send(self, item: _Item) -> None:
        if not self.dead and not self.finished.is_set():
            self.outbox.append(item)
            self.wake.set()

    @property
    def framed(self) -> FramedStream[StreamLike] | None:
        """The first lane's stream, once the link is open."""
        first = self.lanes.get(0)
        return first.framed if first is not None else None

    @property
    def usable(self) -> bool:
        return self.framed is not None and not self.dead and not self.finished.is_set()


def _is_bulk(item: _Item) -> bool:
    """What a further lane may carry: chunks, whose order does not matter (each names
    its part and chunk). Everything else keeps its order on the first lane."""
    return isinstance(item, Outgoing | _AveragedRef | _CopyRef)


#: Members a :class:`LaneMemo` remembers by default.
MAX_LANE_MEMBERS_KEPT = 1024


class LaneMemo:
    """Members that took a further lane of a link lately (at most ``capacity``, the
    oldest forgotten first): an :class:`AllReduceService` keeps one across its rounds,
    and a link to such a member opens its further lanes at once instead of after the
    member's first answer. A member that refuses one is forgotten."""

    def __init__(self, capacity: int = MAX_LANE_MEMBERS_KEPT) -> None:
        if capacity < 1:
            raise ValueError("a LaneMemo keeps at least one member")
        self.capacity = capacity
        self._members: OrderedDict[PeerID, None] = OrderedDict()

    def __contains__(self, member: object) -> bool:
        return member in self._members

    def __len__(self) -> int:
        return len(self._members)

    def add(self, member: PeerID) -> None:
        self._members[member] = None
        self._members.move_to_end(member)
        while len(self._members) > self.capacity:
            self._members.popitem(last=False)

    def discard(self, member: PeerID) -> None:
        self._members.pop(member, None)


@dataclass(frozen=True, slots=True)
class _Held:
    """A complete result this peer holds, with what it votes or serves copies from."""

    fingerprint: bytes
    digests: tuple[PartDigest, ...]
    result: RoundResult


@dataclass(slots=True)
class _Fetch:
    source: PeerID
    since: float


#: The least time the round's loop sleeps before a check that falls due later.
MIN_WAKE_SECONDS = 1e-6


class RoundRunner:
    """Runs one round at one peer. Built by :class:`AllReduceService.run_round`."""

    def __init__(
        self,
        peer: StreamHost,
        spec: RoundSpec,
        local: torch.Tensor,
        weight: float,
        config: AllReduceConfig,
        errors: RoundErrors | None = None,
        lane_memo: LaneMemo | None = None,
        reverse_memo: LaneMemo | None = None,
    ) -> None:
        self.peer = peer
        self._lane_memo = lane_memo if lane_memo is not None else LaneMemo()
        self._reverse_memo = reverse_memo if reverse_memo is not None else LaneMemo()
        self.spec = spec
        self.config = config
        # Error feedback (a lossy codec's residuals): only a lossy codec leaves any.
        self._errors = errors if config.codec.name != "none" else None
        self.round = ButterflyRound(spec, local, weight)
        self._me = spec.me
        # A member with weight 0 (client mode) reduces nothing and cannot be dialed.
        self._can_reduce = {m: w > 0 for m, w in zip(spec.members, spec.weights, strict=True)}
        reachable = self._can_reduce
        self.links: dict[PeerID, _Link] = {}
        for m in spec.members:
            opener = link_opener(self._me, reachable[self._me], m, reachable[m])
            if m != self._me and opener is not None:
                self.links[m] = _Link(m, opener == self._me)
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._started = self._loop.time()
        self._last_heard = dict.fromkeys(spec.members, self._started)
        # When each member's first frame, and first chunk, arrived: a sender's rate is
        # judged over the time it has been sending, not since the round started (one
        # held behind a cut that heals then delivers everything at once).
        self._first_heard_at: dict[PeerID, float] = {}
        self._first_chunk_at: dict[PeerID, float] = {}
        self._reducing_since = self._started  # and since I last inherited a part
        # (part, chunk) of mine -> its averaged values as published, and over whom
        self._encoded: dict[tuple[int, int], EncodedTensor] = {}
        self._encoded_for: dict[tuple[int, int], frozenset[PeerID]] = {}
        self._ballot = Ballot(spec.members)
        self._accusations = AccusationBook(spec.members)
        self._votes: dict[bytes, VoteMessage] = {}  # fingerprint -> the first vote for it
        self._first_vote_at: float | None = None
        self._voted = False
        self._held: _Held | None = None
        self._adoption: Adoption | None = None
        self._fetches: dict[int, _Fetch] = {}
        self._adoption_started = 0.0
        self._patience = config.sender_timeout / 2
        self._offered: set[int] = set()
        self._bad_sources: dict[int, set[PeerID]] = {}
        self._served: dict[tuple[PeerID, int], int] = {}
        self._have: set[PeerID] = set()
        self._agreed_at: float | None = None
        self._last_fetch_at = -math.inf  # a member copying from me: I stay a while longer
        self._diverging = False
        self._gave_up = False
        self._suspected: dict[PeerID, float] = {}  # yielded to, since
        self._reported: dict[PeerID, set[PeerID]] = {}  # suspected by these others
        self._spec_digest = spec.digest()
        self._bytes_sent = 0
        self._bytes_received = 0
        self._arrivals: list[tuple[float, int]] = []  # (time, bytes) per frame read
        self._tasks: asyncio.TaskGroup | None = None
        self._link_tasks: list[asyncio.Task[None]] = []

    # --- the round --------------------------------------------------------------------

    async def run(self) -> AllReduceResult:
        agreed = False
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            for link in self.links.values():
                if link.opened_by_me:
                    self._link_tasks.append(tasks.create_task(self._open(link)))
                elif self._reverses(link.peer_id):
                    self._link_tasks.append(tasks.create_task(self._open_reverse(link)))
            self._handle(self._initial_events())
            try:
                agreed = await self._drive()
            finally:
                await self._close_links()
        result = self._final_result(agreed)
        if self._errors is not None:
            self._errors.settle(result.report)
        # Drop what the round held (chunks, encodings, links) now rather than when the
        # cyclic garbage collector gets to it: a 64M-element round holds gigabytes.
        self._encoded.clear()
        self._encoded_for.clear()
        self._link_tasks.clear()
        self.links.clear()
        self._adoption = None
        transfer = TransferStatistics(
            bytes_sent=self._bytes_sent,
            bytes_received=self._bytes_received,
            seconds=self._loop.time() - self._started,
            agreed=agreed,
            carried_bytes_per_second=carried_rate(self._arrivals, self._started),
        )
        self._arrivals.clear()
        return AllReduceResult(result, transfer)

    def _final_result(self, agreed: bool) -> RoundResult:
        if self._held is not None and (agreed or self._voted):
            return self._held.result
        if not self.round.is_done():
            self.round.give_up("still missing at the round deadline")
        return self.round.result()

    def _initial_events(self) -> list[RoundEvent]:
        for item in self.round.outgoing_chunks():
            self.links[item.to].send(item)
        # A member whose only part is mine, or a one-member round, may be final at once.
        return [PartReady(i) for i in sorted(self.round.ready_parts())]

    async def _drive(self) -> bool:
        """Until this peer holds the decided result and nobody may still copy it from
        us, or the round's deadline: check stalls, vote, copy, wait."""
        deadline = self._started + self.config.round_timeout
        give_up_at = deadline - self.config.reducer_timeout
        while True:
            self._changed.clear()
            now = self._loop.time()
            if now >= deadline:
                return self._agreed_at is not None
            if not self.round.is_done() and self._adoption is None and not self._voted:
                self._fail_dead_links(now)
                self._fail_stalled(now, give_up_at)
                if now >= give_up_at and not self.round.is_done() and not self._gave_up:
                    self._give_up()
            self._agree(now)
            if self._agreed_at is not None and self._nobody_needs_me(now):
                return True
            if self._agreed_at is None and self._ballot.hopeless:
                logger.info("round %s: votes split, no result can win", self._tag)
                return False
            self._check_fetches(now)
            wake = min(deadline, self._next_check(now, give_up_at))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wake - now, 0.0)):
                    await self._changed.wait()

    def _next_check(self, now: float, give_up_at: float) -> float:
        checks = [now + 3600.0]
        if not self.round.is_done() and self._adoption is None and not self._voted:
            checks.append(give_up_at)
            for m in self.round.missing_senders() - self._suspected.keys():
                checks.append(self._last_heard[m] + self.config.sender_timeout)
                since = self._first_chunk_at.get(m, self._first_heard_at.get(m))
                if since is not None:
                    since = max(since, self._reducing_since)
                    checks.append(since + self.config.sender_timeout)
            for m in self.round.missing_reducers() - self._suspected.keys():
                checks.append(self._last_heard[m] + self.config.reducer_timeout)
            for since in self._suspected.values():
                checks.append(since + self.config.sender_timeout)
        if self._first_vote_at is not None and not self._voted and self._adoption is None:
            checks.append(self._first_vote_at + self.config.sender_timeout)
        for fetch in self._fetches.values():
            checks.append(fetch.since + self.config.sender_timeout)
        if self._adoption is not None:
            checks.append(self._adoption_started + self._patience)
        if self._agreed_at is not None:
            checks.append(max(self._agreed_at, self._last_fetch_at) + self.config.sender_timeout)
        # What was due by now was checked in this pass (and acted on, or deliberately
        # not): wake for what falls due later, never at once (no busy loop).
        # At least MIN_WAKE_SECONDS away: asyncio fires a timer within its clock's
        # resolution of now at once, so a check a nanosecond ahead would be woken for
        # again and again without the clock reaching it (a livelock on a virtual clock).
        return max(min(t for t in checks if t > now), now + MIN_WAKE_SECONDS)

    def _fail_dead_links(self, now: float) -> None:
        for link in self.links.values():
            if link.dead:
                self._accuse(link.peer_id, "link closed", now, as_sender=False)

    def _fail_stalled(self, now: float, give_up_at: float) -> None:
        for m in self.round.missing_senders():
            if now >= self._last_heard[m] + self.config.sender_timeout:
                self._accuse(m, "stalled as a sender", now, as_sender=True)
            elif self._too_slow(m, now, give_up_at):
                reason = "too slow: at its rate so far its chunks arrive after the round gives up"
                self._accuse(m, reason, now, as_sender=True)
        for m in self.round.missing_reducers():
            if now >= self._last_heard[m] + self.config.reducer_timeout:
                self._accuse(m, "stalled as a reducer", now, as_sender=False)

    def _too_slow(self, sender: PeerID, now: float, give_up_at: float) -> bool:
        """True when ``sender``, while talking to me, cannot deliver its chunks before
        ``give_up_at``, when I would exclude it anyway: one that has sent frames for
        ``sender_timeout`` but no chunk (it keeps its link alive with other messages),
        or one whose chunks have come for ``sender_timeout`` at a rate that would bring
        the rest after ``give_up_at`` (a thin uplink). Only while it is talking (heard
        within ``sender_timeout / 2``): one that falls silent may be behind a cut that
        heals, and the stall rule waits for it as it should. The accusation follows the
        rule of :meth:`_accuse`: the end that yields waits, so a slow link, like a cut
        one, costs one of its two ends."""
        window = self.config.sender_timeout
        if now - self._last_heard[sender] > window / 2:
            return False  # falling silent is the stall rule's (a cut, a partition)
        received, expected = self.round.sender_progress(sender)
        if received >= expected:
            return False
        first_chunk = self._first_chunk_at.get(sender)
        if first_chunk is None or received == 0:
            talking_since = max(self._first_heard_at.get(sender, now), self._reducing_since)
            return now - talking_since >= window
        sending = now - first_chunk
        return sending >= window and now + (expected - received) * sending / received > give_up_at

    def _accuse(self, member: PeerID, reason: str, now: float, *, as_sender: bool) -> None:
        """Exclude ``member``, whose link failed or who stalled, unless this is the end
        that yields: a link that breaks between two live members looks the same from
        both ends, and if both excluded the other, the flood of notices would cost both.
        So the end that yields (a client-mode member to a reducer; else the one ranked
        after the other for this round) tells the others it suspects ``member`` and
        waits ``sender_timeout`` longer, by which time the other end's notice has
        usually withdrawn it. It excludes ``member`` at once when another member
        suspects it too: two of its links failing is ``member``'s fault (it died or
        stalled), not one link's; without that, a dead member that every survivor
        yields to would cost each of them ``sender_timeout``."""
        if member in self.round.failed or self.round.excluded_by:
            return
        if self._yields_to(member):
            since = self._suspected.get(member)
            if since is None:
                since = self._suspected[member] = now
                suspect = SuspectMessage([member.to_bytes()])
                for m, link in self.links.items():
                    if m != member and m not in self.round.failed:
                        link.send(suspect)
            corroborated = bool(self._reported.get(member))
            if now < since + self.config.sender_timeout and not corroborated:
                return
            if corroborated:
                reason += ", suspected by another member too"
        if as_sender:
            self._handle(self.round.on_sender_failed(member, reason))
        else:
            self._handle(self.round.on_reducer_failed(member, reason))

    def _yields_to(self, member: PeerID) -> bool:
        mine, theirs = self._can_reduce[self._me], self._can_reduce[member]
        if mine != theirs:
            return theirs
        return self._rank(self._me) > self._rank(member)

    def _rank(self, member: PeerID) -> bytes:
        return hashlib.sha256(self.spec.round_id + member.to_bytes()).digest()

    def _give_up(self) -> None:
        """``reducer_timeout`` before the deadline: exclude senders my parts still lack,
        leave undelivered parts at my own value, so that a result exists to vote for."""
        logger.info("round %s: gives up on what is still missing", self._tag)
        self._gave_up = True
        self._handle(self.round.give_up("still missing at the round deadline"))
        if not self.round.is_done():
            logger.warning(
                "round %s: still not done after giving up: senders %s, reducers %s, failed %s",
                self._tag,
                self.round.missing_senders(),
                self.round.missing_reducers(),
                dict(self.round.failed),
            )

    # --- agreement --------------------------------------------------------------------

    def _agree(self, now: float) -> None:
        decided = self._ballot.decided
        if self._held is not None and decided == self._held.fingerprint:
            if self._agreed_at is None:
                self._agreed_at = now
                logger.debug("round %s: agreed", self._tag)
            return
        if decided is not None:
            self._adopt(decided, "a majority decided it")
        elif not self._voted and self._adoption is None:
            leading = self._ballot.leading()
            lagging = self._first_vote_at is not None and (
                now >= self._first_vote_at + self.config.sender_timeout
            )
            withdrawn = bool(self.round.excluded_by)
            if self.round.is_done() and not withdrawn:
                own = self._hold_own()
                if leading is None or leading == own.fingerprint:
                    self._vote(own)
                elif (part := contradiction(own.digests, self._votes[leading].parts)) is not None:
                    logger.warning(
                        "round %s: the leading vote %s holds other values for part %d than "
                        "mine from the same reducer over the same members; votes for mine",
                        self._tag,
                        leading.hex()[:8],
                        part,
                    )
                    self._vote(own)
                else:  # another member finished first: join its result, not split
                    self._adopt(leading, "mine differs from the vote already cast")
            elif leading is not None and (withdrawn or self._diverging or lagging):
                why = "withdrawn" if withdrawn else "diverging" if self._diverging else "lagging"
                self._adopt(leading, why)
        if self._adoption is not None:
            self._take_arrived_parts()
        if self._adoption is not None and self._adoption.complete:
            self._finish_adoption()

    def _hold_own(self) -> _Held:
        result = self.round.result()
        digests = part_digests(result)
        return _Held(fingerprint_of(self.spec.round_id, digests), digests, result)

    def _vote(self, held: _Held) -> None:
        self._held = held
        self._voted = True
        signature = sign_vote(self.peer.identity, held.fingerprint)
        vote = VoteMessage(self._me.to_bytes(), held.fingerprint, list(held.digests), signature)
        logger.debug("round %s: votes %s", self._tag, held.fingerprint.hex()[:8])
        self._count_vote(self._me, vote)
        for link in self.links.values():
            link.send(vote)
        self._changed.set()

    def _count_vote(self, voter: PeerID, vote: VoteMessage) -> bool:
        if not self._ballot.cast(voter, vote.fingerprint):
            return False
        self._votes.setdefault(vote.fingerprint, vote)
        if self._first_vote_at is None and voter != self._me:
            self._first_vote_at = self._loop.time()
        return True

    def _adopt(self, fingerprint: bytes, why: str) -> None:
        if self._adoption is not None and self._adoption.fingerprint == fingerprint:
            return
        vote = self._votes[fingerprint]
        logger.info("round %s: copies result %s (%s)", self._tag, fingerprint.hex()[:8], why)
        self._adoption = Adoption(self.spec, fingerprint, vote.parts, self.round.held_part)
        self._adoption_started = self._loop.time()
        self._offered = set()
        self._fetches.clear()
        self._bad_sources.clear()
        self._request_missing(self._loop.time())

    def _take_arrived_parts(self) -> None:
        """Parts the butterfly completed since the copy began are not fetched."""
        adoption = self._adoption
        assert adoption is not None
        for part in sorted(adoption.missing_parts - self._offered):
            held = self.round.held_part(part)
            if held is None:
                continue
            self._offered.add(part)
            if adoption.offer(part, *held):
                self._fetches.pop(part, None)

    def _expected_soon(self, part: int, now: float) -> bool:
        """A part the decided result has from the reducer my butterfly still awaits it
        from, alive in my view: it is on its way (the common case of a member a little
        behind the majority), so it is fetched only if it has not come within half of
        ``sender_timeout`` (voters stay at least ``sender_timeout`` for fetches)."""
        adoption = self._adoption
        if adoption is None or self.round.excluded_by or self._diverging:
            return False
        if now >= self._adoption_started + self._patience:
            return False
        reducer = PeerID(adoption.digests[part].reducer)
        if reducer == self._me:  # mine, and the majority holds another: nothing is coming
            return False
        return reducer == self.round.reducer_of(part) and reducer not in self.round.failed

    def _request_missing(self, now: float) -> None:
        adoption = self._adoption
        if adoption is None:
            return
        voters = self._ballot.voters_for(adoption.fingerprint)
        for part in sorted(adoption.missing_parts):
            if part in self._fetches or self._expected_soon(part, now):
                continue
            bad = self._bad_sources.get(part, set())
            sources = [
                m
                for m in voters
                if m != self._me and m in self.links and self.links[m].usable and m not in bad
            ]
            if not sources and bad:  # every voter failed once: try them again
                bad.clear()
                continue
            if not sources:
                continue
            # Voters heard from lately (a cut link looks alive, only silent); among them
            # the part's reducer (it held it first), else the parts spread over them.
            recent = [m for m in sources if now < self._last_heard[m] + self.config.sender_timeout]
            sources = sorted(recent or sources)
            reducer = PeerID(adoption.digests[part].reducer)
            source = reducer if reducer in sources else sources[part % len(sources)]
            self._fetches[part] = _Fetch(source, now)
            self.links[source].send(FetchMessage(adoption.fingerprint, part))

    def _check_fetches(self, now: float) -> None:
        """A fetch unanswered for ``sender_timeout`` (or whose link died) moves to
        another voter."""
        for part, fetch in list(self._fetches.items()):
            link = self.links.get(fetch.source)
            if link is None or not link.usable or now >= fetch.since + self.config.sender_timeout:
                self._bad_sources.setdefault(part, set()).add(fetch.source)
                del self._fetches[part]
        self._request_missing(now)

    def _finish_adoption(self) -> None:
        adoption = self._adoption
        assert adoption is not None and adoption.complete
        result = adoption.result(self.round.failed)
        self._held = _Held(adoption.fingerprint, adoption.digests, result)
        self._adoption = None
        self._fetches.clear()
        if not self._voted:
            self._vote(self._held)
        elif self._ballot.decided == self._held.fingerprint:
            have = HaveMessage(self._held.fingerprint)
            for link in self.links.values():
                link.send(have)
        self._changed.set()

    def _nobody_needs_me(self, now: float) -> bool:
        """Every other member holds the decided result, or cannot copy it from me (its
        link is dead, or it never opened it and I excluded it), or had
        ``sender_timeout`` to."""
        assert self._held is not None and self._agreed_at is not None
        if now >= max(self._agreed_at, self._last_fetch_at) + self.config.sender_timeout:
            return True
        fingerprint = self._held.fingerprint
        for m, link in self.links.items():
            if link.dead or (link.framed is None and m in self.round.failed):
                continue
            if self._ballot.vote_of(m) != fingerprint and m not in self._have:
                return False
        return True

    def _serve_fetch(self, sender: PeerID, message: FetchMessage) -> None:
        held = self._held
        part = message.part_index
        if held is None or held.fingerprint != message.fingerprint:
            return  # not what I hold (a stale request): the fetcher tries another voter
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < len(held.digests):
            raise RemoteProtocolError("a fetch names a part out of range")
        count = self._served.get((sender, part), 0)
        if count >= MAX_FETCHES_PER_PART:
            return
        self._served[(sender, part)] = count + 1
        self._last_fetch_at = self._loop.time()
        start, end = self.spec.parts()[part]
        for c, _ in enumerate(chunk_ranges(start, end, self.spec.chunk_elements)):
            self.links[sender].send(_CopyRef(held.fingerprint, part, c))

    def _take_copy(self, sender: PeerID, message: CopyMessage) -> None:
        adoption = self._adoption
        fetch = self._fetches.get(message.part_index) if adoption is not None else None
        if adoption is None or fetch is None or fetch.source != sender:
            return  # late: the part moved to another voter, or arrived already
        if message.fingerprint != adoption.fingerprint:
            return
        span = adoption.chunk_range(message.part_index, message.chunk_index)
        if span is None:
            return
        values = _decode(message.tensor)
        if values.dtype != torch.float32 or values.shape != (span[1] - span[0],):
            raise RemoteProtocolError("a copied chunk has the wrong shape")
        fetch.since = self._loop.time()
        outcome = adoption.on_copy(message.part_index, message.chunk_index, values)
        if outcome is None:
            return
        del self._fetches[message.part_index]
        if outcome is False:
            logger.info("round %s: a copy from %s fails its digest", self._tag, sender)
            self._bad_sources.setdefault(message.part_index, set()).add(sender)
        self._request_missing(self._loop.time())
        self._changed.set()

    def _take_vote(self, sender: PeerID, vote: VoteMessage) -> None:
        try:
            voter = PeerID(vote.voter)
        except IdentityError as e:
            raise RemoteProtocolError(f"a vote names a malformed voter: {e}") from e
        if voter not in self.spec.members:
            raise RemoteProtocolError("a vote from a non-member")
        if self._ballot.vote_of(voter) is not None:
            return  # seen (relayed by another member)
        reason = check_vote(self.spec, vote.fingerprint, vote.parts)
        if reason is not None:
            raise RemoteProtocolError(reason)
        if not vote_signed_by(voter, vote.fingerprint, vote.signature):
            # The sender's fault whether it is the voter or a relayer: a relayer checks
            # a vote before it passes it on.
            raise RemoteProtocolError("a vote whose signature is not its voter's")
        self._count_vote(voter, vote)
        for m, link in self.links.items():  # relay: votes cross cut links, reach clients
            if m not in (sender, voter):
                link.send(vote)
        self._changed.set()

    # --- events from the state machine ------------------------------------------------

    def _handle(self, events: list[RoundEvent]) -> None:
        for event in events:
            if isinstance(event, (PartReady, ChunksAveraged)):
                self._publish(event.part_index)
            elif isinstance(event, PeerExcluded):
                self._diverging = True  # my result may now differ from earlier voters'
                logger.info("round %s: excluded %s: %s", self._tag, event.peer, event.reason)
                link = self.links.get(event.peer)
                if link is not None:
                    link.ignored = True
                if event.peer not in self._accusations.counted:
                    # My own observation: I accuse it, in my name (counted accusations
                    # of others were relayed when they came).
                    self.accuse(event.peer)
            elif isinstance(event, PartReassigned):
                now = self._loop.time()
                if event.new_reducer == self._me:
                    self._last_heard = dict.fromkeys(self._last_heard, now)
                    self._first_chunk_at.clear()  # senders start sending me this part now
                    self._reducing_since = now
                else:
                    self._last_heard[event.new_reducer] = now
                    for item in event.outgoing:
                        self.links[item.to].send(item)
            elif isinstance(event, Withdrawn):
                logger.info("round %s: withdrew, excluded by %s", self._tag, event.excluded_by)
        self._changed.set()  # even with no event: an accepted chunk may complete the round

    @property
    def _tag(self) -> str:
        return f"{self.spec.round_id.hex()[:8]} at {str(self._me)[-6:]}"

    def _publish(self, part_index: int) -> None:
        """Encode the averaged chunks of a part of mine that are ready (once per chunk,
        for every receiver) and queue them."""
        outgoing = self.round.publishable_chunks(part_index)
        lossy = self.config.codec.name != "none"
        for item in outgoing:
            key = (item.part_index, item.chunk_index)
            if self._encoded_for.get(key) != item.contributors:
                values = item.values
                if self._errors is not None:
                    values = self._errors.to_publish(item.start, item.end, values)
                encoded = self._encode_values(values)
                if self._errors is not None:
                    self._errors.on_published(item.start, values, encoded)
                if lossy:  # hold what the receivers will decode (results identical)
                    decoded = decode_tensor(encoded).to(torch.float32).reshape(-1)
                    self.round.set_published_chunk(item.part_index, item.chunk_index, decoded)
                self._encoded[key] = encoded
                self._encoded_for[key] = item.contributors
            ref = _AveragedRef(item.to, item.part_index, item.chunk_index, item.contributors)
            self.links[item.to].send(ref)

    # --- messages from members --------------------------------------------------------

    def _receive(self, sender: PeerID, message: Message, ignored: bool) -> None:
        """Votes, fetches and copies count from every member, an excluded one too (it
        may have withdrawn and copied the result); butterfly messages only from members
        I still count, and only until I hold a result."""
        if isinstance(message, VoteMessage):
            self._take_vote(sender, message)
        elif isinstance(message, FetchMessage):
            self._serve_fetch(sender, message)
        elif isinstance(message, CopyMessage):
            self._take_copy(sender, message)
        elif isinstance(message, HaveMessage):
            self._have.add(sender)
            self._changed.set()
        elif not ignored and not self._voted:
            self._receive_butterfly(sender, message)

    def _receive_butterfly(
        self,
        sender: PeerID,
        message: ChunkMessage | AveragedMessage | NoticeMessage | SuspectMessage | EchoMessage,
    ) -> None:
        round_id = self.spec.round_id
        if isinstance(message, ChunkMessage):
            self._first_chunk_at.setdefault(sender, self._loop.time())
            values = _decode(message.tensor)
            self._handle(
                self.round.on_chunk(
                    sender,
                    round_id,
                    message.part_index,
                    message.chunk_index,
                    values,
                    message.weight,
                )
            )
        elif isinstance(message, AveragedMessage):
            values = _decode(message.tensor)
            contributors = peer_ids(message.contributors)
            self._handle(
                self.round.on_averaged_chunk(
                    sender,
                    round_id,
                    message.part_index,
                    message.chunk_index,
                    values,
                    contributors,
                )
            )
        elif isinstance(message, EchoMessage):
            self._take_echo(sender, echo_from_wire(message))
        elif isinstance(message, SuspectMessage):
            for member in peer_ids(message.suspected):
                if member not in self.spec.members:
                    raise RemoteProtocolError("a suspicion names a non-member")
                if member not in (sender, self._me):
                    self._reported.setdefault(member, set()).add(sender)
            self._changed.set()  # a member I yield to may now be excluded at once
        else:
            for accusation in accusations_of(message):
                self._take_accusation(sender, accusation)

    def _take_accusation(self, sender: PeerID, accusation: Accusation) -> None:
        """Check, record and relay one accusation; exclude (or withdraw) if it counts."""
        members = self.spec.members
        if accusation.accuser not in members or accusation.accused not in members:
            raise RemoteProtocolError("an accusation names a non-member")
        if accusation.accuser == accusation.accused:
            raise RemoteProtocolError("a member accuses itself")
        if not accusation_signed(accusation, self.spec.round_id):
            # The sender's fault whether it is the accuser or a relayer: a relayer
            # checks an accusation before it passes it on.
            raise RemoteProtocolError("an accusation whose signature is not its accuser's")
        added = self._accusations.add(accusation)
        if not added.new:
            return
        self._send(notice_of([accusation]), skip=sender, accused=accusation.accused)
        if added.equivocator is not None and added.equivocator != self._me:
            logger.info("round %s: %s equivocated", self._tag, added.equivocator)
            if added.equivocator not in self.round.failed:
                self._handle(self.round.on_sender_failed(added.equivocator, "equivocated"))
        self._after_added(added, accusation)

    def _take_echo(self, sender: PeerID, echo: Echo) -> None:
        members = self.spec.members
        if not {echo.accuser, echo.accused, echo.echoer} <= set(members):
            raise RemoteProtocolError("an echo names a non-member")
        if echo.accuser == echo.accused:
            raise RemoteProtocolError("an echo of a member accusing itself")
        if not echo_signed(echo, self.spec.round_id):
            raise RemoteProtocolError("an echo whose signature is not its echoer's")
        self._record_echo(echo, skip=sender)

    def _record_echo(self, echo: Echo, skip: PeerID | None) -> None:
        """Record a checked echo (a received one or my own); relay it if new."""
        added = self._accusations.add_echo(echo)
        if added.new:
            self._send(echo_to_wire(echo), skip=skip, accused=echo.accused)
            if added.counted is not None:
                self._handle(self.round.on_accusation(added.counted, echo.accuser))

    def _after_added(self, added: Added, accusation: Accusation) -> None:
        if added.counted is not None:
            self._handle(self.round.on_accusation(added.counted, accusation.accuser))
        if added.echo:  # the first seq-0 accusation of its accuser I see: echo it once
            echo = sign_echo(
                self.peer.identity, self.spec.round_id, accusation.accuser, accusation.accused
            )
            self._record_echo(echo, skip=None)

    def accuse(self, member: PeerID) -> None:
        """Accuse ``member`` in this peer's name, as on its own observation (the round's
        code does when it excludes a member; the fault checker plays a member that
        accuses falsely with it)."""
        seq = self._accusations.next_seq(self._me)
        accusation = sign_accusation(self.peer.identity, self.spec.round_id, member, seq)
        added = self._accusations.add(accusation)
        self._send(notice_of([accusation]), skip=None, accused=member)
        self._after_added(added, accusation)

    def _send(
        self, message: NoticeMessage | EchoMessage, skip: PeerID | None, accused: PeerID
    ) -> None:
        """To every member still in the round, and to the accused (so it withdraws)."""
        for m, link in self.links.items():
            if m != skip and (m not in self.round.failed or m == accused):
                link.send(message)

    def _link_failed(self, link: _Link, error: BaseException) -> None:
        if link.dead:
            return
        link.dead = True
        link.wake.set()
        self._changed.set()
        if link.peer_id in self.round.failed or self.round.excluded_by:
            return
        if self._voted or self._adoption is not None:
            return  # the butterfly is over for me: votes and copies use other links
        logger.info("round %s: link to %s failed: %r", self._tag, link.peer_id, error)
        self._accuse(link.peer_id, f"link failed: {error!r}", self._loop.time(), as_sender=False)

    # --- links ------------------------------------------------------------------------

    async def _open(self, link: _Link) -> None:
        try:
            stream = await self.peer.new_stream(link.peer_id, ALLREDUCE_PROTOCOL)
            framed = FramedStream(stream)
            await framed.write_frame(encode_hello(self.spec))
        except (PeersError, OSError) as e:
            self._link_failed(link, e)
            return
        if not self._attach(link, _Lane(0, framed)):
            return  # the round ended meanwhile
        assert self._tasks is not None
        for index in range(1, self._num_lanes(link.peer_id)):
            self._link_tasks.append(self._tasks.create_task(self._open_lane(link, index)))

    def _num_lanes(self, member: PeerID) -> int:
        """How many lanes my link to ``member`` runs on: where its first connection's
        round trip is long enough that a window caps one connection, enough that my
        links run on ``connections_per_member`` connections together."""
        wanted = min(MAX_LANES, math.ceil(self.config.connections_per_member / len(self.links)))
        if wanted <= 1 or not isinstance(self.peer, PooledStreamHost):
            return 1
        round_trip = self.peer.round_trip(member)
        if round_trip is None or round_trip < self.config.pooled_round_trip:
            return 1
        return wanted

    def _reverses(self, member: PeerID) -> bool:
        """Whether I open a reverse lane to ``member``, the opener of our link: where
        our round trip is long enough for lanes (half of it is the wait it saves), and
        the member can be dialed."""
        if not self.config.reverse_lane or not self._can_reduce[member]:
            return False
        if not isinstance(self.peer, PooledStreamHost):
            return False
        round_trip = self.peer.round_trip(member)
        return round_trip is not None and round_trip >= self.config.pooled_round_trip

    async def _open_reverse(self, link: _Link) -> None:
        """Open the reverse lane of a link ``link.peer_id`` opens. To a member that
        confirmed one lately (:class:`LaneMemo`) at once, sending chunks on it before
        the answer (``_Lane.unsure`` keeps them, should it refuse); to another, once its
        first lane is here, and used once it confirms (the next round's opens at once)."""
        member = link.peer_id
        early = member in self._reverse_memo
        if not early:
            await link.heard.wait()
            if not link.usable:
                return
        framed = await self._start_lane(
            member,
            REVERSE_LANE,
            self._reverse_memo,
            lambda: self.peer.new_stream(member, ALLREDUCE_PROTOCOL),
            confirm=not early,
        )
        if framed is None:
            return
        if not early:
            self._reverse_memo.add(member)
        self._attach(link, _Lane(REVERSE_LANE, framed, unsure=[] if early else None))

    async def _start_lane(
        self,
        member: PeerID,
        index: int,
        memo: LaneMemo,
        open_stream: Callable[[], Awaitable[StreamLike]],
        *,
        confirm: bool,
    ) -> FramedStream[StreamLike] | None:
        """Open lane ``index``'s stream to ``member`` (``open_stream``), send its Hello
        and, with ``confirm``, wait for the member's answer. None when any of it fails:
        the member is then forgotten by ``memo`` (unless our own cap refused the
        stream), and the stream reset. A cancelled call (the round is over) resets it."""
        framed: FramedStream[StreamLike] | None = None
        try:
            framed = FramedStream(await open_stream())
            await framed.write_frame(encode_hello(self.spec, index))
            if confirm:
                await self._confirmed(framed, index)
        except (PeersError, OSError) as e:
            self._no_lane(member, index, memo, e)
        except BaseException:
            if framed is not None:
                framed.stream.reset()
            raise
        else:
            return framed
        if framed is not None:
            framed.stream.reset()
        return None

    def _no_lane(self, member: PeerID, index: int, memo: LaneMemo, error: BaseException) -> None:
        logger.debug("round %s: no lane %d to %s: %r", self._tag, index, member, error)
        if not isinstance(error, LimitExceeded):  # (our own cap says nothing of the member)
            memo.discard(member)

    async def _confirmed(self, framed: FramedStream[StreamLike], lane: int = REVERSE_LANE) -> None:
        """Read the member's answer to the Hello of ``lane``; raises if it is not the
        same Hello."""
        answer = decode_hello(await framed.read_frame())
        if answer != Hello(self.spec.round_id, self._spec_digest, lane):
            raise RemoteProtocolError("the member answered another lane")

    def _refused(self, link: _Link, lane: _Lane, error: BaseException) -> None:
        """The member refused a reverse lane I sent on before its answer (a member of a
        version without them, or one that forgot our link): what went out on it goes
        out again on the link's other lanes, and the member is forgotten."""
        if link.lanes.get(lane.index) is not lane:
            return  # (its reader and its writer may both find it refused)
        logger.debug("round %s: %s refused a reverse lane: %r", self._tag, link.peer_id, error)
        self._reverse_memo.discard(link.peer_id)
        del link.lanes[lane.index]
        if lane.writer is not None and lane.writer is not asyncio.current_task():
            lane.writer.cancel()
        lane.framed.stream.reset()
        self._bytes_received += lane.framed.bytes_read  # (out of link.lanes now)
        for item in reversed(lane.unsure or []):
            link.outbox.appendleft(item)
        lane.unsure = None
        link.wake.set()

    async def _open_lane(self, link: _Link, index: int) -> None:
        """Add lane ``index`` to a link I opened. To a member that took a lane lately
        (:class:`LaneMemo`) the lane opens at once. To another, its connection is dialed
        at once, beside the first lane's start, and the lane opens once a first frame of
        the member's has come: on the first lane, it then holds the link, so a further
        lane cannot overtake it there (a peer that predates lanes would take an early
        one for the link, and refuse the first); or on the reverse lane the member
        opened, and a member that opens one takes a further lane before the first.

        Whatever goes wrong before the member answers leaves the link on the lanes it
        has: nothing was sent on this one yet. The answer is awaited without a deadline
        of its own (the round's end cancels the wait): a member that took the lane sends
        on it at once, and a lane I gave up on there would fail the link at its end."""
        peer = self.peer
        assert isinstance(peer, PooledStreamHost)
        member = link.peer_id
        if member not in self._lane_memo:
            try:
                await peer.connect_pooled(member, index)  # beside the first lane
            except (PeersError, OSError) as e:
                self._no_lane(member, index, self._lane_memo, e)
                return
            await link.heard.wait()
        if not link.usable:
            return
        framed = await self._start_lane(
            member,
            index,
            self._lane_memo,
            lambda: peer.new_pooled_stream(member, ALLREDUCE_PROTOCOL, index),
            confirm=True,
        )
        if framed is None:
            return
        self._lane_memo.add(member)
        self._attach(link, _Lane(index, framed))  # (resets it if the link is over)

    async def accept(
        self, remote: PeerID, framed: FramedStream[StreamLike], spec_digest: bytes, lane: int = 0
    ) -> None:
        """Serve a link's ``lane`` another member opened; returns when the round is done
        with it. Raises :class:`AllReduceError` for a remote that should not open one, or
        whose spec of this round differs from mine (a leader that gave members different
        specs: the link is refused, and its end excludes me as it would a dead peer)."""
        link = self.links.get(remote)
        # The opener of a link opens its lanes but the reverse one, which the other opens.
        expected = link is not None and link.opened_by_me == (lane == REVERSE_LANE)
        if link is None or not expected or lane in link.lanes or link.dead:
            raise AllReduceError(
                f"{remote} does not open lane {lane} of a link to this peer in this round"
            )
        if spec_digest != self._spec_digest:
            raise AllReduceError(f"{remote} was given another spec for this round")
        if lane > 0:
            await framed.write_frame(encode_hello(self.spec, lane))
            if lane in link.lanes or link.dead:  # (while the answer was written)
                raise AllReduceError(f"{remote} opened lane {lane} twice")
        self._attach(link, _Lane(lane, framed))
        await link.finished.wait()

    def _attach(self, link: _Link, lane: _Lane) -> bool:
        """Run ``lane`` (its reader and writer); False, and the stream reset, when the
        link is over (the round ended while it was opened)."""
        assert self._tasks is not None
        if link.finished.is_set() or link.dead:
            lane.framed.stream.reset()
            return False
        link.lanes[lane.index] = lane
        self._link_tasks.append(self._tasks.create_task(self._read(link, lane)))
        lane.writer = self._tasks.create_task(self._write(link, lane))
        self._link_tasks.append(lane.writer)
        link.wake.set()  # a further lane takes what waits in the outbox now
        return True

    async def _read(self, link: _Link, lane: _Lane) -> None:
        framed = lane.framed
        if lane.unsure is not None:  # an early reverse lane: its answer comes first
            try:
                await self._confirmed(framed)
            except (PeersError, OSError, EOFError) as e:
                if not link.finished.is_set():
                    self._refused(link, lane, e)
                return
            if link.lanes.get(lane.index) is not lane:
                return  # its writer found it refused (an answer read from a reset stream)
            lane.unsure = None
            self._reverse_memo.add(link.peer_id)
        try:
            while not link.finished.is_set():
                frame = await framed.read_frame()
                if link.finished.is_set():
                    break  # the round is over: nothing may change it now
                if frame is None:
                    raise EOFError("the member closed the link")
                now = self._last_heard[link.peer_id] = self._loop.time()
                self._first_heard_at.setdefault(link.peer_id, now)
                link.heard.set()
                message = decode_message(frame)
                read = framed.bytes_read
                if isinstance(message, ChunkMessage):
                    # Contributions to my parts time my link; averages do not: they
                    # come at the pace of the slowest contributor to their part.
                    self._arrivals.append((now, read - lane.counted))
                lane.counted = read
                self._receive(link.peer_id, message, link.ignored)
        except (PeersError, OSError, EOFError) as e:
            if not link.finished.is_set():
                self._garbage_or_failure(link, e)

    def _garbage_or_failure(self, link: _Link, error: BaseException) -> None:
        if isinstance(error, RemoteProtocolError) and not self.round.excluded_by:
            logger.info("round %s: %s sent garbage: %s", self._tag, link.peer_id, error)
            if link.peer_id not in self.round.failed and not self._voted:
                reason = f"sent garbage: {error}"
                self._handle(self.round.on_sender_failed(link.peer_id, reason))
            link.dead = True
            return
        self._link_failed(link, error)

    async def _write(self, link: _Link, lane: _Lane) -> None:
        """Send what the link's outbox holds, in order, each item when this lane is
        free: every lane takes the next chunk as its last write returns, so a faster
        connection carries more; only the first lane takes other messages (a further
        lane waits while one is next)."""
        stream = lane.framed.stream
        try:
            while True:
                while link.outbox and (lane.index == 0 or _is_bulk(link.outbox[0])):
                    item = link.outbox.popleft()
                    if lane.unsure is not None:
                        lane.unsure.append(item)
                    if len(link.lanes) > 1 and not _is_bulk(item):
                        link.wake.set()  # further lanes may take the chunks behind it
                    frame = self._encode(item)
                    if frame is None:
                        continue
                    buffers = frame_buffers(frame)
                    self._bytes_sent += sum(len(b) for b in buffers)
                    await stream.write_many(buffers)
                if link.finished.is_set() or link.dead:
                    return
                link.wake.clear()
                await link.wake.wait()
        except (PeersError, OSError) as e:
            if lane.unsure is None:
                self._link_failed(link, e)
            elif not link.finished.is_set():  # (at the round's end: nothing to send again)
                self._refused(link, lane, e)

    def _encode_values(self, values: torch.Tensor) -> EncodedTensor:
        if self.config.codec.name != "none" or values.dtype != torch.float32:
            try:
                return self.config.codec.encode(values)
            except EncodeError as e:
                # Our own values do not fit the codec (float16 above 65504): this chunk
                # travels exact. It costs this chunk's compression, never a peer (the
                # receivers decode by the codec each chunk names).
                logger.info("round %s: a chunk goes uncompressed: %s", self._tag, e)
                values = values.to(torch.float32)
        # Exact values need no codec work: our vector was checked finite when the round
        # began and stays unchanged until it ends, so a view of it goes out as it is
        # (the codec would check its range and copy it first).
        array = values.contiguous().numpy()
        return EncodedTensor("none", "float32", [values.numel()], {"values": array})

    def _encode(self, item: _Item) -> list[object] | None:
        if isinstance(item, Outgoing):
            encoded = self._encode_values(item.values)
            if self._errors is not None:
                part_start, part_end = self.spec.parts()[item.part_index]
                ranges = chunk_ranges(part_start, part_end, self.spec.chunk_elements)
                self._errors.on_sent(ranges[item.chunk_index][0], item.values, encoded)
            return encode_message(
                ChunkMessage(item.part_index, item.chunk_index, item.weight, encoded)
            )
        if isinstance(item, _AveragedRef):
            key = (item.part_index, item.chunk_index)
            if self._encoded_for.get(key) != item.contributors:
                return None  # averaged again since, without a member: the new one follows
            contributors = sorted(m.to_bytes() for m in item.contributors)
            encoded = self._encoded[key]
            return encode_message(
                AveragedMessage(item.part_index, item.chunk_index, contributors, encoded)
            )
        if isinstance(item, _CopyRef):
            if self._held is None or self._held.fingerprint != item.fingerprint:
                return None  # I moved on to the decided result: the fetcher asks again
            part_start, part_end = self.spec.parts()[item.part_index]
            ranges = chunk_ranges(part_start, part_end, self.spec.chunk_elements)
            start, end = ranges[item.chunk_index]
            values = self._held.result.averaged[start:end].contiguous().numpy()
            exact = EncodedTensor("none", "float32", [end - start], {"values": values})
            return encode_message(
                CopyMessage(item.fingerprint, item.part_index, item.chunk_index, exact)
            )
        return encode_message(item)

    async def _close_links(self) -> None:
        """Let writers flush (bounded), then close every link and stop its tasks."""
        for link in self.links.values():
            link.finished.set()
            link.wake.set()
        lanes = [lane for link in self.links.values() for lane in link.lanes.values()]
        writers = [lane.writer for lane in lanes if lane.writer is not None]
        if writers:  # each writer returns once its outbox is flushed
            await asyncio.wait(writers, timeout=FLUSH_SECONDS)
        # All at once: one slow or dead remote must not hold the others' closes (and
        # the round's return) for FLUSH_SECONDS each.
        await asyncio.gather(*(_close_stream(lane.framed.stream) for lane in lanes))
        for task in self._link_tasks:
            task.cancel()
        for lane in lanes:
            self._bytes_received += lane.framed.bytes_read


async def _close_stream(stream: StreamLike) -> None:
    """Close ``stream`` (its remote sees the end), waiting at most FLUSH_SECONDS, then
    reset whatever is left of it."""
    with contextlib.suppress(TimeoutError, PeersError, OSError):
        async with asyncio.timeout(FLUSH_SECONDS):
            await stream.close()
    stream.reset()


_NONE = NoneCodec()


def _decode(encoded: EncodedTensor) -> torch.Tensor:
    """A received chunk's values. Uncompressed ones skip the codec's finiteness pass:
    ``ButterflyRound`` checks every value it is given (one pass, not two)."""
    if isinstance(encoded, EncodedTensor) and encoded.codec == _NONE.name:
        return _NONE.decode(encoded, check_finite=False)
    return decode_tensor(encoded)
