"""Large float32 buffers that are reused instead of faulted in again every round: a
round's result, a reducer's sums, the flattened tensors.

Each round needs fresh buffers the size of the vector (its result is handed to the
caller, who keeps it as long as it likes). The allocator returns blocks that large to
the kernel when they are freed, so every round faulted its buffers in again, 4 KiB at a
time: writing into fresh memory was several times slower than into memory already
faulted in, and the faults were a real share of an all-reduce round's CPU
(docs/benchmarks.md, "Figures behind constants").

So a buffer of at least ``MIN_POOLED_BYTES`` is a view of an anonymous mapping that goes
back to a small pool when the last tensor viewing it dies (a finalizer on the
``memoryview`` the tensor holds), and the next buffer of the same rounded size takes it
from there, already faulted in. The pool holds at most ``MAX_POOLED_BYTES`` and
``MAX_POOLED_PER_SIZE`` mappings of one size; a mapping that does not fit is unmapped.
A reused buffer holds stale values, like any ``torch.empty``.

Rejected: transparent huge pages (``MADV_HUGEPAGE``: fewer faults for a fresh buffer,
but on a virtual machine freed huge pages can go back to the host, and faulting them in
again made rounds slower, not faster; docs/benchmarks.md, "Figures behind constants"),
and tuning the process's ``malloc`` (it would change the memory behaviour of the whole
application, not just ours).
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

#: Smallest buffer taken from the pool; smaller ones fault in cheaply enough.
MIN_POOLED_BYTES = 1024 * 1024
#: Sizes are rounded up to a multiple of this, so that parts whose sizes differ by a
#: few elements from one round to the next still reuse one mapping.
GRANULE_BYTES = 1024 * 1024
#: Most bytes idle in the pool (the process's resident memory between rounds).
MAX_POOLED_BYTES = 512 * 1024 * 1024
#: Most idle mappings of one size.
MAX_POOLED_PER_SIZE = 4


class _Pool:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self.idle_bytes = 0

    def take(self, size: int) -> mmap.mmap:
        with self._lock:
            free = self._free.get(size)
            if free:
                self.idle_bytes -= size
                return free.pop()
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def give(self, mapping: mmap.mmap) -> None:
        """Called when the last view of ``mapping`` died (from any thread)."""
        size = len(mapping)
        with self._lock:
            free = self._free.setdefault(size, [])
            if len(free) < MAX_POOLED_PER_SIZE and self.idle_bytes + size <= MAX_POOLED_BYTES:
                free.append(mapping)
                self.idle_bytes += size
                return
        mapping.close()

    def clear(self) -> None:
        with self._lock:
            mappings = [m for free in self._free.values() for m in free]
            self._free.clear()
            self.idle_bytes = 0
        for mapping in mappings:
            mapping.close()


_POOL = _Pool()


def empty_float32(numel: int, device: torch.device | None = None) -> torch.Tensor:
    """An uninitialised 1-D float32 tensor of ``numel`` elements (on the CPU unless
    ``device`` says otherwise); from the pool when it is large enough."""
    nbytes = numel * 4
    if (device is not None and device.type != "cpu") or nbytes < MIN_POOLED_BYTES:
        return torch.empty(numel, dtype=torch.float32, device=device)
    size = -(-nbytes // GRANULE_BYTES) * GRANULE_BYTES
    mapping = _POOL.take(size)
    view = memoryview(mapping)
    # The tensor (and every view of it) holds ``view``; when the last one dies, the
    # mapping goes back to the pool.
    weakref.finalize(view, _POOL.give, mapping).atexit = False
    return torch.frombuffer(view, dtype=torch.float32, count=numel)


def pooled_bytes() -> int:
    """Bytes idle in the pool now."""
    return _POOL.idle_bytes


def clear_pool() -> None:
    """Unmap every idle buffer (e.g. after the last round, to give the memory back)."""
    _POOL.clear()
