"""What the lab tests of ``swarm train`` share: a public trainer that prints the join
command, the single-process baseline of the same run, and the summary's sample count."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence

import torch

from peers.netlab import PublicHost
from swarm.baseline import BaselineConfig, run_baseline
from swarm.tasks import get_task

SWARM = [sys.executable, "-m", "swarm.cli"]
STEPS = 50
BATCH = 64
#: ``swarm train`` hosts a bootstrap peer besides its trainer, both on ``--listen``: a
#: fixed port would be taken twice, so the public peer takes free ports.
SERVER = ["--listen", "/ip4/0.0.0.0/tcp/0", "--num-samples", str(BATCH * STEPS)]
SERVER += ["--num-threads", "1", "--progress", "lines"]


def start_public_trainer(
    server: PublicHost, num_peers: int, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[str], list[str], list[str]]:
    """``swarm train`` on a public host, waiting for ``num_peers`` before its first step
    (``extra``: more flags): the process, what it printed up to its join command, and
    that command's arguments (which carry the run's settings to the joiners)."""
    proc = server.popen(
        [*SWARM, "train", *SERVER, "--num-peers", str(num_peers), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    head = []
    for line in proc.stdout:  # bounded by the pytest timeout
        head.append(line)
        found = re.search(r" (join --initial-peers /ip4/198\.18\.\S+ .*)", line)
        if found:
            return proc, head, found.group(1).split()
    raise AssertionError(f"no join command printed: {''.join(head)}")


def baseline_metrics() -> dict[str, float]:
    """The single-process model's test metrics."""
    torch.set_num_threads(1)
    task = get_task("digits")
    config = BaselineConfig(
        task="digits", batch_size=BATCH, num_samples=BATCH * STEPS, optimizer=task.recipe.optimizer
    )
    return run_baseline(config, task=task).metrics


def samples_by_this_peer(out: str) -> int:
    found = re.search(r"\(([\d,]+) by this peer\)", out)
    assert found is not None, out
    return int(found.group(1).replace(",", ""))
