"""One search for a group under one key, as a pure state machine (CONTRIBUTING.md,
"Protocols are pure state machines").

Events in (what a DHT read showed, a join that arrived or was abandoned, the answer to
our own join), actions out (read the DHT, join this leader, sleep until, formed, failed)
and answers to the joins we hold. No sockets, no clock: every call takes ``now``.

The protocol (docs/averaging-matchmaking.md):

1. Declare under the key (the driver stores it), then *gather*: read the key every
   poll interval (the first few reads sooner: :data:`FIRST_REREAD_SHARE`) until
   ``target_group_size`` peers are visible or the gather window ends.
2. The *leader* is the visible peer of smallest :func:`rank` among those that accept
   connections. Everyone else joins it with one call, which the leader holds until it
   forms the groups; a callee that knows a better-ranked leader answers with a redirect,
   so views that differ still converge on one leader (redirects always point to a
   strictly better rank: no cycles).
3. A leader keeps reading the key. If a better-ranked peer appears it hands over: its
   held joins are redirected there and it joins too. A leader that cannot be reached
   (or refuses) is dropped and the next best is tried; that may be ourselves.
4. After the gather window, once every visible peer has joined (with ``form_when_full``,
   as soon as ``target_group_size`` peers joined), or at the deadline (the
   earliest a held joiner can wait for), the leader splits the joiners into balanced
   groups (:func:`plan_groups`) and answers every join.

Peers the caller expects (``expected``: a training swarm's progress records) are
visible from the start, so with all of them known step 2 comes at once. One that is not
searching yet is asked again until the gather window ends; a leader chosen from them
alone reads the key once before it forms; and one that no read or join has shown holds
no leader past its gather window.
"""

from __future__ import annotations

import enum
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from averaging.matchmaking.records import (
    MAX_GROUP_SIZE,
    MAX_PENDING_JOINS,
    ROUND_ID_BYTES,
    Candidate,
    Group,
    MatchmakingConfig,
    MemberInfo,
    rank,
)
from peers.identity import PeerID

#: A leader answers a join this long before the joiner's own deadline, so the answer
#: arrives in time over a slow link ...
REPLY_MARGIN_SECONDS = 1.0
#: ... but never more than this share of the joiner's remaining time (short searches).
REPLY_MARGIN_FRACTION = 0.1
#: Peers a search remembers (declarations, joiners, redirect targets). One key holds at
#: most 1024 declarations; the rest is slack for joiners and redirects.
MAX_VIEW = 4 * MAX_PENDING_JOINS
#: The first reads of a search come sooner than the poll interval: this share of it after
#: the first, twice that after the second, and so on up to the interval. Peers that start
#: together store their declarations within a few round trips of each other, and one
#: whose first read came before the others' stores would otherwise learn of them a whole
#: interval later, with the joins that found a leader waiting on it meanwhile.
FIRST_REREAD_SHARE = 1 / 8


class Role(enum.Enum):
    GATHERING = "gathering"
    LEADING = "leading"
    FOLLOWING = "following"
    DONE = "done"


# --- answers to a join (the leader's side) -------------------------------------------


@dataclass(frozen=True, slots=True)
class Placed:
    group: Group


@dataclass(frozen=True, slots=True)
class Redirect:
    to: Candidate


@dataclass(frozen=True, slots=True)
class Refused:
    """Not collecting joins under this key: the joiner should try another leader."""

    reason: str
    finished: tuple[PeerID, ...] = ()
    not_searching: bool = False
    """The callee runs no search under this key: not yet, or not at all. A joiner told
    to expect it (:class:`GroupSearch`'s ``expected``) tries it again shortly."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The groups were formed without the joiner: it should give up."""

    reason: str


JoinAnswer = Placed | Redirect | Refused | Rejected


# --- what the driver should do next ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Poll:
    """Read the DHT key, then call :meth:`GroupSearch.on_declarations`; the read should
    end by ``until``."""

    until: float


@dataclass(frozen=True, slots=True)
class Join:
    """Call ``leader``'s join, then :meth:`GroupSearch.on_join_result`."""

    leader: Candidate


@dataclass(frozen=True, slots=True)
class Sleep:
    """Nothing to do before ``until``, unless a join arrives."""

    until: float


@dataclass(frozen=True, slots=True)
class Formed:
    group: Group


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str


Action = Poll | Join | Sleep | Formed | Failed


# --- pure decisions --------------------------------------------------------------------


def choose_leader(key: str, candidates: Iterable[Candidate]) -> Candidate | None:
    """The candidate of smallest rank among those that can lead, or None."""
    return min(
        (c for c in candidates if c.can_lead), key=lambda c: rank(key, c.peer_id), default=None
    )


def balanced_sizes(num_members: int, num_groups: int) -> list[int]:
    """``num_members`` split into ``num_groups`` sizes differing by at most one."""
    base, extra = divmod(num_members, num_groups)
    return [base + 1 if i < extra else base for i in range(num_groups)]


def plan_groups(
    members: Sequence[MemberInfo], target_group_size: int, min_group_size: int
) -> tuple[list[list[MemberInfo]], list[MemberInfo]]:
    """Split ``members`` (in priority order: the leader first, then joins by arrival)
    into balanced groups of at most ``target_group_size`` and at least
    ``min_group_size``, each holding a member that accepts connections (a group of
    client-mode peers could not average). Returns the groups and the members left over
    (the last arrivals), placing as many members as these rules allow.

    With g groups, ``g <= n // min`` makes every balanced size at least ``min``, and
    ``ceil(n / target)`` is the fewest groups whose sizes stay within ``target``.
    """
    n = len(members)
    hosts = [m for m in members if not m.client_mode]
    num_groups = min(math.ceil(n / target_group_size), n // min_group_size, len(hosts))
    if num_groups == 0:
        return [], list(members)
    num_placed = min(n, num_groups * target_group_size)
    seeds = hosts[:num_groups]
    seeded = {m.peer_id for m in seeds}
    rest = [m for m in members if m.peer_id not in seeded]
    groups: list[list[MemberInfo]] = []
    taken = 0
    for seed, size in zip(seeds, balanced_sizes(num_placed, num_groups), strict=True):
        groups.append([seed, *rest[taken : taken + size - 1]])
        taken += size - 1
    return groups, rest[taken:]


def group_order(round_id: bytes, members: Iterable[MemberInfo]) -> list[MemberInfo]:
    """The order members take in a group (and so the butterfly parts they reduce): a
    per-round shuffle, so that no peer always reduces the first part."""
    return sorted(members, key=lambda m: hashlib.sha256(round_id + m.peer_id.to_bytes()).digest())


def reply_margin(timeout: float) -> float:
    return min(REPLY_MARGIN_SECONDS, REPLY_MARGIN_FRACTION * timeout)


@dataclass(slots=True)
class _Held:
    member: MemberInfo
    reply_by: float
    expected_size: int = 0


class GroupSearch:
    """One peer's search under one key (see the module docstring for the protocol).

    ``now`` is any monotonic clock in seconds, the same for every call; ``timeout`` is
    how long the search may take from ``now``.
    """

    def __init__(
        self,
        *,
        key: str,
        me: MemberInfo,
        config: MatchmakingConfig,
        now: float,
        timeout: float,
        expected: Iterable[Candidate] = (),
        new_round_id: Callable[[], bytes] = lambda: os.urandom(ROUND_ID_BYTES),
    ) -> None:
        self.key = key
        self.me = me
        self.config = config
        self.timeout = timeout
        self.deadline = now + timeout
        self.gather_deadline = now + min(config.gather_timeout, timeout / 2)
        self._own_reply_by = self.deadline - reply_margin(timeout)
        self._new_round_id = new_round_id
        self.role = Role.GATHERING
        self._view: dict[PeerID, Candidate] = {}
        self._ranks: dict[PeerID, bytes] = {}
        self._unavailable: set[PeerID] = set()
        self._held: dict[PeerID, _Held] = {}
        self._answers: list[tuple[PeerID, JoinAnswer]] = []
        self._leader: Candidate | None = None
        self._retry_at = 0.0
        self._next_poll = now
        self._reads = 0  # reads of the key that came back
        self._outcome: Formed | Failed | None = None
        self._last_problem = ""
        self.placed: tuple[PeerID, ...] = ()
        """Every peer placed in a group by this search (as leader: all groups)."""
        # Peers the caller knows search under this key now, or are about to (a training
        # swarm's progress records, which also say whether each can lead): seen before
        # any read of the key, so with all of them known the search joins its leader at
        # once. One not searching yet is asked again until the gather window ends.
        # Until a read of the key or a join shows one, an expected peer holds no leader
        # past the gather window: a record outlives a peer that died or was cut off.
        self._expected: set[PeerID] = set()
        self._unconfirmed: set[PeerID] = set()
        for candidate in expected:
            if candidate.peer_id != me.peer_id and len(self._expected) < MAX_GROUP_SIZE:
                self._expected.add(candidate.peer_id)
                self._see(candidate)
        self._unconfirmed = set(self._expected)

    # --- what the driver asks -------------------------------------------------------

    @property
    def leader(self) -> Candidate | None:
        return self._leader

    @property
    def num_held(self) -> int:
        return len(self._held)

    def confirmed(self, peer_id: PeerID) -> bool:
        """Whether a read of the key or a join showed ``peer_id`` searching (a peer only
        expected is not, yet). A join to a leader not confirmed should be given up at
        the end of the gather window if no read shows it by then
        (:meth:`on_leader_unconfirmed`): an expected peer may have died or been cut off
        silently."""
        return peer_id not in self._unconfirmed

    def take_answers(self) -> list[tuple[PeerID, JoinAnswer]]:
        """Answers for held joins that the latest events decided (each given once)."""
        answers, self._answers = self._answers, []
        return answers

    def next_action(self, now: float) -> Action:
        if self._outcome is not None:
            return self._outcome
        if self.role is Role.LEADING and self._should_form(now):
            return self._form()
        if now >= self.deadline:
            return self._fail(self._deadline_reason())
        if self.role is Role.GATHERING and (
            now >= self.gather_deadline or self._num_visible() >= self.config.target_group_size
        ):
            self._choose(now)
        if self.role is Role.LEADING and self._should_form(now):
            return self._form()
        if self.role is Role.FOLLOWING:
            assert self._leader is not None
            if now < self._retry_at:
                return Sleep(min(self._retry_at, self.deadline))
            return Join(self._leader)
        until = self.deadline
        if self.role is Role.LEADING:
            until = min(until, self._reply_by())
        if now >= self._next_poll:
            return Poll(until)
        wake = min(until, self._next_poll)
        if self.gather_deadline > now:  # gathering ends, or a leader may form, then
            wake = min(wake, self.gather_deadline)
        return Sleep(wake)

    # --- events -------------------------------------------------------------------

    def on_declarations(self, candidates: Iterable[Candidate], now: float) -> None:
        """What a read of the DHT key showed (declarations that failed to parse are the
        driver's to drop). A leader that now sees a better-ranked one hands over."""
        for candidate in candidates:
            self._see(candidate)
        self._reads += 1
        share = min(1.0, FIRST_REREAD_SHARE * 2 ** min(self._reads - 1, 16))
        self._next_poll = now + share * self.config.poll_interval_seconds
        if self.role is Role.FOLLOWING and self._leader is not None:
            seen = self._view.get(self._leader.peer_id)
            if seen is not None and not seen.can_lead:
                # Its record said it could lead; its declaration says it cannot now
                # (its NAT turned out not punchable): choose again.
                self._choose(now)
        if self.role is Role.LEADING:
            best = self._best()
            if best is not None and best.peer_id != self.me.peer_id:
                self._follow(best, now)

    def on_poll_failed(self, now: float, problem: str) -> None:
        self._last_problem = f"reading the DHT failed: {problem}"
        self._next_poll = now + self.config.poll_interval_seconds

    def on_join(
        self,
        member: MemberInfo,
        now: float,
        caller_timeout: float | None,
        expected_size: int = 0,
    ) -> JoinAnswer | None:
        """A peer asks to join us. Returns the answer now, or None: the join is held
        until :meth:`take_answers` yields its answer (or it is abandoned)."""
        if self.role is Role.DONE:
            return Refused(f"already stopped searching under key {self.key!r}", self.placed)
        if member.peer_id == self.me.peer_id:
            return Refused("a peer cannot join itself")
        self._see(member.candidate())
        self._unavailable.discard(member.peer_id)
        if self.role is Role.FOLLOWING:
            assert self._leader is not None
            return Redirect(self._leader)
        # The joiner chose to follow, so it is no leader candidate (were it one, it
        # would be sent to itself).
        best = self._best(excluding=member.peer_id)
        if best is None:
            return Refused("this peer cannot lead: it accepts no connections")
        if best.peer_id != self.me.peer_id:
            return Redirect(best)
        if member.peer_id not in self._held and len(self._held) >= MAX_PENDING_JOINS:
            return Refused(f"already holding {MAX_PENDING_JOINS} joins under key {self.key!r}")
        if caller_timeout is None:
            reply_by = self._own_reply_by
        else:
            reply_by = now + caller_timeout - reply_margin(caller_timeout)
            # A joiner cannot make us decide before the gather window ends (one with a
            # tiny timeout would otherwise cut every round short); it leaves instead.
            reply_by = min(max(reply_by, self.gather_deadline), self._own_reply_by)
        self._held[member.peer_id] = _Held(member, reply_by, expected_size)
        return None

    def on_join_abandoned(self, peer_id: PeerID, now: float) -> None:
        """A held joiner hung up (gave up, died, or joined again elsewhere)."""
        if self._held.pop(peer_id, None) is not None:
            self._unavailable.add(peer_id)

    def on_join_result(
        self, leader: PeerID, answer: JoinAnswer | None, now: float, problem: str = ""
    ) -> None:
        """Our join to ``leader`` ended: with ``answer``, or None if the call failed
        (unreachable, timed out, a malformed reply; ``problem`` says which)."""
        if self.role is not Role.FOLLOWING or self._leader is None:
            return
        if leader != self._leader.peer_id:
            return
        if answer is None:
            self._drop(leader, f"leader {leader} failed: {problem}", now)
        elif isinstance(answer, Placed):
            self._accept(answer.group)
        elif isinstance(answer, Rejected):
            self._fail(f"leader {leader} formed the groups without us: {answer.reason}")
        elif isinstance(answer, Refused) and answer.not_searching and leader in self._expected:
            if now < self.gather_deadline:
                self._retry_at = now + self.config.poll_interval_seconds  # it comes: again
            else:
                self._forget(leader, f"expected leader {leader} was not searching", now)
        elif isinstance(answer, Refused):
            for peer_id in answer.finished[:MAX_VIEW]:
                if peer_id != self.me.peer_id:
                    self._unavailable.add(peer_id)
            self._drop(leader, f"leader {leader} refused: {answer.reason}", now)
        else:
            self._redirected(leader, answer.to, now)

    def on_leader_unconfirmed(self, leader: PeerID, now: float) -> None:
        """The driver gave up our join to ``leader``, a peer only expected: no read of
        the key showed it searching by the end of the gather window (it died, or its
        link was cut, silently). It is forgotten, not marked gone: should it start
        searching after all, a read shows it again (and a leader hands over to it)."""
        if self.role is Role.FOLLOWING and self._leader is not None:
            if self._leader.peer_id == leader and leader in self._unconfirmed:
                self._forget(leader, f"expected leader {leader} never showed searching", now)

    # --- internals ----------------------------------------------------------------

    def _forget(self, peer_id: PeerID, problem: str, now: float) -> None:
        """Drop an expected peer from the view (unlike :meth:`_drop`, not as gone: a
        later read may show it), and choose again."""
        self._view.pop(peer_id, None)
        self._expected.discard(peer_id)
        self._unconfirmed.discard(peer_id)
        self._choose_again(problem, now)

    def _rank(self, peer_id: PeerID) -> bytes:
        found = self._ranks.get(peer_id)
        if found is None:
            found = self._ranks[peer_id] = rank(self.key, peer_id)
        return found

    def _see(self, candidate: Candidate, *, confirms: bool = True) -> None:
        if candidate.peer_id == self.me.peer_id:
            return
        if confirms:
            self._unconfirmed.discard(candidate.peer_id)
        if candidate.peer_id in self._view or len(self._view) < MAX_VIEW:
            self._view[candidate.peer_id] = candidate

    def _best(self, excluding: PeerID | None = None) -> Candidate | None:
        # A peer whose join we hold chose to follow us: never a leader candidate here.
        live = [
            c
            for c in self._view.values()
            if c.peer_id not in self._unavailable
            and c.peer_id not in self._held
            and c.peer_id != excluding
        ]
        if self.me.candidate().can_lead:
            live.append(self.me.candidate())
        return min(
            (c for c in live if c.can_lead), key=lambda c: self._rank(c.peer_id), default=None
        )

    def _num_visible(self) -> int:
        return 1 + sum(1 for p in self._view if p not in self._unavailable)

    def _choose(self, now: float) -> None:
        best = self._best()
        if best is None:
            self.role = Role.GATHERING  # a client-mode peer that sees no leader: keep reading
            self._leader = None
        elif best.peer_id == self.me.peer_id:
            self.role = Role.LEADING
            self._leader = None
        else:
            self._follow(best, now)

    def _follow(self, leader: Candidate, now: float) -> None:
        self.role = Role.FOLLOWING
        self._leader = leader
        self._retry_at = now
        for peer_id in self._held:
            self._answers.append((peer_id, Redirect(leader)))
        self._held.clear()

    def _drop(self, leader: PeerID, problem: str, now: float) -> None:
        self._unavailable.add(leader)
        self._choose_again(problem, now)

    def _choose_again(self, problem: str, now: float) -> None:
        self._last_problem = problem
        if now >= self.deadline:  # too late to lead or follow anyone else
            self._fail(self._deadline_reason())
        else:
            self._choose(now)

    def _redirected(self, leader: PeerID, to: Candidate, now: float) -> None:
        if (
            to.peer_id == self.me.peer_id
            or not to.can_lead
            or self._rank(to.peer_id) >= self._rank(leader)
        ):
            # Redirects point to a strictly better rank, which rules out cycles.
            self._drop(leader, f"leader {leader} sent an invalid redirect to {to.peer_id}", now)
        elif to.peer_id in self._unavailable:
            # The leader follows a peer we know is gone; it will notice soon: ask again.
            self._retry_at = now + self.config.poll_interval_seconds
        else:
            # A redirect says the leader follows it, not that it is searching: a peer
            # only expected stays unconfirmed until a read or a join shows it.
            self._see(to, confirms=False)
            self._choose(now)

    def _reply_by(self) -> float:
        return min([self._own_reply_by, *(h.reply_by for h in self._held.values())])

    def _expected_sizes(self) -> list[int]:
        return [min(h.expected_size, MAX_GROUP_SIZE) for h in self._held.values()]

    def _should_form(self, now: float) -> bool:
        if now >= self._reply_by():
            return True
        if self.config.form_when_full and (self._reads or not self._expected):
            # Joiners may expect more peers than we saw (our view lags): wait for the
            # largest expectation, so that no smaller group forms under their feet. A
            # leader chosen from expected peers alone first reads the key once: should
            # its caller's view have missed a peer that is searching, the read shows it
            # (and a better-ranked one takes over) before a group forms without it.
            expected = max([self.config.target_group_size, *self._expected_sizes()])
            if 1 + len(self._held) >= expected:
                return True
        if now < self.gather_deadline or 1 + len(self._held) < self.config.min_group_size:
            return False
        return all(
            p in self._held or p in self._unavailable or p in self._unconfirmed for p in self._view
        )

    def _form(self) -> Formed | Failed:
        members = [self.me, *(h.member for h in self._held.values())]
        # The size waited for is the size planned: a joiner expecting more peers than
        # our own target (our view lagged) must not see the group it waited in cut in
        # two under it, each half averaging alone.
        size = self.config.target_group_size
        if self.config.form_when_full:
            size = max([size, *self._expected_sizes()])
        self._held.clear()
        groups, left_over = plan_groups(members, size, self.config.min_group_size)
        if not groups:
            reason = (
                f"only {len(members)} peer(s) joined by the deadline "
                f"(min_group_size {self.config.min_group_size})"
            )
            for member in members[1:]:
                self._answers.append((member.peer_id, Rejected(reason)))
            return self._fail(reason)
        mine: Group | None = None
        for chosen in groups:
            round_id = self._new_round_id()
            group = Group.of(self.key, round_id, group_order(round_id, chosen))
            for member in chosen:
                if member.peer_id == self.me.peer_id:
                    mine = group
                else:
                    self._answers.append((member.peer_id, Placed(group)))
        reason = (
            f"{len(members)} peers joined: {len(left_over)} left over after forming "
            f"{len(groups)} group(s) of {self.config.min_group_size} to {size}"
        )
        for member in left_over:
            self._answers.append((member.peer_id, Rejected(reason)))
        self.placed = tuple(m.peer_id for chosen in groups for m in chosen)
        assert mine is not None  # the leader seeds the first group
        self.role = Role.DONE
        self._outcome = Formed(mine)
        return self._outcome

    def _accept(self, group: Group) -> None:
        if group.key != self.key or group.members.count(self.me.peer_id) != 1:
            self._fail("the leader sent a group that does not hold us exactly once")
        elif len(group) < self.config.min_group_size:
            self._fail(
                f"the leader formed a group of {len(group)}, below our min_group_size "
                f"{self.config.min_group_size}"
            )
        else:
            self.placed = group.members
            self.role = Role.DONE
            self._outcome = Formed(group)

    def _fail(self, reason: str) -> Failed:
        for peer_id in self._held:
            self._answers.append(
                (peer_id, Refused(f"stopped searching under key {self.key!r}: {reason}"))
            )
        self._held.clear()
        self.role = Role.DONE
        self._outcome = Failed(reason)
        return self._outcome

    def _deadline_reason(self) -> str:
        if self.role is Role.FOLLOWING and self._leader is not None:
            state = f"leader {self._leader.peer_id} had not answered"
        elif self._best() is None:
            state = "no peer that accepts connections was searching"
        else:
            state = f"{self._num_visible()} peer(s) visible"
        reason = f"timed out after {self.timeout:.1f} s; {state}"
        if self._last_problem:
            reason += f" (last problem: {self._last_problem})"
        return reason
