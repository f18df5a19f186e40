"""Collaborative training between real peer processes: the swarm matches one process
trained on the same samples with the same global batch, survives a SIGKILLed peer that
comes back, and DiLoCo sends far fewer bytes for a comparable loss, with its rounds
overlapped with training or not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from peers.identity import KeyPair
from peers.testing import LocalSwarm, PeerProcess
from swarm.baseline import BaselineConfig, run_baseline
from swarm.tasks import get_task

TARGET = "swarm.testing:trainer_node"
NUM_PEERS = 4
GLOBAL_BATCH = 64
NUM_SAMPLES = GLOBAL_BATCH * 320  # the task recipe: converged, so run-to-run noise is small
FAST = {"progress_expiration": 3.0, "max_wait_seconds": 1.0}


def _baseline(num_samples: int = NUM_SAMPLES) -> dict[str, float]:
    torch.set_num_threads(1)
    task = get_task("digits")
    config = BaselineConfig(
        task="digits",
        batch_size=GLOBAL_BATCH,
        num_samples=num_samples,
        optimizer=task.recipe.optimizer,
        seed=0,
    )
    return run_baseline(config, task=task).metrics


def _start(swarm: LocalSwarm, boot: PeerProcess, count: int, **options: Any) -> list[PeerProcess]:
    base = {
        "task": "digits",
        "initial_peers": [boot.maddr],
        "num_peers": NUM_PEERS,
        "target_batch_size": GLOBAL_BATCH,
        "num_samples": NUM_SAMPLES,
        "collaborative": FAST,
        "report_every": 20,
    }
    return [swarm.start(1, target=TARGET, options={**base, **options})[0] for _ in range(count)]


def _close_to(metrics: dict[str, float], baseline: dict[str, float]) -> bool:
    return (
        abs(metrics["accuracy"] - baseline["accuracy"]) <= 0.01
        or abs(metrics["loss"] - baseline["loss"]) <= 0.02 * baseline["loss"]
    )


def test_four_peers_match_the_single_process_baseline() -> None:
    # A fifth of the recipe: a swarm whose every step averages the whole global batch is
    # the baseline up to float rounding, converged or not.
    num_samples = NUM_SAMPLES // 5
    baseline = _baseline(num_samples)
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        peers = _start(swarm, boot, NUM_PEERS, num_samples=num_samples)
        results = [p.wait_report("trained", 240) for p in peers]
    print("baseline", baseline, "swarm", [r["metrics"] for r in results])
    for r in results:
        assert r["epochs"] == num_samples // GLOBAL_BATCH
        assert r["statistics"]["num_rounds"] >= 0.9 * r["epochs"]  # averaged, not alone
        assert _close_to(r["metrics"], baseline), (r["metrics"], baseline)
    # every peer holds the same model
    assert len({round(r["metrics"]["loss"], 6) for r in results}) == 1


def test_three_peers_without_ranks_fill_each_global_batch_exactly() -> None:
    """64 samples per step among 3 peers: slots of 22, 21 and 21, never a second local
    batch (which made 126 samples a step), and every peer's part adds up to the run."""
    steps = 20
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        peers = _start(
            swarm,
            boot,
            3,
            num_peers=3,
            num_samples=GLOBAL_BATCH * steps,
            # a peer that waits this long for the others takes over no slot (no timing)
            collaborative={**FAST, "max_wait_seconds": 60.0, "progress_expiration": 60.0},
        )
        results = [p.wait_report("trained", 180) for p in peers]
    stats = [r["statistics"] for r in results]
    assert all(r["epochs"] == steps for r in results)
    assert sum(s["local_samples"] for s in stats) == GLOBAL_BATCH * steps, stats
    assert all(s["local_steps"] == steps for s in stats), stats
    assert all(21 * steps <= s["local_samples"] <= 22 * steps for s in stats), stats
    assert len({round(r["metrics"]["loss"], 6) for r in results}) == 1


def test_a_killed_peer_restarts_syncs_and_the_result_still_matches() -> None:
    # Half the recipe (160 steps), the kill at step 50. On the virtual clock the same
    # story (test_memory_collaborative.py) ends within 1e-4 of one process's loss.
    num_samples = NUM_SAMPLES // 2
    baseline = _baseline(num_samples)
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        peers = _start(swarm, boot, NUM_PEERS, num_samples=num_samples)
        victim = peers[2]
        while victim.wait_report("progress", 120)["epoch"] < 50:
            pass
        swarm.kill(victim)
        survivors = [p for p in peers if p is not victim]
        for p in survivors:  # the others keep training without error
            p.wait_report("progress", 60)
        (restarted,) = _start(swarm, boot, 1, num_samples=num_samples)
        results = [p.wait_report("trained", 240) for p in [*survivors, restarted]]
    print("baseline", baseline, "swarm", [(r["metrics"], r["statistics"]) for r in results])
    assert results[-1]["statistics"]["num_state_loads"] >= 1  # it synced from the others
    for r in results:
        assert r["epochs"] == num_samples // GLOBAL_BATCH
        assert _close_to(r["metrics"], baseline), (r["metrics"], baseline)
    # one model, not branches: a round that split, then a round of everyone, once ended
    # as two pairs of peers 25% apart in loss with every counter clean
    assert len({round(r["metrics"]["loss"], 6) for r in results}) == 1


def _identities(tmp_path: Path, count: int) -> list[str]:
    """Which part of each global batch a peer trains on is drawn from its identity: fixed
    identities make a run one fixed draw instead of a new one each time."""
    identities = []
    for i in range(count):
        identities.append(str(tmp_path / f"peer{i}.key"))
        KeyPair.from_seed(bytes([i + 1]) * 32).save(identities[-1])
    return identities


#: The paper's outer momentum 0.9 needs many outer steps to build up; these runs have 6,
#: where plain averaging plus light momentum does best.
DILOCO = {"inner_steps": 50, "codec": "float16", "outer_lr": 1.0, "outer_momentum": 0.5}


def test_diloco_sends_40x_fewer_bytes_for_a_comparable_loss(tmp_path: Path) -> None:
    identities = _identities(tmp_path, 2)
    figures = {}
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        for mode, options in (
            ("sync", {"run_id": "sync"}),
            (
                "diloco",
                {
                    "run_id": "diloco",
                    "diloco": DILOCO,
                    "collaborative": {**FAST, "max_wait_seconds": 10.0},
                },
            ),
        ):
            peers = [
                _start(swarm, boot, 1, num_peers=2, identity=identity, **options)[0]
                for identity in identities
            ]
            results = [p.wait_report("trained", 240) for p in peers]
            figures[mode] = {
                "bytes_sent": sum(r["statistics"]["bytes_sent"] for r in results),
                "loss": results[0]["metrics"]["loss"],
                "accuracy": results[0]["metrics"]["accuracy"],
            }
            for p in peers:
                swarm.terminate(p)
    print("DiLoCo vs synchronous gradient averaging", figures)
    assert figures["sync"]["bytes_sent"] >= 40 * figures["diloco"]["bytes_sent"]
    # Synchronous averaging ends at 0.0666 (97.8%) every time. DiLoCo's end varies with
    # timing (whom each peer sees as a member at its first steps): 0.061-0.080 over runs
    # here with random identities (96.9-97.8%), once 0.096; 0.063-0.074 with these.
    assert figures["diloco"]["loss"] <= 1.6 * figures["sync"]["loss"]
    assert figures["diloco"]["accuracy"] >= figures["sync"]["accuracy"] - 0.02


def test_overlapped_diloco_ends_with_one_model_as_accurate_as_plain_diloco(tmp_path: Path) -> None:
    """Each outer step's round runs while the next 400 inner steps do (longer than a
    round here), and is applied late, under them: three peers end with one model (the
    last round is taken in before the run ends), every round averaged, and the accuracy
    of plain DiLoCo on the same settings and identities."""
    inner_steps, num_samples = 400, 10 * NUM_SAMPLES  # 8 outer steps
    identities = _identities(tmp_path, 3)
    found = {}
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        for overlap in (False, True):
            peers = [
                _start(
                    swarm,
                    boot,
                    1,
                    num_peers=3,
                    num_samples=num_samples,
                    identity=identity,
                    run_id=f"overlap-{overlap}",
                    diloco={**DILOCO, "inner_steps": inner_steps, "overlap": overlap},
                    collaborative={**FAST, "max_wait_seconds": 10.0},
                )[0]
                for identity in identities
            ]
            found[overlap] = [p.wait_report("trained", 240) for p in peers]
            for p in peers:
                swarm.terminate(p)
    print({k: [(r["metrics"], r["statistics"]) for r in v] for k, v in found.items()})
    for results in found.values():
        for r in results:
            assert r["epochs"] == num_samples // (GLOBAL_BATCH * inner_steps)
            stats = r["statistics"]
            assert stats["num_rounds"] == r["epochs"] and stats["num_rounds_not_agreed"] == 0
            assert stats["num_state_loads"] == 0
        assert len({round(r["metrics"]["loss"], 6) for r in results}) == 1
    # The same accuracy; the test loss (a run 10x the recipe's samples overfits, and
    # which rounds end late depends on the machine's load) was 1.0-1.6x plain DiLoCo's in
    # runs here, 2x once beside another test; an update applied wrongly (lost, counted
    # twice, or onto the wrong start) ends several times higher.
    plain, overlapped = found[False][0]["metrics"], found[True][0]["metrics"]
    assert overlapped["accuracy"] >= plain["accuracy"] - 0.02, (overlapped, plain)
    assert overlapped["loss"] <= 2.5 * plain["loss"], (overlapped, plain)
