"""The process runtime: on glibc, memory a bulk transfer frees is kept for the next."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# In a fresh interpreter: three rounds of 24 x 2 MiB buffers, written then freed, as an
# all-reduce round holds its received chunks; the minor page faults of the third round.
_ROUNDS = """
import resource, sys
import numpy as np
if sys.argv[1] == "kept":
    from peers.runtime import keep_freed_memory
    assert keep_freed_memory()
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


def faults_of_a_later_round(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc's allocator only")
def test_freed_buffers_are_reused_without_page_faults() -> None:
    """With glibc's defaults the 48 MiB a round frees goes back to the kernel and comes
    back as fresh pages, one fault per 4 KiB; kept, a later round faults (almost) never."""
    plain, kept = faults_of_a_later_round("plain"), faults_of_a_later_round("kept")
    assert plain > 5_000, plain  # what the tuning is for (12,288 pages here)
    assert kept < 200, kept
