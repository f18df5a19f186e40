"""Forming batches from the requests queued for one hosted module: a pure state machine.

Requests (forward or backward, each some samples) queue per caller, in arrival order.
When the module is free, its worker asks :meth:`Batcher.next_batch`: the oldest request
of the caller whose turn it is decides the kind, and the queued requests of that kind
join it round-robin across callers (each caller's oldest first, then each one's next),
as long as they fit in ``max_batch_size`` samples. Every caller that got samples into
the batch then goes to the back of the rotation. A batch smaller than
``min_batch_size`` waits for more until its oldest request has waited
``max_wait_seconds``. With the defaults (1 and 0) a lone request runs at once and
requests that arrive while the module computes are batched together: batching costs no
latency when the server is idle.

Two bounds keep one caller from starving the others (docs/experts-trust.md): the queue
holds at most ``max_queued_samples`` samples in all and ``max_queued_samples_per_caller``
from any one caller, and the rotation gives a caller with one request a place in the
next batch however many requests another caller has queued. A caller is whatever the
server says it is (the remote peer's ID); callers are not authenticated here.

No clock reads and no I/O (CONTRIBUTING.md, "Protocols are pure state machines"): every
call takes ``now``.
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
    """Requests to run together now."""

    kind: Kind
    tickets: tuple[T, ...]
    num_samples: int


@dataclass(frozen=True, slots=True)
class _Queued:
    kind: Kind
    num_samples: int
    arrived: float


class Batcher(Generic[T]):
    """The queue of one module. Tickets identify requests (any hashable, e.g. an int);
    callers identify who sent them (any hashable: the server uses the peer's ID)."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_queued_samples: int,
        max_queued_samples_per_caller: int | None = None,
        min_batch_size: int = 1,
        max_wait_seconds: float = 0.0,
    ) -> None:
        """``max_queued_samples_per_caller`` ``None``: as many as ``max_queued_samples``
        (no bound of its own)."""
        per_caller = (
            max_queued_samples
            if max_queued_samples_per_caller is None
            else max_queued_samples_per_caller
        )
        if not 1 <= min_batch_size <= max_batch_size <= per_caller <= max_queued_samples:
            raise ValueError(
                "need 1 <= min_batch_size <= max_batch_size <= max_queued_samples_per_caller "
                "<= max_queued_samples"
            )
        if max_wait_seconds < 0:
            raise ValueError("max_wait_seconds must be >= 0")
        self.max_batch_size = max_batch_size
        self.max_queued_samples = max_queued_samples
        self.max_queued_samples_per_caller = per_caller
        self.min_batch_size = min_batch_size
        self.max_wait_seconds = max_wait_seconds
        # Per caller, its requests in arrival order; the callers' order is the rotation
        # (the first is served next). A caller with nothing queued is not in it.
        self._queues: dict[Hashable, dict[T, _Queued]] = {}
        self._caller_of: dict[T, Hashable] = {}
        self._samples_of: dict[Hashable, int] = {}
        self._num_samples = 0

    @property
    def num_queued(self) -> int:
        return len(self._caller_of)

    @property
    def num_queued_samples(self) -> int:
        return self._num_samples

    def queued_samples_of(self, caller: Hashable) -> int:
        """Samples ``caller`` has queued now."""
        return self._samples_of.get(caller, 0)

    def submit(
        self, ticket: T, kind: Kind, num_samples: int, now: float, *, caller: Hashable = None
    ) -> None:
        """Queue a request of ``caller``'s. Raises :class:`ServerBusy` if it would take
        the caller past ``max_queued_samples_per_caller`` or the queue past
        ``max_queued_samples``; ValueError for a size outside ``[1, max_batch_size]`` or a
        ticket already queued."""
        if not 1 <= num_samples <= self.max_batch_size:
            raise ValueError(f"{num_samples} samples is outside [1, {self.max_batch_size}]")
        if ticket in self._caller_of:
            raise ValueError(f"ticket {ticket!r} is already queued")
        mine = self._samples_of.get(caller, 0)
        per_caller = self.max_queued_samples_per_caller
        if mine + num_samples > per_caller and per_caller < self.max_queued_samples:
            raise ServerBusy(
                f"you have {mine} samples queued here already (at most "
                f"{per_caller} per caller); wait for your replies"
            )
        if self._num_samples + num_samples > self.max_queued_samples:
            raise ServerBusy(
                f"{self._num_samples} samples are queued already (at most "
                f"{self.max_queued_samples}); try again later or another server"
            )
        self._queues.setdefault(caller, {})[ticket] = _Queued(kind, num_samples, now)
        self._caller_of[ticket] = caller
        self._samples_of[caller] = mine + num_samples
        self._num_samples += num_samples

    def cancel(self, ticket: T) -> bool:
        """Forget a queued request (its caller gave up); False if it is not queued."""
        if ticket not in self._caller_of:
            return False
        caller = self._caller_of.pop(ticket)
        queue = self._queues[caller]
        entry = queue.pop(ticket)
        if not queue:
            del self._queues[caller]
        left = self._samples_of[caller] - entry.num_samples
        if left:
            self._samples_of[caller] = left
        else:
            del self._samples_of[caller]
        self._num_samples -= entry.num_samples
        return True

    def next_batch(self, now: float) -> Batch[T] | float | None:
        """What the free worker should do: a :class:`Batch` to run now (its requests
        leave the queue), a time to look again (a small batch waiting for company), or
        ``None`` when the queue is empty."""
        if not self._queues:
            return None
        first = next(iter(next(iter(self._queues.values())).values()))
        candidates = [
            [(t, e) for t, e in queue.items() if e.kind == first.kind]
            for queue in self._queues.values()
        ]
        tickets: list[T] = []
        total = 0
        oldest = first.arrived
        for round_ in range(max(len(c) for c in candidates)):
            for column in candidates:
                if round_ >= len(column) or total == self.max_batch_size:
                    continue
                ticket, entry = column[round_]
                if total + entry.num_samples <= self.max_batch_size:
                    tickets.append(ticket)
                    total += entry.num_samples
                    oldest = min(oldest, entry.arrived)
        ready_at = oldest + self.max_wait_seconds
        if total < self.min_batch_size and now < ready_at:
            return ready_at
        served = list(dict.fromkeys(self._caller_of[t] for t in tickets))
        for ticket in tickets:
            self.cancel(ticket)
        for caller in served:  # to the back of the rotation, in the order they were
            queue = self._queues.pop(caller, None)
            if queue is not None:
                self._queues[caller] = queue
        return Batch(first.kind, tuple(tickets), total)
