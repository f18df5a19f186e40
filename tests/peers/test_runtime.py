"""The process runtime: on glibc, memory a bulk transfer frees is kept for the next."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import sys

import pytest

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


def faults_of_a_later_round(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode],
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
def test_an_embedding_application_can_opt_out() -> None:
    """SWARMTRAIN_KEEP_FREED_MEMORY=0: keep_freed_memory changes nothing, returns False."""
    opted_out = faults_of_a_later_round("opted-out", {"SWARMTRAIN_KEEP_FREED_MEMORY": "0"})
    if _small_pages_only():
        assert opted_out > 5_000, opted_out  # glibc's defaults, as without the call
