"""Which expert serves which samples, and when a call of many experts may stop waiting.

Pure parts of the mixture (CONTRIBUTING.md, "Protocols are pure state machines").
:func:`plan_calls` groups the chosen experts so each is called once with all its
samples. :class:`Quorum` is hivemind's ``_collect_responses`` as a state machine: every
sample wants ``k_min`` answers from its experts; once all have them, stragglers get
``timeout_after_k_min`` more seconds; a sample that can no longer get them ends the wait
at once (the call fails, and the caller may retry without the failed experts).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Generic, TypeVar

from swarm.experts.announce import Announcement, ExpertLocation

K = TypeVar("K", bound=Hashable)


def plan_calls(
    chosen: Sequence[Sequence[Announcement]],
) -> dict[ExpertLocation, list[tuple[int, int]]]:
    """For each chosen expert, the (sample, slot) pairs it serves, in sample order."""
    plan: dict[ExpertLocation, list[tuple[int, int]]] = {}
    for sample, experts in enumerate(chosen):
        for slot, announcement in enumerate(experts):
            plan.setdefault(announcement.location, []).append((sample, slot))
    return plan


class Quorum(Generic[K]):
    """Tracks answers of calls ``rows`` (call -> the samples it serves)."""

    def __init__(
        self,
        rows: Mapping[K, Sequence[int]],
        k_min: int,
        *,
        start: float,
        timeout: float,
        timeout_after_k_min: float,
    ) -> None:
        self.rows = rows
        self.k_min = k_min
        self.timeout_after_k_min = timeout_after_k_min
        self.deadline = start + timeout
        """When to stop waiting (absolute, the caller's clock)."""
        self._pending: dict[int, int] = {}
        self._ok: dict[int, int] = {}
        for samples in rows.values():
            for s in set(samples):
                self._pending[s] = self._pending.get(s, 0) + 1
                self._ok.setdefault(s, 0)
        self._left = len(rows)
        self.hopeless = any(n < k_min for n in self._pending.values())
        """Some sample can no longer reach ``k_min`` answers."""
        self._check(start)

    def on_done(self, call: K, ok: bool, now: float) -> None:
        """Call ``call`` answered (``ok``) or failed."""
        self._left -= 1
        for s in set(self.rows[call]):
            self._pending[s] -= 1
            self._ok[s] += ok
            if self._ok[s] + self._pending[s] < self.k_min:
                self.hopeless = True
        self._check(now)

    def _check(self, now: float) -> None:
        if all(ok >= self.k_min for ok in self._ok.values()):
            self.deadline = min(self.deadline, now + self.timeout_after_k_min)

    def finished(self, now: float) -> bool:
        return self._left == 0 or self.hopeless or now >= self.deadline

    def short_samples(self) -> list[int]:
        """Samples with fewer than ``k_min`` answers."""
        return sorted(s for s, ok in self._ok.items() if ok < self.k_min)
