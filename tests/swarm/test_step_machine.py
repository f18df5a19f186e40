"""The collaborative optimizer's decisions, fed records and times: no process, no socket,
no sleep. Late joins, split swarms, DiLoCo's outer steps, churn and failed rounds."""

from __future__ import annotations

import pytest

from peers import KeyPair, PeerID
from swarm.collaborative.machine import (
    Average,
    DiLoCoPolicy,
    GradientPolicy,
    Policy,
    Resync,
    Round,
    RoundOutcome,
    Step,
    StepMachine,
    Train,
    Wait,
)
from swarm.collaborative.progress import PeerProgress

TARGET = 64
EXPIRATION = 10.0
MAX_WAIT = 2.0
T0 = 1000.0
AGREED = RoundOutcome(
    Round.AGREED,
    fingerprint=b"f" * 16,
    bytes_sent=100,
    matchmaking_seconds=0.2,
    allreduce_seconds=0.3,
)


def _ids(n: int) -> list[PeerID]:
    return [KeyPair.generate().peer_id for _ in range(n)]


def _machine(policy: Policy | None = None, *, overlap: bool = False) -> StepMachine:
    return StepMachine(
        me=_ids(1)[0],
        policy=policy or GradientPolicy(),
        target_batch_size=TARGET,
        progress_expiration=EXPIRATION,
        max_wait_seconds=MAX_WAIT,
        overlap=overlap,
    )


def _record(
    epoch: int = 0,
    samples: int = 0,
    *,
    at: float = T0,
    averaging: bool = False,
    fingerprint: bytes = b"",
    contact: tuple[str, ...] | None = None,
) -> PeerProgress:
    return PeerProgress(epoch, samples, 10.0, at, averaging, fingerprint, contact=contact)


def test_a_peer_trains_until_its_share_then_waits_then_averages_with_who_delivered() -> None:
    m = _machine()
    a, b, idle = _ids(3)
    m.records = {a: _record(samples=16), b: _record(samples=16), idle: _record()}
    assert m.batch(8, T0) == Train()  # 8 of its share of 64 / 4 peers
    wait = m.batch(8, T0 + 0.1)  # its share is done; the swarm holds 48 of 64
    assert isinstance(wait, Wait) and wait.deadline == T0 + 0.1 + MAX_WAIT
    assert m.poll(wait, T0 + 0.2) is wait  # nothing new
    assert m.counts.wait_seconds == 0.0  # still waiting: not counted yet
    m.records[a] = _record(samples=32, at=T0 + 0.3)
    average = m.poll(wait, T0 + 0.3)
    assert m.counts.wait_seconds == pytest.approx(0.2)  # from the wait's start to its end
    # the idle peer delivered nothing: it is not expected in the round
    assert average == Average(epoch=0, weight=16.0, group_size=3, alone=False)
    assert m.averaging and m.mine(T0 + 0.3).averaging
    assert m.round_ended(AGREED, T0 + 1) == Step()
    m.finish_epoch()
    assert (m.epoch, m.samples, m.averaging, m.fingerprint) == (1, 0, False, b"f" * 16)
    assert (m.counts.rounds, m.counts.bytes_sent) == (1, 100)
    assert (m.counts.matchmaking_seconds, m.counts.allreduce_seconds) == (0.2, 0.3)
    assert m.counts.round_seconds == pytest.approx(0.5)


def test_a_split_stays_visible_after_a_round_that_takes_in_both_branches() -> None:
    """Epoch 0's round split in two groups, each stepping with its own average; epoch 1's
    round took in all four. Its fingerprint is one, their models two: the branch each
    came from is folded in, so each pair sees the other pair as another branch of its
    epoch, and the tie goes to one side (the smaller fingerprint): the other resyncs."""
    machines = [_machine() for _ in range(4)]
    for m, group in zip(machines, (b"a", b"a", b"b", b"b"), strict=True):
        m.round_ended(RoundOutcome(Round.AGREED, fingerprint=group * 16), T0)
        m.finish_epoch()
        m.round_ended(RoundOutcome(Round.AGREED, fingerprint=b"c" * 16), T0 + 1)
        m.finish_epoch()
    one, two = {m.fingerprint for m in machines[:2]}, {m.fingerprint for m in machines[2:]}
    assert len(one) == len(two) == 1 and one != two
    for m in machines:
        m.records = {o.me: o.mine(T0 + 2) for o in machines if o is not m}
    followed = [m._follow_majority(T0 + 2, "split") for m in machines]
    losers = [i for i, f in enumerate(followed) if isinstance(f, Resync)]
    assert losers in ([0, 1], [2, 3]), followed
    # A peer restarted from a checkpoint is on no known branch: after a round with the
    # others it is on a branch of its own, and follows them.
    restarted, survivor = machines[0], machines[2]
    restarted.restarted(2)
    assert restarted.fingerprint == b""
    restarted.round_ended(RoundOutcome(Round.AGREED, fingerprint=b"d" * 16), T0 + 3)
    survivor.round_ended(RoundOutcome(Round.AGREED, fingerprint=b"d" * 16), T0 + 3)
    assert restarted.fingerprint == b"d" * 16 != survivor.fingerprint


def test_a_peer_still_averaging_the_last_epoch_is_expected_in_this_round() -> None:
    """Its record was read before it published its step: it steps, trains and comes, so
    the round must not form without it."""
    m = _machine()
    m.restarted(3)
    late, idle, gone = _ids(3)
    m.records = {
        late: _record(2, 16, averaging=True),
        idle: _record(2, 16),  # behind, not averaging: it resyncs rather than comes
        gone: _record(3, 16, at=T0 - 2 * EXPIRATION, averaging=True),
    }
    m.records[_ids(1)[0]] = _record(3, 48, averaging=True)
    assert m.batch(16, T0) == Average(epoch=3, weight=16.0, group_size=3, alone=False)


def test_the_round_names_the_expected_peers_that_said_where_they_are_reached() -> None:
    """``Average.expected`` carries the others expected in the round with the contact
    their records give (empty: behind NAT, it cannot lead), for matchmaking to join the
    leader at once. A peer of an older version (no contact) is still counted in the
    group's size but left to the DHT's declarations; one not expected is not named.
    The peer's own record carries its contact."""
    m = _machine()
    m.contact = ("/ip4/198.18.0.9/tcp/4001",)
    a, natted, old, idle = sorted(_ids(4))
    m.records = {
        a: _record(samples=16, contact=("/ip4/198.18.0.2/tcp/4001",)),
        natted: _record(samples=16, contact=()),
        old: _record(samples=16),
        idle: _record(contact=("/ip4/198.18.0.5/tcp/4001",)),  # delivered nothing
    }
    average = m.batch(16, T0)
    assert isinstance(average, Average) and average.group_size == 4
    assert average.expected == ((a, ("/ip4/198.18.0.2/tcp/4001",)), (natted, ()))
    assert m.mine(T0).contact == ("/ip4/198.18.0.9/tcp/4001",)
    assert PeerProgress.from_wire(m.mine(T0).to_wire()) == m.mine(T0)


def test_past_the_deadline_a_peer_goes_on_and_its_extra_samples_count() -> None:
    m = _machine()
    (a,) = _ids(1)
    m.records = {a: _record(samples=0)}
    wait = m.batch(32, T0)
    assert isinstance(wait, Wait)
    assert m.poll(wait, wait.deadline) == Train()
    assert m.batch(32, T0 + 3) == Average(epoch=0, weight=64.0, group_size=2, alone=False)


def test_a_peer_that_started_averaging_pulls_the_others_in_once_half_the_batch_is_there() -> None:
    m = _machine()
    (a,) = _ids(1)
    m.records = {a: _record(samples=8, averaging=True)}
    assert m.batch(8, T0) == Train()  # 16 of 64: a flag alone does not end an epoch
    m.records = {a: _record(samples=24, averaging=True)}
    assert isinstance(m.batch(8, T0), Average)  # 40 of 64


def test_a_late_joiner_resyncs_and_starts_from_the_swarms_epoch() -> None:
    m = _machine()
    peers = _ids(3)
    m.records = {p: _record(epoch=7, samples=8, fingerprint=b"x") for p in peers}
    resync = m.batch(8, T0)
    assert isinstance(resync, Resync) and resync.donors is None and not resync.drop_update
    m.loaded(7, b"x")
    assert (m.epoch, m.samples, m.counts.loads, m.fingerprint) == (7, 0, 1, b"x")
    assert m.batch(8, T0 + 1) == Train()


def test_one_record_claiming_a_far_epoch_moves_nobody() -> None:
    m = _machine()
    liar, a, b = _ids(3)
    m.records = {liar: _record(epoch=10**9), a: _record(samples=4), b: _record(samples=4)}
    assert m.batch(4, T0) == Train()
    assert m.view(T0).epoch == 0


def test_a_split_swarm_follows_the_larger_branch_unless_it_cannot_have_its_state() -> None:
    m = _machine()
    m.epoch, m.fingerprint = 3, b"mine"
    others = _ids(4)
    friend = others[0]
    m.records = {p: _record(epoch=3, fingerprint=b"theirs") for p in others[1:]}
    m.records[friend] = _record(epoch=3, fingerprint=b"mine")
    resync = m.batch(4, T0)
    assert isinstance(resync, Resync)
    assert resync.fingerprint == b"theirs" and set(resync.donors or ()) == set(others[1:])
    assert resync.unusual  # a split is worth a warning; a late join is not
    assert m.counts.splits == 1
    m.load_failed(resync, T0)  # no quorum offered it: identities are no majority
    assert m.batch(4, T0 + 1) == Train()
    assert m.samples == 4  # what it accumulated on its own branch still counts
    m.loaded(3, b"theirs")  # later, it did get the branch's state
    assert not m.refused_branches and m.fingerprint == b"theirs"


def test_a_failed_download_for_a_swarm_ahead_is_tried_again_after_a_growing_pause() -> None:
    # Donors that could not agree on a state made a peer try again on every batch:
    # hundreds of futile downloads a second.
    m = _machine()
    (a,) = _ids(1)
    for attempt, pause in enumerate((1.0, 2.0, 4.0)):
        now = T0 + 10 * attempt
        m.records = {a: _record(epoch=5, at=now)}
        resync = m.batch(4, now)
        assert isinstance(resync, Resync) and not resync.fingerprint
        m.load_failed(resync, now)
        assert m.batch(4, now + 0.1) == Train()  # trains on meanwhile
        wait = m.batch(0, now + 0.1)  # nothing to add: waits for the next try
        assert isinstance(wait, Wait) and wait.deadline == now + pause
        assert m.poll(wait, now + pause / 2) is wait
        assert m.poll(wait, now + pause) == Train()
        assert isinstance(m.batch(4, now + pause), Resync)
    m.loaded(5, b"f" * 16)
    m.restarted(0)  # (behind again, say)
    m.records = {a: _record(epoch=5, at=T0 + 20)}
    assert isinstance(m.batch(4, T0 + 20.1), Resync)  # a success reset the pause


def test_peers_gone_from_the_records_leave_the_round_and_a_last_peer_steps_alone() -> None:
    m = _machine()
    a, b = _ids(2)
    m.records = {a: _record(samples=16), b: _record(samples=16)}
    assert m.batch(8, T0) == Train()  # share 64 / 3 = 21
    late = T0 + EXPIRATION + 1  # their records expired: they left
    assert m.batch(16, late) == Train()  # alone, its share is the whole batch: 24 of 64
    assert m.view(late).num_peers == 1
    average = m.batch(40, late + 3)
    assert average == Average(epoch=0, weight=64.0, group_size=2, alone=True)
    assert m.round_ended(RoundOutcome(Round.ALONE), late + 3) == Step()
    assert m.counts.alone == 1 and len(m.fingerprint) == 16


def test_failed_rounds_drop_the_update_and_resync() -> None:
    m = _machine()
    (a,) = _ids(1)
    m.records = {a: _record(samples=32)}
    for kind, counter in [(Round.NOT_AGREED, "not_agreed"), (Round.NO_GROUP, "no_group")]:
        assert isinstance(m.batch(32, T0), Average)
        resync = m.round_ended(RoundOutcome(kind), T0)
        assert isinstance(resync, Resync) and resync.drop_update
        assert m.samples == 0 and getattr(m.counts, counter) == 1
        m.load_failed(resync, T0)
        assert not m.averaging  # its record no longer pulls others into a round
    assert isinstance(m.batch(32, T0), Average)
    resync = m.round_ended(RoundOutcome(Round.NON_FINITE), T0)
    assert isinstance(resync, Resync) and resync.drop_update and m.counts.rounds == 1


def test_no_group_with_nobody_left_steps_alone() -> None:
    m = _machine()
    (a,) = _ids(1)
    m.records = {a: _record(samples=32)}
    assert isinstance(m.batch(32, T0), Average)
    assert m.round_ended(RoundOutcome(Round.NO_GROUP), T0 + EXPIRATION + 1) == Step()
    assert m.counts.alone == 1 and m.counts.no_group == 0


def test_a_peer_with_nothing_to_add_waits_for_the_step_and_then_resyncs() -> None:
    """``wait()`` without samples never enters a round (it has nothing to average, and
    counting it would make the others wait for it); it waits for the others' step."""
    m = _machine()
    a, b = _ids(2)
    m.records = {a: _record(samples=40, averaging=True), b: _record(samples=40, averaging=True)}
    wait = m.batch(0, T0)
    assert isinstance(wait, Wait)
    assert m.poll(wait, T0 + 0.5) is wait
    m.records = {a: _record(epoch=1, at=T0 + 1), b: _record(epoch=1, at=T0 + 1)}
    assert m.poll(wait, T0 + 1) == Train()
    assert isinstance(m.batch(0, T0 + 1), Resync)


def test_diloco_averages_every_inner_steps_once_the_others_are_done() -> None:
    m = _machine(DiLoCoPolicy(inner_steps=3))
    a, b = _ids(2)
    m.records = {a: _record(samples=8), b: _record(samples=8, averaging=True)}
    assert m.batch(0, T0) == Train()  # DiLoCo never waits for a global batch
    assert m.batch(4, T0) == Train() and m.batch(4, T0) == Train()
    wait = m.batch(4, T0)  # the third inner step: a is still busy with its own
    assert isinstance(wait, Wait) and m.averaging and m.samples == 12
    m.records[a] = _record(samples=12, averaging=True, at=T0 + 0.5)
    assert m.poll(wait, T0 + 0.5) == Average(epoch=0, weight=12.0, group_size=3, alone=False)
    assert m.round_ended(AGREED, T0 + 1) == Step()
    m.finish_epoch()
    assert m.batch(4, T0 + 1) == Train()  # the next outer step's first inner step


def test_diloco_expects_every_member_in_its_round_also_one_whose_record_lags() -> None:
    # Outer steps of a small model follow each other faster than records travel: the
    # others read two epochs ago are right behind, and come (a group formed without them
    # left them searching alone until the search timed out).
    m = _machine(DiLoCoPolicy(inner_steps=1))
    m.restarted(2)
    behind, current, ahead = _ids(3)
    m.records = {
        behind: _record(epoch=0, samples=4),
        current: _record(epoch=2, samples=4, averaging=True),
        ahead: _record(epoch=3),
    }
    decision = m.batch(4, T0)
    assert isinstance(decision, Average) and decision.group_size == 3  # not the one ahead


def test_diloco_stops_waiting_for_a_slow_peer_at_the_deadline() -> None:
    m = _machine(DiLoCoPolicy(inner_steps=1))
    (slow,) = _ids(1)
    m.records = {slow: _record(samples=4)}
    wait = m.batch(4, T0)
    assert isinstance(wait, Wait)
    assert isinstance(m.poll(wait, wait.deadline), Average)


def test_overlapped_diloco_trains_on_while_its_round_runs_and_takes_it_in_by_the_next() -> None:
    m = _machine(DiLoCoPolicy(inner_steps=2), overlap=True)
    (a,) = _ids(1)
    m.records = {a: _record(samples=8, averaging=True)}
    assert m.batch(4, T0) == Train()
    assert isinstance(m.batch(4, T0), Average)
    m.launched()  # the driver trains on
    assert (m.epoch, m.phase, m.averaging) == (0, 1, True)
    with pytest.raises(RuntimeError):
        m.launched()  # never two in flight
    assert not m.round_due(False, 4, T0)  # running, and the next batch is a first one
    assert m.batch(4, T0) == Train()  # that batch counts toward the next epoch
    assert m.round_due(True, 4, T0)  # it ended: take it in
    # Still running, but the next batch ends the outer step: wait for it first.
    assert m.round_due(False, 4, T0) and not m.round_due(False, 0, T0)
    m.records[a] = _record(epoch=1, at=T0 + 0.1)  # the other took it in already
    assert m.round_due(False, 0, T0 + 0.1)
    assert m.round_ended(AGREED, T0 + 0.2) == Step()
    m.finish_epoch()
    assert (m.epoch, m.phase, m.samples, m.averaging) == (1, 1, 4, False)


def test_overlapped_diloco_drops_a_failed_round_but_keeps_its_place_in_the_inner_steps() -> None:
    m = _machine(DiLoCoPolicy(inner_steps=3), overlap=True)
    (a,) = _ids(1)
    m.records = {a: _record(samples=8, averaging=True)}
    for _ in range(3):
        decision = m.batch(4, T0)
    assert isinstance(decision, Average)
    m.launched()
    m.batch(4, T0)
    resync = m.round_ended(RoundOutcome(Round.NOT_AGREED), T0 + 1)
    assert isinstance(resync, Resync) and resync.drop_update
    assert m.phase == m.epoch == 0  # nothing in flight any more
    m.loaded(1, b"g" * 16)  # mid-way: the others count their inner steps on
    assert (m.epoch, m.inner_steps % 3, m.in_flight) == (1, 1, None)
    m.records = {a: _record(epoch=1, samples=4, averaging=True, at=T0 + 1)}
    assert m.batch(4, T0 + 1) == Train() and isinstance(m.batch(4, T0 + 1), Average)
    m.launched()
    m.abandoned()  # a split, say: the round's update is given up
    assert (m.phase, m.averaging) == (1, False)


def test_without_overlap_a_round_is_never_launched_and_a_load_restarts_the_inner_steps() -> None:
    m = _machine(DiLoCoPolicy(inner_steps=3))
    with pytest.raises(RuntimeError):
        m.launched()
    m.batch(4, T0)
    m.loaded(2, b"")
    assert (m.inner_steps, m.phase) == (0, 2)


@pytest.mark.parametrize("claims", [[4], [4, 4, 4], [0, 0, 0, 0, 0]])
def test_everyone_present_counts_the_largest_wait_any_peer_asked_for(claims: list[int]) -> None:
    m = _machine()
    m.expect = 3
    others = _ids(len(claims))
    m.records = {p: _record() for p in others}
    assert m.everyone_present(T0) == (len(others) + 1 >= 3)
    m.records[others[0]] = PeerProgress(0, 0, 1.0, T0, expect=10)
    assert m.everyone_present(T0) == (len(others) + 1 >= 10)
    m.records[others[0]] = _record(epoch=1)  # someone stepped: the run has begun
    assert m.everyone_present(T0)


def test_throughput_is_measured_over_a_window_of_the_given_clock() -> None:
    m = _machine()
    m.batch(10, T0)
    assert m.samples_per_second == 0.0
    m.batch(10, T0 + 0.5)
    m.batch(10, T0 + 2.0)
    assert m.samples_per_second == 15.0  # 30 samples over 2 s
    assert m.counts.local_steps == 3 and m.counts.local_samples == 30


def test_a_restart_from_a_state_dict_starts_the_epoch_afresh() -> None:
    m = _machine(DiLoCoPolicy(inner_steps=4))
    m.batch(4, T0)
    m.restarted(5)
    assert (m.epoch, m.samples, m.inner_steps, m.averaging) == (5, 0, 0, False)


def test_at_the_end_a_peer_waits_for_one_behind_until_it_catches_up_or_leaves() -> None:
    m = _machine()
    m.restarted(30)
    m.fingerprint = b"f" * 16
    assert m.settled(T0) is None  # alone: nothing to wait for
    late, done, rider = _ids(3)
    m.records = {rider: _record(30)}  # claims the epoch, never averaged: no branch
    assert m.settled(T0) is None
    m.records = {late: _record(29, 16), done: _record(30, fingerprint=b"f" * 16)}
    wait = m.settled(T0)
    assert isinstance(wait, Wait) and wait.reason == "the others to finish"
    m.records[late] = _record(30, at=T0 + 1, fingerprint=b"f" * 16)  # it loaded our state
    assert m.settled(T0 + 1) is None
    m.records[late] = _record(29, 16, at=T0 + 1)
    assert m.settled(T0 + 1 + 2 * EXPIRATION) is None  # it left: nothing to wait for


def test_a_split_last_epoch_ends_on_the_majority_branch() -> None:
    m = _machine()
    m.restarted(30)
    m.fingerprint = b"m" * 16
    a, b, c = _ids(3)
    m.records = {
        a: _record(30, fingerprint=b"a" * 16),
        b: _record(30, fingerprint=b"a" * 16),
        c: _record(30, fingerprint=b"m" * 16),
    }
    resync = m.settled(T0)
    assert isinstance(resync, Resync) and resync.fingerprint == b"a" * 16
    assert set(resync.donors or ()) == {a, b} and not resync.drop_update
    assert m.counts.splits == 1
    m.load_failed(resync, T0)  # the majority could not give its state: ours stands
    assert m.settled(T0) is None
    # on the majority branch, a peer waits for the minority to follow before it leaves
    m.records = {a: _record(30, fingerprint=b"m" * 16), b: _record(30, fingerprint=b"z" * 16)}
    m.refused_branches.clear()
    assert isinstance(m.settled(T0), Wait)
    m.records[b] = _record(30, at=T0 + 1, fingerprint=b"m" * 16)
    assert m.settled(T0 + 1) is None
