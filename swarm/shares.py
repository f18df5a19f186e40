"""Who trains on which samples of a global batch, decided without ranks (pure:
CONTRIBUTING.md, "Protocols are pure state machines"; design: docs/design/shares.md).

Global step ``t`` of a run trains on stream positions ``[t * G, (t + 1) * G)`` of the
task's sample stream (``G``: the global batch), the same positions a single process with
batch ``G`` takes at step ``t``. The peers live at that step divide them into
contiguous slots in an order drawn from the run id, the step and their identities
(:func:`share_order`): slot sizes differ by at most one and add up to ``G`` exactly,
whatever the number of peers, and a peer's slot follows from its identity and the run
alone. Peers that see the same members therefore never take the same sample within a
step, and the steps of the swarm see exactly the single process's batches.

Views of the membership can differ for a moment (a peer joined or died since another
looked); then slots may overlap or leave a gap. A gap cannot stall the step:
:func:`takeover_slots` gives each slot whose owner delivered nothing to one peer, the
nearest member before it in the order that did deliver, so the batch is filled once
and only once when views agree again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from peers.identity import PeerID


@dataclass(frozen=True, slots=True)
class Slot:
    """Stream positions ``[start, stop)`` of one member's part of step ``step``."""

    step: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def chunks(self, limit: int) -> list[Slot]:
        """This slot in consecutive pieces of at most ``limit`` samples (0: one piece)."""
        if limit <= 0 or self.size <= limit:
            return [self]
        return [
            Slot(self.step, a, min(a + limit, self.stop))
            for a in range(self.start, self.stop, limit)
        ]


def share_order(members: Iterable[PeerID], run_id: str, step: int) -> list[PeerID]:
    """``members`` in the order of their slots at ``step``: by a hash of the run, the step
    and the peer, so who holds the larger slots changes from step to step."""
    prefix = f"swarmtrain shares\0{run_id}\0{step}\0".encode()

    def key(peer: PeerID) -> bytes:
        return hashlib.sha256(prefix + peer.to_bytes()).digest()

    return sorted(set(members), key=key)


def slot_of(index: int, num_members: int, step: int, global_batch: int) -> Slot:
    """Slot ``index`` of ``num_members`` at ``step``: the first ``G % n`` slots hold one
    sample more than the others, and together they cover the step's ``G`` positions."""
    if not 0 <= index < num_members or global_batch < 1 or step < 0:
        raise ValueError(f"no slot {index} of {num_members} (batch {global_batch}, step {step})")
    base, extra = divmod(global_batch, num_members)
    start = step * global_batch + index * base + min(index, extra)
    return Slot(step, start, start + base + (1 if index < extra else 0))


def my_slot(order: list[PeerID], me: PeerID, step: int, global_batch: int) -> Slot:
    """``me``'s slot at ``step`` among ``order`` (which must contain it)."""
    return slot_of(order.index(me), len(order), step, global_batch)


def takeover_slots(
    order: list[PeerID],
    me: PeerID,
    delivered: Collection[PeerID],
    step: int,
    global_batch: int,
    *,
    every_one: bool = False,
) -> dict[PeerID, Slot]:
    """The slots ``me`` fills for members that delivered nothing to the step, by member:
    each such slot goes to the nearest member before it (cyclically) that did deliver;
    with ``every_one``, each is ``me``'s (the last resort when a member the rule chose
    left it unfilled: it dealt the step among other members). ``me`` is taken to have
    delivered."""
    if me not in order:
        return {}
    n = len(order)
    done = set(delivered) | {me}
    mine: dict[PeerID, Slot] = {}
    for index, peer in enumerate(order):
        if peer in done:
            continue
        before = index - 1
        while order[before % n] not in done:
            before -= 1
        if every_one or order[before % n] == me:
            mine[peer] = slot_of(index, n, step, global_batch)
    return mine


__all__ = ["Slot", "my_slot", "share_order", "slot_of", "takeover_slots"]
