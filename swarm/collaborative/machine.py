"""When a collaborative optimizer waits, averages, steps or resyncs: a pure state machine.

:class:`StepMachine` holds what one peer knows of its run (its epoch and samples, the
swarm's progress records, its own round history) and turns events into decisions. It
does no I/O, reads no clock and touches no tensor: every event carries ``now`` (the DHT's
clock), and the driver (:class:`swarm.collaborative.optimizer.CollaborativeOptimizer`)
carries out each decision and reports its outcome. So late joins, split swarms, DiLoCo's
outer steps and churn are tested by feeding records and times
(``tests/swarm/test_step_machine.py``), without processes or sleeps.

The events, in a step's order:

1. :meth:`StepMachine.batch` (a local batch of ``n`` samples; ``n == 0``: nothing to add,
   wait for the swarm's step) returns :class:`Resync` when the swarm left this peer
   behind or stepped on another branch, else the policy's answer: :class:`Train` (go on
   with the next batch), :class:`Wait` (for the others, until a deadline; call
   :meth:`StepMachine.poll` when records change or the deadline passes) or
   :class:`Average`.
2. After :class:`Average`, the driver builds the update (the mean gradient, or DiLoCo's
   parameter change), averages it with a group (or not: ``alone``) and reports
   :meth:`StepMachine.round_ended` with a :class:`RoundOutcome`: the answer is
   :class:`Step` (apply the averaged update, then :meth:`StepMachine.finish_epoch`) or
   :class:`Resync`.
3. After :class:`Resync`, the driver downloads state and reports
   :meth:`StepMachine.loaded` or :meth:`StepMachine.load_failed`.

Overlapped DiLoCo (``overlap``): after :class:`Average` the driver may start the round
and report :meth:`StepMachine.launched` instead of waiting for it; training goes on, the
epoch stays until the round's outcome is reported (:meth:`StepMachine.round_ended`, as
above), which the driver does when :meth:`StepMachine.round_due` says so: at the latest
before the batch that ends the next outer step's inner steps.

Two policies decide when to average: :class:`GradientPolicy` (hivemind.Optimizer's
model: when the swarm's samples reach the global batch) and :class:`DiLoCoPolicy` (every
``inner_steps`` local steps, once the others in the epoch are done with theirs).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from peers.identity import PeerID
from swarm.collaborative.progress import PeerProgress, SwarmProgress, split_winner, summarize

#: Seconds over which a peer's own throughput is measured before it is published.
RATE_WINDOW_SECONDS = 1.0
#: After a state download for a swarm ahead failed, seconds before the next try; each
#: failure in a row doubles it, up to :data:`MAX_LOAD_RETRY_SECONDS`. Without it, a peer
#: whose donors could not agree on a state tried again on every batch: hundreds of
#: futile downloads a second, each asking every donor.
LOAD_RETRY_SECONDS = 1.0
MAX_LOAD_RETRY_SECONDS = 16.0
#: The reason of a :class:`Wait` for the next try of a state download.
RETRY_WAIT = "the next try of a state download"


def chain_fingerprint(branch: bytes, round_fingerprint: bytes) -> bytes:
    """The branch a peer is on after an agreed round: the round's fingerprint, folded
    with the branch it came from (none before its first round, or after a restart).

    Members of one round hold one tensor afterwards, but they hold one *model* only if
    they held one before. Should a round split (each group stepped with its own
    average: two branches) and the next round take in both groups, the round's
    fingerprint alone would be the same for all of them, and :func:`split_winner`
    would never see the split again while each group applied the same update to its
    own model. Folded with the branch, the two groups' fingerprints differ after that
    round too, and the smaller group follows the larger. (Seen: a four-peer run ended
    as two pairs 25% apart in loss, every counter clean.)"""
    if not branch:
        return round_fingerprint
    return hashlib.sha256(b"branch\0" + branch + round_fingerprint).digest()[:16]


@dataclass(frozen=True, slots=True)
class Train:
    """Nothing to do with the swarm now: train the next batch."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait for the others' progress, until ``deadline`` (DHT time) at the latest, then
    call :meth:`StepMachine.poll`; sooner whenever new records arrive."""

    deadline: float
    reason: str
    """What is waited for, for logs: "the global batch", "the outer step"."""
    since: float
    """When the wait began (DHT time): its length counts in ``Counts.wait_seconds``."""


@dataclass(frozen=True, slots=True)
class Average:
    """Build this epoch's update and average it in a round of ``epoch`` with a group of
    ``group_size`` (this peer included), weighted by ``weight``; or, when ``alone``
    (nobody else is live), report ``RoundOutcome(ALONE)`` without a round."""

    epoch: int
    weight: float
    group_size: int
    alone: bool
    expected: tuple[tuple[PeerID, tuple[str, ...]], ...] = ()
    """The others expected in the round whose records say where they are reached (their
    ``contact``, empty if they cannot lead): matchmaking joins their leader without
    reading the round's declarations first."""


@dataclass(frozen=True, slots=True)
class Step:
    """Apply the (averaged) update, then call :meth:`StepMachine.finish_epoch`."""


@dataclass(frozen=True, slots=True)
class Resync:
    """Download the swarm's state (from ``donors`` if given, of the branch ``fingerprint``
    names) and report :meth:`StepMachine.loaded` or :meth:`StepMachine.load_failed`.
    ``drop_update``: an update was built and averaged (or refused) already; whatever
    the load does, it is gone (clear the buffers that held it)."""

    reason: str
    donors: tuple[PeerID, ...] | None = None
    fingerprint: bytes | None = None
    drop_update: bool = False
    unusual: bool = False
    """Worth a warning (a split swarm, a non-finite update), not routine (a late join)."""


Decision = Train | Wait | Average | Step | Resync


class Round(Enum):
    """How an averaging attempt ended."""

    AGREED = "agreed"
    """The group agreed on the result; every coordinate was averaged."""
    NOT_AGREED = "not agreed"
    """A group formed, but its result was withdrawn or incomplete."""
    NO_GROUP = "no group"
    """No group formed in time."""
    ALONE = "alone"
    """Nobody else was live: no round was tried."""
    NON_FINITE = "non-finite"
    """This peer's update held NaN or infinity: it was never sent."""


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    kind: Round
    fingerprint: bytes = b""
    """Of the agreed result (``AGREED`` only): peers that stepped together share it."""
    bytes_sent: int = 0
    matchmaking_seconds: float = 0.0
    """Forming the group, for a round that formed one."""
    allreduce_seconds: float = 0.0
    """The all-reduce, from the group's forming to the agreed result."""
    spread: float = 0.0
    """Largest difference between reducers' copies of one coordinate."""


@dataclass(slots=True)
class Counts:
    """What happened to this peer's steps so far (its ``OptimizerStatistics``)."""

    local_steps: int = 0
    local_samples: int = 0
    rounds: int = 0
    alone: int = 0
    loads: int = 0
    splits: int = 0
    not_agreed: int = 0
    no_group: int = 0
    bytes_sent: int = 0
    matchmaking_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    wait_seconds: float = 0.0
    late_round_seconds: float = 0.0
    reducer_spread: float = 0.0

    @property
    def round_seconds(self) -> float:
        return self.matchmaking_seconds + self.allreduce_seconds


class Policy(Protocol):
    """When to average: called by the machine with its state up to date."""

    def after_batch(self, machine: StepMachine, samples: int, now: float) -> Decision:
        """A local batch of ``samples`` (0: nothing new, wait for the swarm's step) was
        taken; the machine is in its epoch and on the swarm's branch."""
        ...

    def poll(self, machine: StepMachine, wait: Wait, now: float) -> Decision:
        """Records changed or ``wait``'s deadline passed."""
        ...


class GradientPolicy:
    """Average gradients when the swarm's samples reach the global batch. A peer that has
    its share (the global batch over the live peers) waits, a bounded time, for the
    others to fill theirs rather than run ahead: the step then averages the batch the
    config asks for, as one big machine would. Past the deadline it goes on training
    (its extra samples still count). A peer with no samples in the epoch never enters
    its round: it has nothing to average, and the others would wait for it; it waits
    for their step instead, and then resyncs."""

    def after_batch(self, machine: StepMachine, samples: int, now: float) -> Decision:
        machine.samples += samples
        view = machine.view(now)
        if view.ready and machine.samples:
            return machine.begin_average(view, now)
        share = machine.target_batch_size // max(view.num_peers, 1)
        if machine.samples < share and samples:
            return Train()
        return Wait(now + machine.max_wait_seconds, "the global batch", now)

    def poll(self, machine: StepMachine, wait: Wait, now: float) -> Decision:
        view = machine.view(now)
        if view.ready and machine.samples:
            return machine.begin_average(view, now)
        if view.epoch > machine.epoch or now >= wait.deadline:
            return Train()  # left behind (the next batch resyncs), or tired of waiting
        return wait


class DiLoCoPolicy:
    """Average the parameter change every ``inner_steps`` local steps. Before it does, it
    waits (a bounded time) until every live peer of its epoch finished its inner steps
    too, so that all of them enter the same round."""

    def __init__(self, inner_steps: int) -> None:
        self.inner_steps = inner_steps

    def after_batch(self, machine: StepMachine, samples: int, now: float) -> Decision:
        if not samples:  # DiLoCo's peers never wait for a global batch
            return Train()
        machine.samples += samples
        machine.inner_steps += 1
        if not self.ends_outer_step(machine.inner_steps):
            return Train()
        machine.averaging = True
        return self.poll(machine, Wait(now + machine.max_wait_seconds, "the outer step", now), now)

    def ends_outer_step(self, inner_steps: int) -> bool:
        """Whether the local step numbered ``inner_steps`` (from 1) ends an outer step."""
        return inner_steps % self.inner_steps == 0

    def poll(self, machine: StepMachine, wait: Wait, now: float) -> Decision:
        me = machine.me
        busy = [
            r
            for p, r in machine.records.items()
            if p != me
            and now - r.time <= machine.progress_expiration
            and r.epoch == machine.epoch
            and not r.averaging
        ]
        if busy and now < wait.deadline:
            return wait
        # Every member trains in DiLoCo, so every one is expected in the round, also one
        # whose record, read a while ago, shows it an epoch or two behind: outer steps can
        # follow each other faster than records travel (a small model's inner steps take
        # milliseconds), and counting only the records that show this epoch formed groups
        # without a member that was right behind, which then searched alone until the
        # search timed out. A member truly behind costs the gather window once (it
        # resyncs when it sees the swarm ahead).
        return machine.begin_average(machine.view(now), now, at_least=len(machine.members(now)))


@dataclass
class StepMachine:
    """One peer's view of its run and the decisions that follow from it."""

    me: PeerID
    policy: Policy
    target_batch_size: int
    progress_expiration: float
    max_wait_seconds: float
    overlap: bool = False
    """DiLoCo's rounds run while training goes on (:meth:`launched`)."""

    epoch: int = 0
    samples: int = 0
    """Samples added toward the update that ends ``epoch``."""
    inner_steps: int = 0
    """DiLoCo: local steps since the run began (or the last state load)."""
    averaging: bool = False
    """This peer started averaging for ``epoch``: the others should join its round."""
    fingerprint: bytes = b""
    """Of the round that ended the previous epoch."""
    expect: int = 1
    """Peers this one waits for before the run's first step (published)."""
    contact: tuple[str, ...] | None = None
    """Where this peer's group searches are reached (published in its record; None: not
    known yet, published without it)."""
    records: dict[PeerID, PeerProgress] = field(default_factory=dict)
    """Everyone's last progress records, as read from the DHT (maybe stale)."""
    counts: Counts = field(default_factory=Counts)
    samples_per_second: float = 0.0
    refused_branches: set[bytes] = field(default_factory=set)
    """Branches whose state could not be had: identities claiming one are no majority."""
    in_flight: int | None = None
    """Overlap: the samples of the round in flight (launched, outcome not yet
    reported); those added since belong to the next epoch. None: no round in flight."""
    _rate_since: float | None = None
    _load_failures: int = 0
    """State downloads for a swarm ahead that failed in a row."""
    _retry_at: float = 0.0
    """When the next download for a swarm ahead may be tried."""
    _rate_samples: int = 0
    _last_view: SwarmProgress | None = None

    # --- events -------------------------------------------------------------------------

    def batch(self, samples: int, now: float) -> Decision:
        """A local batch of ``samples`` was computed (its gradients are in the model);
        0: nothing new to add, wait for the swarm's step."""
        if samples:
            self.counts.local_steps += 1
            self.counts.local_samples += samples
            self._measure(samples, now)
        view = self.view(now)
        if view.epoch > self.epoch:
            if now >= self._retry_at:
                return Resync(f"the swarm is at epoch {view.epoch}")
            # The last download failed: train on (a DiLoCo step, or samples a load will
            # drop) until the next try; nothing to add: wait for it.
            return Train() if samples else Wait(self._retry_at, RETRY_WAIT, now)
        split = self._follow_majority(now, "the swarm split")
        if split is not None:
            return split
        return self.policy.after_batch(self, samples, now)

    def poll(self, wait: Wait, now: float) -> Decision:
        """New records arrived while waiting, or ``wait.deadline`` passed."""
        if wait.reason == RETRY_WAIT:
            decision: Decision = wait if now < wait.deadline else Train()
        else:
            decision = self.policy.poll(self, wait, now)
        if decision is not wait:
            self.counts.wait_seconds += now - wait.since
        return decision

    def launched(self) -> None:
        """Overlap: the driver started the round :class:`Average` asked for and trains on;
        it reports :meth:`round_ended` later, when :meth:`round_due` says so."""
        if not self.overlap or self.in_flight is not None:
            raise RuntimeError("launched: not overlapping, or a round is in flight already")
        self.in_flight = self.samples

    @property
    def phase(self) -> int:
        """The epoch this peer's samples count toward now: ``epoch``, or the next one
        while the round ending ``epoch`` is in flight."""
        return self.epoch + (self.in_flight is not None)

    def round_due(self, ended: bool, samples: int, now: float) -> bool:
        """Overlap, a round in flight: whether the driver must report its outcome (and
        wait for it if it has not ``ended``) before a batch of ``samples`` is counted:
        it ended; or the batch ends the next outer step's inner steps (a round is at
        most one outer step late, and there is never a second in flight); or a peer
        of the swarm has taken it in already (its epoch is past ours: counting the
        batch first would call this peer behind and resync it)."""
        if ended:
            return True
        if (
            samples
            and isinstance(self.policy, DiLoCoPolicy)
            and self.policy.ends_outer_step(self.inner_steps + 1)
        ):
            return True
        return self.view(now).epoch > self.epoch

    def round_ended(self, outcome: RoundOutcome, now: float) -> Step | Resync:
        """The averaging that :class:`Average` asked for ended."""
        decision = self._round_ended(outcome, now)
        if isinstance(decision, Resync):
            self.in_flight = None  # (its update is dropped; what came after it stays)
        return decision

    def _round_ended(self, outcome: RoundOutcome, now: float) -> Step | Resync:
        if outcome.kind in (Round.AGREED, Round.NOT_AGREED):
            self.counts.rounds += 1
            self.counts.bytes_sent += outcome.bytes_sent
            self.counts.matchmaking_seconds += outcome.matchmaking_seconds
            self.counts.allreduce_seconds += outcome.allreduce_seconds
            self.counts.reducer_spread = outcome.spread
        if outcome.kind is Round.AGREED:
            self.fingerprint = chain_fingerprint(self.fingerprint, outcome.fingerprint)
            return Step()
        if outcome.kind is Round.ALONE:
            return self._step_alone()
        if outcome.kind is Round.NO_GROUP:
            if self.view(now).num_peers <= 1:
                return self._step_alone()
            self.counts.no_group += 1
            return self._drop_update("no group formed while other peers are live")
        if outcome.kind is Round.NOT_AGREED:
            # Withdrawn, or ended at its deadline: what this peer holds is not what the
            # others hold. Take their state rather than drift apart silently.
            self.counts.not_agreed += 1
            return self._drop_update("the round was not agreed")
        # A diverged model or a bad batch: sending it would poison (or, the round
        # refusing it, stall) everyone. Dropped; the swarm's state is taken instead.
        return self._drop_update("this peer's update holds NaN or infinity", unusual=True)

    def settled(self, now: float) -> Resync | Wait | None:
        """At the end of a run (this peer took its last step): ``None`` once every live
        peer of the run is at this epoch on this branch; a :class:`Resync` to the
        majority when the last epoch split (as after a batch); else a :class:`Wait` for
        the others, whose last round may have failed: a laggard loads the state of a
        peer still serving it instead of stepping alone into a model of its own."""
        split = self._follow_majority(now, "the last epoch split")
        if split is not None:
            return split
        live = self.live(now)
        behind = [r for p, r in live.items() if p != self.me and r.epoch < self.epoch]
        elsewhere = [
            r
            for p, r in live.items()
            if p != self.me
            and r.epoch == self.epoch
            and r.fingerprint not in (self.fingerprint, b"")  # (b"": no round yet, no branch)
            and r.fingerprint not in self.refused_branches
        ]
        if behind or elsewhere:
            return Wait(now + self.max_wait_seconds, "the others to finish", now)
        return None

    def finish_epoch(self) -> None:
        """The update was applied: the epoch is over. Overlap: the samples added since
        the round's launch count toward the new epoch."""
        self.epoch += 1
        self.averaging = False
        self.samples = 0 if self.in_flight is None else self.samples - self.in_flight
        self.in_flight = None

    def loaded(self, epoch: int, fingerprint: bytes) -> None:
        """The driver loaded the swarm's state of ``epoch``, of branch ``fingerprint``."""
        self.epoch = epoch
        self.fingerprint = fingerprint
        self.samples = 0
        if not self.overlap:  # (overlap: a load comes mid-way through the inner steps,
            self.inner_steps = 0  # which the others go on counting from where they are)
        self.averaging = False
        self.in_flight = None
        self.counts.loads += 1
        self._load_failures, self._retry_at = 0, 0.0
        self.refused_branches.clear()

    def abandoned(self) -> None:
        """Overlap: the round in flight was given up before its outcome was known (this
        peer resyncs or restarts): its update is dropped."""
        self.in_flight = None
        self.averaging = False

    def load_failed(self, resync: Resync, now: float) -> None:
        """No state could be had for ``resync``: this peer goes on with its own, and
        tries a swarm ahead again only after a pause (:data:`LOAD_RETRY_SECONDS`,
        doubling with each failure in a row)."""
        if resync.fingerprint is not None:
            self.refused_branches.add(resync.fingerprint)
        self.averaging = False
        pause = min(LOAD_RETRY_SECONDS * 2**self._load_failures, MAX_LOAD_RETRY_SECONDS)
        self._load_failures += 1
        self._retry_at = now + pause

    def restarted(self, epoch: int) -> None:
        """The epoch was set from outside (a ``state_dict``): start it afresh, on no
        known branch (the model came from elsewhere: a checkpoint)."""
        self.epoch = epoch
        self.fingerprint = b""
        self.samples = 0
        self.inner_steps = 0
        self.averaging = False
        self.in_flight = None

    # --- the view ----------------------------------------------------------------------

    def mine(self, now: float) -> PeerProgress:
        """This peer's progress record as it should be published now."""
        return PeerProgress(
            self.epoch,
            self.samples,
            self.samples_per_second,
            now,
            self.averaging,
            self.fingerprint,
            self.expect,
            self.contact,
        )

    def view(self, now: float) -> SwarmProgress:
        """The swarm's progress as this peer sees it (:func:`summarize`)."""
        self._last_view = summarize(
            self.records,
            self.me,
            self.mine(now),
            self.target_batch_size,
            now=now,
            expiration_seconds=self.progress_expiration,
        )
        return self._last_view

    def last_view(self, now: float) -> SwarmProgress:
        """The view of the last decision (a fresh one if none was taken)."""
        return self._last_view or self.view(now)

    def live(self, now: float) -> dict[PeerID, PeerProgress]:
        """Live peers' records (not expired), this peer's own as of ``now`` included."""
        live = {
            p: r
            for p, r in self.records.items()
            if p != self.me and now - r.time <= self.progress_expiration
        }
        live[self.me] = self.mine(now)
        return live

    def members(self, now: float) -> list[PeerID]:
        """The live peers of the run, this one included, except those claiming an epoch
        ahead of ours: who shares the next global batch. A peer truly ahead stepped
        without us (we resync), and one that only claims it would hold a slot it never
        fills."""
        return sorted(p for p, r in self.live(now).items() if r.epoch <= self.epoch)

    def delivered(self, now: float) -> set[PeerID]:
        """Members whose record shows samples added, or a round started, in this peer's
        epoch or a later one: their slot of this epoch's batch is not to be filled for
        them. An epoch number alone is no such evidence: a member that never trains can
        claim whatever epoch it reads, and one truly past ours stepped without us (we
        resync; filling its slot meanwhile costs nothing but the work)."""
        return {
            p
            for p, r in self.live(now).items()
            if r.epoch >= self.epoch and (r.samples or r.averaging)
        }

    def working(self, now: float, within: float) -> set[PeerID]:
        """Members whose progress record is at most ``within`` seconds old: alive and
        publishing, so busy with their part rather than gone (their record stops)."""
        return {p for p, r in self.live(now).items() if now - r.time <= within}

    def expected_group(self, now: float) -> int:
        """Peers expected in this epoch's round, me included: the live ones in this epoch
        that added samples to it or started averaging, and those whose last record shows
        them averaging the previous epoch's round (a record read before they published
        their step: they come). A member that delivered nothing has no part in the round
        (its slot was filled by others) and does not come: counting it would make every
        round wait out the gather window for it. Counting too few is worse: the first
        members to meet form a group of that size and the round splits."""
        return 1 + len(self._expected_others(now))

    def _expected_others(self, now: float) -> dict[PeerID, PeerProgress]:
        """The others :meth:`expected_group` counts, with their records."""
        return {
            p: r
            for p, r in self.live(now).items()
            if p != self.me
            and (
                (r.epoch == self.epoch and (r.samples or r.averaging))
                or (r.epoch == self.epoch - 1 and r.averaging)
            )
        }

    def everyone_present(self, now: float) -> bool:
        """Before the run's first step: as many live peers as any of them waits for, or
        one of them has stepped already."""
        live = self.live(now)
        wanted = max((r.expect for r in live.values() if r.epoch == 0), default=1)
        return len(live) >= wanted or any(r.epoch > 0 for r in live.values())

    def begin_average(self, view: SwarmProgress, now: float, *, at_least: int = 0) -> Average:
        """This peer enters its epoch's round now (policies call it), expecting
        :meth:`expected_group` peers, or ``at_least``."""
        self.averaging = True
        others = self._expected_others(now)
        return Average(
            epoch=self.epoch,
            weight=float(max(self.samples, 1)),
            group_size=max(1 + len(others), at_least, 2),
            alone=view.num_peers <= 1,
            expected=tuple(
                (p, r.contact) for p, r in sorted(others.items()) if r.contact is not None
            ),
        )

    # --- internals ---------------------------------------------------------------------

    def _step_alone(self) -> Step:
        # A fingerprint of its own: should another peer have stepped this epoch too (we
        # did not see it in time), the two branches differ and split detection makes one
        # follow the other instead of drifting apart unseen.
        self.counts.alone += 1
        digest = hashlib.sha256(b"alone\0" + self.me.to_bytes())
        digest.update(self.epoch.to_bytes(8, "big"))
        self.fingerprint = digest.digest()[:16]
        return Step()

    def _follow_majority(self, now: float, what: str) -> Resync | None:
        """A resync to the majority's branch if peers of my epoch are on another one
        (whose state was not refused already)."""
        branch = split_winner(
            self.records,
            self.me,
            self.mine(now),
            now=now,
            expiration_seconds=self.progress_expiration,
        )
        if branch is None or branch[0] in self.refused_branches:
            return None
        self.counts.splits += 1
        return Resync(
            f"{what}; following the majority",
            donors=tuple(branch[1]),
            fingerprint=branch[0],
            unusual=True,
        )

    def _drop_update(self, reason: str, *, unusual: bool = False) -> Resync:
        self.samples = 0
        return Resync(reason, drop_update=True, unusual=unusual)

    def _measure(self, samples: int, now: float) -> None:
        if self._rate_since is None:
            self._rate_since = now
        self._rate_samples += samples
        elapsed = now - self._rate_since
        if elapsed >= RATE_WINDOW_SECONDS:
            self.samples_per_second = self._rate_samples / elapsed
            self._rate_since, self._rate_samples = now, 0
