"""A 1 GiB array streams between two processes within a bounded memory window."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from peers.testing import LocalSwarm

TARGETS = Path(__file__).parent / "targets" / "bulk.py"
NUM_BYTES = 1 << 30
#: Memory either side may hold beyond the array itself: the yamux receive window
#: (<= 16 MiB), a frame being decoded (4 MiB chunks, two copies), socket buffers, and
#: allocator slack. A transfer that buffered the payload would exceed it by ~1 GiB.
MAX_EXTRA_BYTES = 160 * 1024 * 1024
#: A parent process this large, and its child a fresh interpreter of ~30 MiB.
PARENT_BYTES = 512 * 1024 * 1024


def test_one_gib_streams_with_bounded_memory() -> None:
    with LocalSwarm() as swarm:
        (receiver,) = swarm.start(1, target=f"{TARGETS}:receiver", options={"num_bytes": NUM_BYTES})
        (sender,) = swarm.start(1, target=f"{TARGETS}:sender")
        receiver.wait_report("serving", 30)
        sender.send({"to": receiver.maddr, "num_bytes": NUM_BYTES})
        report = sender.wait_report("sent", 240)
    summary = report["summary"]
    assert summary["received_items"] == NUM_BYTES // 4
    assert summary["mismatches"] == 0
    sender_extra = report["peak_rss"] - report["baseline_rss"] - NUM_BYTES
    receiver_extra = summary["peak_rss"] - summary["baseline_rss"] - NUM_BYTES
    print(
        f"extra memory beyond the array: sender {sender_extra / 2**20:.1f} MiB, "
        f"receiver {receiver_extra / 2**20:.1f} MiB"
    )
    assert sender_extra < MAX_EXTRA_BYTES
    assert receiver_extra < MAX_EXTRA_BYTES


def test_a_childs_peak_memory_is_its_own_not_its_parents() -> None:
    """The measure the memory tests above rely on: a peer process started from a large
    process (a pytest worker late in a run) reports its own peak, not the parent's."""
    parent = bytearray(PARENT_BYTES)
    parent[:: resource.getpagesize()] = b"\x01" * len(parent[:: resource.getpagesize()])
    code = (
        "import json, resource\n"
        "from peers.testing import peak_rss_bytes, rss_bytes\n"
        "print(json.dumps([peak_rss_bytes(), rss_bytes(),"
        " resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    peak, now, inherited = json.loads(run.stdout)
    assert 0 < now <= peak < PARENT_BYTES // 2
    assert inherited >= PARENT_BYTES  # what getrusage says, and why it is not used
    del parent
