"""One hostile volunteer tries to take a run over through its progress record and its
shared state (the security issue's finding 1): it claims an epoch far ahead and serves
a poisoned state (zeroed weights, a huge learning rate) as that epoch. Two honest real
peer processes must keep their own model, pace and hyperparameters."""

from __future__ import annotations

import contextlib

import torch

from peers.dht import BlockingDHT, DHTConfig
from peers.testing import LocalSwarm
from swarm.collaborative.config import CollaborativeConfig
from swarm.collaborative.optimizer import CollaborativeOptimizer
from swarm.tasks import get_task

TARGET = "swarm.testing:trainer_node"
GLOBAL_BATCH = 64
STEPS = 90  # long enough that the newcomer joins a run still training
FAST = {"progress_expiration": 3.0, "max_wait_seconds": 1.0}


def _hostile_peer(boot: str) -> tuple[BlockingDHT, CollaborativeOptimizer]:
    """A peer of the run whose state is poison and whose record claims epoch 10**6."""
    task = get_task("digits")
    model = task.make_model(0)
    inner = task.recipe.optimizer.build(model.parameters())
    for group in inner.param_groups:
        group["lr"] = 1e6  # it would travel in the state's metadata
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    dht = BlockingDHT(config=DHTConfig(initial_peers=(boot,)))
    opt = CollaborativeOptimizer(
        inner, dht, CollaborativeConfig(run_id="demo", target_batch_size=GLOBAL_BATCH, **FAST)
    )
    opt.epoch = 10**6
    opt.share_state()
    return dht, opt


def test_a_peer_claiming_a_far_epoch_with_a_poisoned_state_takes_nothing_over() -> None:
    options = {
        "task": "digits",
        "num_peers": 2,
        "target_batch_size": GLOBAL_BATCH,
        "num_samples": GLOBAL_BATCH * STEPS,
        "collaborative": FAST,
        "report_every": 5,
    }
    with LocalSwarm() as swarm, contextlib.ExitStack() as stack:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        peers = [
            swarm.start(1, target=TARGET, options={**options, "initial_peers": [boot.maddr]})[0]
            for _ in range(2)
        ]
        for p in peers:  # both are training before the attack
            while p.wait_report("progress", 120)["epoch"] < 5:
                pass
        dht, opt = _hostile_peer(boot.maddr)
        stack.callback(dht.close)
        stack.callback(opt.close)
        # a newcomer joins now: it must download the honest peers' state, not the poison
        newcomer = swarm.start(
            1, target=TARGET, options={**options, "initial_peers": [boot.maddr]}
        )[0]
        results = [p.wait_report("trained", 180) for p in [*peers, newcomer]]
    print([(r["metrics"], r["statistics"]) for r in results])
    for r in results:
        assert r["epochs"] == STEPS
        assert r["metrics"]["accuracy"] > 0.5  # zeroed weights score 0.1
    # Honest peers may still resync now and then, never without the hostile peer (see
    # docs/security.md; not traced: likely its record, a live member that never
    # averages, makes rounds wait and form late, and a peer left out of one catches up
    # from the honest majority's state). That is pace lost, not the run taken over,
    # which is what this test rules out: every peer ends at the run's epoch with the
    # same trained model, none with the poisoned one.
    assert results[2]["statistics"]["num_state_loads"] >= 1
    assert len({round(r["metrics"]["loss"], 6) for r in results}) == 1
