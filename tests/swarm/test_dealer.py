"""Which samples a peer trains on next (``swarm.trainer._Dealer``), fed records and times:
whose slot of the global batch it fills for a member that delivers nothing, and when."""

from __future__ import annotations

from types import SimpleNamespace

from peers import KeyPair, PeerID
from swarm.collaborative.machine import GradientPolicy, StepMachine
from swarm.collaborative.progress import PeerProgress
from swarm.shares import Slot, my_slot, share_order, slot_of
from swarm.trainer import RunPlan, _Dealer

TARGET = 64
PATIENCE = 5.0
T0 = 1000.0
ME, RIDER, OTHER = (KeyPair.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3))


class _Optimizer:
    """What the dealer reads of a CollaborativeOptimizer, over a real StepMachine whose
    records the test sets (every record fresh: published at ``T0``, read at ``T0``)."""

    def __init__(self) -> None:
        self.machine = StepMachine(
            me=ME,
            policy=GradientPolicy(),
            target_batch_size=TARGET,
            progress_expiration=10.0,
            max_wait_seconds=1.0,
        )
        self.config = SimpleNamespace(diloco=None)
        self.dht = SimpleNamespace(peer=SimpleNamespace(peer_id=ME))

    @property
    def epoch(self) -> int:
        return self.machine.epoch

    @property
    def accumulated(self) -> int:
        return self.machine.samples

    def record(self, peer: PeerID, epoch: int, samples: int = 0) -> None:
        self.machine.records[peer] = PeerProgress(epoch, samples, 10.0, T0)

    def members(self) -> list[PeerID]:
        return self.machine.members(T0)

    def delivered(self) -> set[PeerID]:
        return self.machine.delivered(T0)

    def working(self, within: float) -> set[PeerID]:
        return self.machine.working(T0, within)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _dealer(opt: _Optimizer, clock: _Clock) -> _Dealer:
    plan = RunPlan(
        target_batch_size=TARGET,
        local_batch_size=0,
        num_samples=TARGET * 10,
        total_epochs=10,
        samples_per_epoch=TARGET,
    )
    return _Dealer(opt, "run", plan, PATIENCE, clock=clock)  # type: ignore[arg-type]


def _slot_of(peer: PeerID, epoch: int) -> Slot:
    return my_slot(share_order([ME, RIDER], "run", epoch), peer, epoch, TARGET)


def _train(opt: _Optimizer, slot: Slot) -> None:
    opt.machine.samples += slot.size


def test_a_member_that_never_trains_gets_patience_once_even_when_it_claims_a_later_epoch() -> None:
    opt, clock = _Optimizer(), _Clock()
    dealer = _dealer(opt, clock)
    opt.record(RIDER, epoch=0)  # a member of epoch 0 that publishes and never trains
    mine = dealer.next_slot()
    assert mine == _slot_of(ME, 0)
    _train(opt, mine)
    # Its record is fresh: it is busy with its slot, for as long as our patience lasts.
    assert dealer.next_slot() is None
    clock.now += PATIENCE - 0.1
    assert dealer.next_slot() is None
    clock.now += 0.2
    assert dealer.next_slot() == _slot_of(RIDER, 0)  # patience used up: we fill its slot

    opt.machine.finish_epoch()  # the swarm stepped
    opt.record(RIDER, epoch=1)
    mine = dealer.next_slot()
    assert mine == _slot_of(ME, 1)
    _train(opt, mine)
    # It reads our step first and claims the epoch after ours, still with no sample:
    # that is no sign of training, so its slot is ours at once, not after more patience.
    opt.record(RIDER, epoch=2)
    assert dealer.next_slot() == _slot_of(RIDER, 1)


def test_a_slow_member_that_adds_samples_again_gets_patience_again() -> None:
    opt, clock = _Optimizer(), _Clock()
    dealer = _dealer(opt, clock)
    opt.record(RIDER, epoch=0)
    _train(opt, dealer.next_slot() or Slot(0, 0, 0))
    assert dealer.next_slot() is None
    clock.now += PATIENCE + 0.1
    assert dealer.next_slot() == _slot_of(RIDER, 0)

    opt.machine.finish_epoch()
    opt.record(RIDER, epoch=1, samples=3)  # it trains again
    _train(opt, dealer.next_slot() or Slot(0, 0, 0))
    assert dealer.next_slot() is None  # it delivered: nothing of its to fill

    opt.machine.finish_epoch()
    opt.record(RIDER, epoch=2)
    _train(opt, dealer.next_slot() or Slot(0, 0, 0))
    # Patience again, as for any member, before its slot is ours.
    assert dealer.next_slot() is None
    clock.now += PATIENCE - 0.1
    assert dealer.next_slot() is None
    clock.now += 0.2
    assert dealer.next_slot() == _slot_of(RIDER, 2)


def test_a_slot_left_to_a_member_that_dealt_among_fewer_is_ours_after_twice_the_patience() -> None:
    # Three members in our view; the rider's slot goes, by the rule, to the member before
    # it in the order, OTHER. But OTHER dealt the epoch among two (the rider's record
    # had expired in its view), so it never fills that slot, and the batch stays short.
    # Find an epoch whose order puts OTHER right before the rider.
    epoch = next(
        e
        for e in range(100)
        if (order := share_order([ME, RIDER, OTHER], "run", e)).index(RIDER)
        == (order.index(OTHER) + 1) % 3
    )
    order = share_order([ME, RIDER, OTHER], "run", epoch)
    opt, clock = _Optimizer(), _Clock()
    opt.machine.epoch = epoch
    dealer = _dealer(opt, clock)
    opt.record(RIDER, epoch=epoch)
    opt.record(OTHER, epoch=epoch, samples=32)  # its slot of two
    mine = dealer.next_slot()
    assert mine == my_slot(order, ME, epoch, TARGET)
    _train(opt, mine)
    assert dealer.next_slot() is None
    clock.now += PATIENCE + 0.1
    assert dealer.next_slot() is None  # the rider's slot is OTHER's to fill
    clock.now += PATIENCE
    assert dealer.next_slot() == slot_of(order.index(RIDER), 3, epoch, TARGET)
    assert dealer.next_slot() is None  # taken once
