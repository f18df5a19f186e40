"""Real peer processes: a bootstrap peer and 8 peers calling each other concurrently."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from peers.testing import LocalSwarm, SwarmError

TARGETS = Path(__file__).parent / "targets"
NUM_PEERS = 8


def test_eight_processes_call_each_other() -> None:
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.echo:serve_echo")
        workers = swarm.start(
            NUM_PEERS, target=f"{TARGETS / 'mesh.py'}:mesh", options={"bootstrap": [boot.maddr]}
        )
        assert len({w.peer_id for w in workers} | {boot.peer_id}) == NUM_PEERS + 1
        for w in workers:
            w.wait_report("joined", 60)
        for w in workers:
            w.send({"peers": [o.maddr for o in workers if o is not w] + [boot.maddr]})
        for w in workers:
            results = w.wait_report("results", 120)
            assert results["failed"] == []
            assert results["ok"] == NUM_PEERS  # 7 other workers + the bootstrap peer
            # one connection per remote peer (dials in both directions may add a few)
            assert NUM_PEERS <= results["connections"] <= 2 * NUM_PEERS
        pids = [p.pid for p in swarm.processes]
    for pid in pids:  # nothing is left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_kill_pause_resume_by_pid() -> None:
    with LocalSwarm() as swarm:
        a, b = swarm.start(2, target="peers.echo:serve_echo")
        swarm.pause(a)
        swarm.resume(a)
        swarm.kill(b)
        assert not b.alive and b.popen.returncode == -signal.SIGKILL
        assert swarm.terminate(a) == 0  # SIGTERM is a clean exit
        with pytest.raises(SwarmError, match="exited"):
            a.wait_report("no such event", 5)


def test_a_target_that_fails_to_start_is_reported() -> None:
    with LocalSwarm(startup_timeout=30) as swarm, pytest.raises(SwarmError):
        swarm.start(1, target="peers.nonexistent_module:nothing")
