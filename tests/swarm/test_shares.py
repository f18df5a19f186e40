"""How peers divide a global batch without ranks (swarm.shares, pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peers.identity import KeyPair, PeerID
from swarm.shares import Slot, my_slot, share_order, slot_of, takeover_slots

POOL = [KeyPair.from_seed(bytes([i]) * 32).peer_id for i in range(12)]

members_strategy = st.lists(st.sampled_from(POOL), min_size=1, max_size=12, unique=True)


def _positions(slots: list[Slot]) -> list[int]:
    return [p for s in slots for p in range(s.start, s.stop)]


@given(members=members_strategy, step=st.integers(0, 10**6), batch=st.integers(1, 500))
def test_the_members_slots_cover_the_single_process_batch_once(
    members: list[PeerID], step: int, batch: int
) -> None:
    order = share_order(members, "run", step)
    slots = [my_slot(order, peer, step, batch) for peer in members]
    # exactly the positions a single process with this batch takes at this step
    assert sorted(_positions(slots)) == list(range(step * batch, (step + 1) * batch))
    sizes = {s.size for s in slots}
    assert max(sizes) - min(sizes) <= 1


@given(members=members_strategy, step=st.integers(0, 1000))
def test_a_peers_slot_follows_from_identities_and_the_run_alone(
    members: list[PeerID], step: int
) -> None:
    # the order members are listed in (each peer sees them its own way) changes nothing
    assert share_order(members, "run", step) == share_order(reversed(members), "run", step)
    assert share_order(members + members, "run", step) == share_order(members, "run", step)


def test_who_holds_the_larger_slots_changes_with_the_step_and_the_run() -> None:
    orders = {tuple(share_order(POOL, "run", step)) for step in range(20)}
    assert len(orders) > 1
    assert share_order(POOL, "run", 3) != share_order(POOL, "other-run", 3)


@given(
    members=st.lists(st.sampled_from(POOL), min_size=2, max_size=12, unique=True),
    delivered=st.sets(st.integers(0, 11), min_size=1),
    batch=st.integers(1, 300),
)
def test_the_slots_of_members_that_delivered_nothing_are_filled_once(
    members: list[PeerID], delivered: set[int], batch: int
) -> None:
    order = share_order(members, "run", 7)
    done = [order[i] for i in sorted(delivered) if i < len(order)] or [order[0]]
    filled: list[Slot] = []
    for peer in done:  # each peer that delivered looks, seeing the same members
        taken = takeover_slots(order, peer, done, 7, batch)
        assert not set(taken) & set(done)
        filled += taken.values()
    missing = [my_slot(order, p, 7, batch) for p in order if p not in done]
    assert sorted(_positions(filled)) == sorted(_positions(missing))


def test_takeovers_go_to_the_nearest_member_before_that_delivered() -> None:
    order = share_order(POOL[:4], "run", 0)
    a, b, c, d = order
    # b and c delivered nothing: both are a's (b follows a, c follows b)
    assert set(takeover_slots(order, a, {a, d}, 0, 64)) == {b, c}
    assert takeover_slots(order, d, {a, d}, 0, 64) == {}
    # a alone delivered: every other slot is a's, cyclically
    assert set(takeover_slots(order, a, {a}, 0, 64)) == {b, c, d}
    # a peer that is not a member takes over nothing
    assert takeover_slots(order, POOL[5], {a}, 0, 64) == {}


def test_slots_and_pieces() -> None:
    assert [slot_of(i, 3, 2, 64) for i in range(3)] == [
        Slot(2, 128, 150),
        Slot(2, 150, 171),
        Slot(2, 171, 192),
    ]
    assert Slot(0, 0, 22).chunks(8) == [Slot(0, 0, 8), Slot(0, 8, 16), Slot(0, 16, 22)]
    assert Slot(0, 0, 22).chunks(0) == [Slot(0, 0, 22)]
    for bad in ((3, 3, 0, 64), (0, 1, 0, 0), (0, 1, -1, 64)):
        with pytest.raises(ValueError):
            slot_of(*bad)
