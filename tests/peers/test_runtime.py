"""The process runtime: on glibc, memory a bulk transfer frees is kept for the next,
in every thread, in the processes that ask for it."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import subprocess
import sys

import pytest

from peers import BlockingPeer, PeerConfig
from peers.runtime import OPT_OUT_VARIABLE, keep_freed_memory

# In a fresh interpreter: three rounds of 24 x 2 MiB buffers, written then freed, as an
# all-reduce round holds its received chunks; the minor page faults of the third round.
_ROUNDS = """
import resource, sys
import numpy as np
from peers.runtime import keep_freed_memory
mode = sys.argv[1]
if mode != "plain":  # "kept", or "opted-out" (the environment says 0)
    applied = keep_freed_memory()
    assert applied == (mode == "kept"), (mode, applied)
def one_round():
    buffers = [np.empty(2 << 20, np.uint8) for _ in range(24)]
    for buffer in buffers:
        buffer.fill(1)
for _ in range(2):
    one_round()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


# In a fresh interpreter, in a thread started afterwards (as asyncio.to_thread runs an
# expert server's torch work): rounds of two 16 MiB buffers from posix_memalign (as
# torch allocates a 1024 x 4096 gradient), written then freed; the minor page faults of
# the last four of 24 rounds (glibc's aligned allocations take about 12 rounds to
# settle in a heap that is kept).
_THREAD_ROUNDS = """
import ctypes, resource, sys, threading
from peers.runtime import keep_freed_memory
if sys.argv[1] != "plain":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.free.argtypes = [ctypes.c_void_p]
def one_round():
    pointers = []
    for _ in range(2):
        p = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(p), 64, 16 << 20) == 0
        ctypes.memset(p, 1, 16 << 20)
        pointers.append(p)
    for p in pointers:
        libc.free(p)
faults = []
def work():
    for _ in range(24):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        one_round()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
thread = threading.Thread(target=work)
thread.start()
thread.join()
print(sum(faults[-4:]))
"""


def faults_of_a_later_round(
    mode: str, env: dict[str, str] | None = None, script: str = _ROUNDS
) -> int:
    out = subprocess.run(
        [sys.executable, "-c", script, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def _small_pages_only() -> bool:
    """4 KiB pages and no transparent huge pages unless asked for (with THP "always"
    or 64 KiB pages, glibc's defaults fault far less, and the contrast below shrinks)."""
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        thp = "[never]"
    return resource.getpagesize() == 4096 and "[always]" not in thp


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")
def test_freed_buffers_are_reused_without_page_faults() -> None:
    """With glibc's defaults the 48 MiB a round frees goes back to the kernel and comes
    back as fresh pages, one fault per 4 KiB; kept, a later round faults (almost) never."""
    plain, kept = faults_of_a_later_round("plain"), faults_of_a_later_round("kept")
    assert kept < 200, (kept, plain)
    if _small_pages_only():
        assert plain > 5_000, plain  # what the tuning is for (12,288 pages here)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")
def test_other_threads_reuse_freed_memory_too() -> None:
    """glibc gives a thread an arena of its own, whose heaps are unmapped whenever they
    fall empty, thresholds or not; with one arena, a thread's freed 16 MiB buffers are
    reused like the main thread's."""
    plain = faults_of_a_later_round("plain", script=_THREAD_ROUNDS)
    kept = faults_of_a_later_round("kept", script=_THREAD_ROUNDS)
    assert kept < 200, (kept, plain)
    if _small_pages_only():
        assert plain > 5_000, plain  # 4 x 8,192 pages here


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")
def test_an_embedding_application_can_opt_out() -> None:
    """SWARMTRAIN_KEEP_FREED_MEMORY=0: keep_freed_memory changes nothing, returns False."""
    opted_out = faults_of_a_later_round("opted-out", {"SWARMTRAIN_KEEP_FREED_MEMORY": "0"})
    if _small_pages_only():
        assert opted_out > 5_000, opted_out  # glibc's defaults, as without the call


class _Libc:
    """Stands in for glibc in ``ctypes.CDLL(None)``: records mallopt calls, makes none."""

    def __init__(self) -> None:
        self.mallopt_calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.mallopt_calls.append((param, value))
        return 1


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")
def test_a_blocking_peer_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a BlockingPeer sets no mallopt parameter (the tuning is the expert
    server's and peers.run's, opt-in); keep_freed_memory itself still sets all three."""
    libc, real_cdll = _Libc(), ctypes.CDLL

    def cdll(name: str | None, *args: object, **kwargs: object) -> object:
        return libc if name is None else real_cdll(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.delenv(OPT_OUT_VARIABLE, raising=False)
    with BlockingPeer(PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))) as peer:
        assert peer.listen_addrs
    assert libc.mallopt_calls == []
    assert keep_freed_memory()  # the stand-in is what the function would have called
    assert len(libc.mallopt_calls) == 3, libc.mallopt_calls
