"""A peer that joins a run, publishes progress at the swarm's epoch and never trains (the
security issue's finding 3: one progress record stalls training). It is a member of
every epoch, so it holds a slot of every global batch and a place in every round. It
may cost the swarm one wait of ``slow_peer_seconds``, not one per step, and no round
may wait for it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from peers.dht import BlockingDHT, DHTConfig
from peers.testing import LocalSwarm
from swarm.collaborative.config import CollaborativeConfig
from swarm.collaborative.optimizer import CollaborativeOptimizer
from swarm.tasks import get_task

TARGET = "swarm.testing:trainer_node"
GLOBAL_BATCH = 64
STEPS = 40
PATIENCE = 10.0
FAST = {"progress_expiration": 3.0, "max_wait_seconds": 1.0}


@contextlib.contextmanager
def _free_rider(boot: str) -> Iterator[CollaborativeOptimizer]:
    """A member that claims the epoch most peers are at and never adds a sample."""
    model = get_task("digits").make_model(0)
    dht = BlockingDHT(config=DHTConfig(initial_peers=(boot,)))
    opt = CollaborativeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dht,
        CollaborativeConfig(
            run_id="demo",
            target_batch_size=GLOBAL_BATCH,
            progress_expiration=FAST["progress_expiration"],
            max_wait_seconds=FAST["max_wait_seconds"],
        ),
    )
    stop = threading.Event()

    def keep_up() -> None:
        for _ in range(10_000):  # bounded: 0.05 s each, longer than any run here
            if stop.wait(0.05):
                return
            opt.epoch = max(opt.epoch, opt.swarm_progress().epoch)

    follower = threading.Thread(target=keep_up, daemon=True)
    follower.start()
    try:
        yield opt
    finally:
        stop.set()
        follower.join(5)
        opt.close()
        dht.close()


def test_a_member_that_never_trains_costs_one_wait_not_one_per_step() -> None:
    options = {
        "task": "digits",
        "num_peers": 2,
        "target_batch_size": GLOBAL_BATCH,
        "num_samples": GLOBAL_BATCH * STEPS,
        "collaborative": FAST,
        "slow_peer_seconds": PATIENCE,
        "report_every": 1,
    }
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        peers = [
            swarm.start(1, target=TARGET, options={**options, "initial_peers": [boot.maddr]})[0]
            for _ in range(2)
        ]
        for p in peers:
            while p.wait_report("progress", 120)["epoch"] < 3:
                pass
        with _free_rider(boot.maddr) as rider:
            started = time.monotonic()
            # Each of the ~37 remaining steps waiting out the patience would take over
            # 370 s. Unloaded, the whole run takes 20-30 s; a loaded machine (the suite
            # runs on two workers) has taken 100 s.
            results = [p.wait_report("trained", 180) for p in peers]
            seconds = time.monotonic() - started
            rider_epoch = rider.epoch
    stats = [r["statistics"] for r in results]
    print(f"{seconds:.1f} s after the free rider joined; it ended at epoch {rider_epoch}", stats)
    assert rider_epoch >= STEPS - 1  # it kept claiming the current epoch: it was a member
    for r in results:
        assert r["epochs"] == STEPS
    # Every global batch was filled: the rider's slot by one of them.
    assert sum(s["local_samples"] for s in stats) >= GLOBAL_BATCH * STEPS
    assert len({round(r["metrics"]["loss"], 6) for r in results}) == 1
    # No round waited for it: one that did would wait out the gather window, 3 s (the
    # rounds here take 0.05-0.1 s each unloaded).
    gather = CollaborativeConfig(run_id="demo", target_batch_size=1).matchmaking.gather_timeout
    for s in stats:
        assert s["matchmaking_seconds"] < s["num_rounds"] * gather / 3
