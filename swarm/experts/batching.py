"""Forming batches from the requests queued for one hosted module: a pure state machine.

Requests (forward or backward, each some samples) queue in arrival order. When the
module is free, its worker asks :meth:`Batcher.next_batch`: the oldest request decides
the kind, and every queued request of that kind that still fits joins it, up to
``max_batch_size`` samples. A batch smaller than ``min_batch_size`` waits for more until
its oldest request has waited ``max_wait_seconds``. With the defaults (1 and 0) a lone
request runs at once and requests that arrive while the module computes are batched
together: batching costs no latency when the server is idle.

No clock reads and no I/O (STYLE.md 1): every call takes ``now``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from swarm.experts.errors import ServerBusy

T = TypeVar("T", bound=Hashable)
Kind = Literal["forward", "backward"]


@dataclass(frozen=True, slots=True)
class Batch(Generic[T]):
    """Requests to run together now, oldest first."""

    kind: Kind
    tickets: tuple[T, ...]
    num_samples: int


@dataclass(frozen=True, slots=True)
class _Queued:
    kind: Kind
    num_samples: int
    arrived: float


class Batcher(Generic[T]):
    """The queue of one module. Tickets identify requests (any hashable, e.g. an int)."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_queued_samples: int,
        min_batch_size: int = 1,
        max_wait_seconds: float = 0.0,
    ) -> None:
        if not 1 <= min_batch_size <= max_batch_size <= max_queued_samples:
            raise ValueError("need 1 <= min_batch_size <= max_batch_size <= max_queued_samples")
        if max_wait_seconds < 0:
            raise ValueError("max_wait_seconds must be >= 0")
        self.max_batch_size = max_batch_size
        self.max_queued_samples = max_queued_samples
        self.min_batch_size = min_batch_size
        self.max_wait_seconds = max_wait_seconds
        self._queue: dict[T, _Queued] = {}  # insertion order is arrival order
        self._num_samples = 0

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def num_queued_samples(self) -> int:
        return self._num_samples

    def submit(self, ticket: T, kind: Kind, num_samples: int, now: float) -> None:
        """Queue a request. Raises :class:`ServerBusy` if it would take the queue past
        ``max_queued_samples``, ValueError for a size outside ``[1, max_batch_size]``
        or a ticket already queued."""
        if not 1 <= num_samples <= self.max_batch_size:
            raise ValueError(f"{num_samples} samples is outside [1, {self.max_batch_size}]")
        if ticket in self._queue:
            raise ValueError(f"ticket {ticket!r} is already queued")
        if self._num_samples + num_samples > self.max_queued_samples:
            raise ServerBusy(
                f"{self._num_samples} samples are queued already (at most "
                f"{self.max_queued_samples}); try again later or another server"
            )
        self._queue[ticket] = _Queued(kind, num_samples, now)
        self._num_samples += num_samples

    def cancel(self, ticket: T) -> bool:
        """Forget a queued request (its caller gave up); False if it is not queued."""
        entry = self._queue.pop(ticket, None)
        if entry is None:
            return False
        self._num_samples -= entry.num_samples
        return True

    def next_batch(self, now: float) -> Batch[T] | float | None:
        """What the free worker should do: a :class:`Batch` to run now (its requests
        leave the queue), a time to look again (a small batch waiting for company), or
        ``None`` when the queue is empty."""
        if not self._queue:
            return None
        first = next(iter(self._queue.values()))
        tickets: list[T] = []
        total = 0
        for ticket, entry in self._queue.items():
            if entry.kind == first.kind and total + entry.num_samples <= self.max_batch_size:
                tickets.append(ticket)
                total += entry.num_samples
                if total == self.max_batch_size:
                    break
        ready_at = first.arrived + self.max_wait_seconds
        if total < self.min_batch_size and now < ready_at:
            return ready_at
        for ticket in tickets:
            self.cancel(ticket)
        return Batch(first.kind, tuple(tickets), total)
