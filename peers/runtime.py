"""Process runtime: uvloop where installed (Linux, macOS), the standard loop elsewhere;
and on glibc, for the processes that ask (:func:`run`, an expert server), an allocator
that keeps the memory big tensor buffers free."""

from __future__ import annotations

import asyncio
import ctypes
import os
import platform
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for the fastest event loop available here."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
#: Allocations up to this size come from the heap, not fresh mmaps: glibc's own ceiling
#: for its dynamic threshold (64-bit), made fixed.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free memory at the top of the heap that glibc keeps instead of returning it.
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024
#: Arenas: one, the heap those thresholds govern. glibc gives other threads (an event
#: loop in its own thread, torch's work in ``asyncio.to_thread``) arenas of their own,
#: made of 64 MiB heaps that are unmapped whenever they fall empty whatever the trim
#: threshold: an expert server's backward faulted its 16 MB gradients in afresh each
#: time (docs/benchmarks.md, "Figures behind constants").
ARENA_MAX = 1
#: Set to "0" to leave the allocator as it is.
OPT_OUT_VARIABLE = "SWARMTRAIN_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """On glibc, keep up to TRIM_THRESHOLD_BYTES of freed heap memory for reuse, serve
    allocations up to MMAP_THRESHOLD_BYTES from the heap, and give threads started
    after this call that one heap (ARENA_MAX); True if applied.

    For processes that free big tensor buffers over and over. An all-reduce round holds
    tens of MiB of received chunks and frees them at its end; with glibc's defaults that
    memory went back to the kernel each round and came back as fresh pages (zeroed, one
    fault per 4 KiB) the next (docs/benchmarks.md, "Figures behind constants"). An
    expert server's backward, in a thread of its own, faulted its 16 MB gradients in
    afresh on every call (see ARENA_MAX). A peer that only routes (a bootstrap peer, a
    DHT client) frees nothing that big and gains nothing.

    The settings are the whole process's, so they are opt-in: :func:`run` applies them
    (it is a program's entry point), and so do ``swarm.experts.ExpertServer`` and the
    ``swarm train`` command; a :class:`~peers.facade.BlockingPeer` leaves the allocator
    alone. An application that averages from its own process calls this itself, before
    it starts the threads that should share the heap. Elsewhere (musl, macOS, Windows)
    nothing is changed, and an environment with ``SWARMTRAIN_KEEP_FREED_MEMORY=0``
    changes nothing either (this then returns False).
    """
    if os.environ.get(OPT_OUT_VARIABLE, "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    # Setting either turns off glibc's adjustment of the other, so both are set (glibc
    # accepts both values; True only if it took both).
    mmap_set = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_set = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    arenas_set = libc.mallopt(_M_ARENA_MAX, ARENA_MAX)
    return bool(mmap_set and trim_set and arenas_set)


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the best loop (uvloop if installed), after
    :func:`keep_freed_memory`."""
    keep_freed_memory()
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
