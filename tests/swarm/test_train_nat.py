"""``swarm train`` and ``swarm join`` across home routers (the namespace lab).

The scenario of the report that opened the NAT work, grown to four laptops: a public peer
runs ``swarm train``, and laptops behind home routers of both kinds, all with the same
private address, run the join command it prints, as pasted (no rank, no swarm size, no
listen address). Before address hygiene they announced that shared private address,
dialed each other's routers' LANs by mistake and split the swarm; now they find
themselves behind NAT, reserve relays, punch holes where the NAT allows it, and the
five end with one model: the single process's, since the swarm's global batches are
that process's batches, divided by identity.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from peers.netlab import Lab, lab_available
from tests.swarm.lab_training import (
    BATCH,
    STEPS,
    SWARM,
    baseline_metrics,
    samples_by_this_peer,
    start_public_trainer,
)

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(300)]


#: The run's first round is the first to cross the routers (relayed, then punched
#: connections); under a loaded machine (the CI's two workers) a join can miss its
#: leader's gather window there, and the swarm splits once and follows the majority
#: (``StepMachine``), as designed. A split there earns the scenario one more run; a split
#: in any later round, or in both runs, fails the test.
FIRST_ROUND_SPLIT = "epoch 1: the swarm split; following the majority"
ATTEMPTS = 2


def _four_laptops_train() -> tuple[list[str], list[str]]:
    """One run of the scenario: every peer's stdout (the first's with its head) and
    stderr, after checking that all five finished every epoch, the laptops through NAT."""
    with Lab() as lab:
        server = lab.add_public_host("server")
        kinds = ("endpoint-independent", "symmetric", "endpoint-independent", "symmetric")
        laptops = [
            lab.add_lan_host(lab.add_home_router(f"home{i}", nat=kind), f"laptop{i}")
            for i, kind in enumerate(kinds, 1)
        ]
        assert len({laptop.address for laptop in laptops}) == 1  # one private address
        first, head, join = start_public_trainer(server, 1 + len(laptops))
        joiners = [
            laptop.popen([*SWARM, *join], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for laptop in laptops
        ]
        out_first, err_first = first.communicate(timeout=240)
        results = [proc.communicate(timeout=120) for proc in joiners]
    assert first.returncode == 0, err_first
    outputs = ["".join(head) + out_first, *(out for out, _ in results)]
    for proc, (out, err) in zip(joiners, results, strict=True):
        assert proc.returncode == 0, out + err
        assert re.search(r"behind NAT( \([^)]*\))?: reachable through", out), out
    for out in outputs:
        assert f"done: {STEPS} epochs, {BATCH * STEPS:,} global samples" in out, out
    return outputs, [err_first, *(err for _, err in results)]


@pytest.mark.timeout(560)
def test_four_laptops_behind_nat_join_as_told_and_train_the_single_process_model() -> None:
    for attempt in range(1, ATTEMPTS + 1):
        outputs, errors = _four_laptops_train()
        splits = [line for err in errors for line in err.splitlines() if " split; " in line]
        if not splits:
            break
        # Only the first round's split earns another run (FIRST_ROUND_SPLIT).
        assert attempt < ATTEMPTS and all(FIRST_ROUND_SPLIT in line for line in splits), splits
    metrics = [re.search(r"test metrics: loss (\S+), accuracy (\S+)", out) for out in outputs]
    assert all(m is not None for m in metrics), outputs
    # One model: gradient averaging gives every peer the same parameters.
    printed = {m.groups() for m in metrics if m is not None}
    assert len(printed) == 1, printed
    # The single process's model: the same batches, summed in another order (in the runs
    # here the same four digits; a slot filled twice under load moves the last one).
    ((loss, accuracy),) = printed
    baseline = baseline_metrics()
    assert abs(float(accuracy.rstrip("%")) / 100 - baseline["accuracy"]) <= 0.01, printed
    assert abs(float(loss) - baseline["loss"]) <= 0.005 * baseline["loss"], (printed, baseline)
    # Every sample of the run trained on, each once but for a slot or two filled twice
    parts = sum(samples_by_this_peer(out) for out in outputs)
    assert BATCH * STEPS <= parts <= BATCH * STEPS + 2 * BATCH // 5 + 2, outputs


def test_a_laptop_killed_mid_training_costs_the_others_nothing() -> None:
    with Lab() as lab:
        server = lab.add_public_host("server")
        kinds = ("endpoint-independent", "endpoint-independent", "symmetric")
        laptops = [
            lab.add_lan_host(lab.add_home_router(f"home{i}", nat=kind), f"laptop{i}")
            for i, kind in enumerate(kinds, 1)
        ]
        first, head, join = start_public_trainer(server, 1 + len(laptops))
        joiners = []
        for i, laptop in enumerate(laptops):
            progress = ["--progress", "json"] if i == 2 else []
            joiners.append(
                laptop.popen(
                    [*SWARM, *join, *progress],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        victim = joiners[2]  # behind the symmetric NAT: reached through nobody but itself
        assert victim.stdout is not None
        for line in victim.stdout:  # bounded by the pytest timeout
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("samples", 0) >= BATCH * 15:
                break
        victim.kill()  # SIGKILL, a laptop whose lid closed mid-round
        victim.communicate(timeout=30)
        out_first, err_first = first.communicate(timeout=240)
        results = [proc.communicate(timeout=120) for proc in joiners[:2]]
    assert first.returncode == 0, err_first
    outputs = ["".join(head) + out_first, *(out for out, _ in results)]
    for proc, (out, err) in zip(joiners[:2], results, strict=True):
        assert proc.returncode == 0, out + err
    for out in outputs:
        assert f"done: {STEPS} epochs" in out, out
    metrics = [re.search(r"test metrics: loss (\S+), accuracy (\S+)", out) for out in outputs]
    assert all(m is not None for m in metrics), outputs
    assert len({m.groups() for m in metrics if m is not None}) == 1, metrics
