"""Which chunk each donor fetches next: a work-stealing queue, as a pure state machine.

Every donor pulls the next pending chunk when it has room for another request, so fast
donors take more chunks than slow ones without any bandwidth estimate. A donor that
fails (dies, stalls, sends a chunk of the wrong size or checksum) is out for good, and
the chunks it held go back to the front of the queue for the others: the download
resumes, it never restarts. Chunks already verified stay verified.

No I/O and no clock: the caller reports what happened and asks what to do next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

D = TypeVar("D", bound=Hashable)


@dataclass
class DonorProgress:
    """What one donor has done so far."""

    num_chunks: int = 0
    num_bytes: int = 0
    in_flight: list[int] = field(default_factory=list)  # requested, in request order
    failure: str | None = None


class ChunkSchedule(Generic[D]):
    """Hands out chunk indices ``0 .. num_chunks - 1`` to donors until each is verified."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self._done = bytearray(num_chunks)
        self.num_done = 0
        self._pending = deque(range(num_chunks))
        self.donors: dict[D, DonorProgress] = {}
        self.num_retried = 0

    @property
    def complete(self) -> bool:
        return self.num_done == self.num_chunks

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def active_donors(self) -> list[D]:
        return [d for d, p in self.donors.items() if p.failure is None]

    def add_donor(self, donor: D) -> None:
        """Let ``donor`` take chunks. A donor that failed once stays failed."""
        self.donors.setdefault(donor, DonorProgress())

    def next_chunk(self, donor: D) -> int | None:
        """The next chunk ``donor`` should request, or None if none is pending now (more
        may become pending when another donor fails)."""
        progress = self.donors[donor]
        if progress.failure is not None or not self._pending:
            return None
        index = self._pending.popleft()
        progress.in_flight.append(index)
        return index

    def expected(self, donor: D) -> int | None:
        """The chunk ``donor`` must answer next (donors answer in request order)."""
        in_flight = self.donors[donor].in_flight
        return in_flight[0] if in_flight else None

    def received(self, donor: D, index: int, num_bytes: int) -> None:
        """``donor`` delivered chunk ``index`` and it verified."""
        progress = self.donors[donor]
        if progress.failure is not None or index not in progress.in_flight:
            raise ValueError(f"chunk {index} was not requested from {donor}")
        progress.in_flight.remove(index)
        progress.num_chunks += 1
        progress.num_bytes += num_bytes
        if not self._done[index]:
            self._done[index] = 1
            self.num_done += 1

    def fail(self, donor: D, reason: str) -> list[int]:
        """``donor`` is out: its in-flight chunks go back to the front of the queue (in
        their order). Returns them. Failing a donor twice keeps the first reason."""
        progress = self.donors[donor]
        if progress.failure is None:
            progress.failure = reason
        returned = [i for i in progress.in_flight if not self._done[i]]
        progress.in_flight.clear()
        self._pending.extendleft(reversed(returned))
        self.num_retried += len(returned)
        return returned
