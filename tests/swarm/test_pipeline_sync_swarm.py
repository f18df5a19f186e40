"""Synchronous stages across real processes, with the charlm transformer: 3 stages x 2
servers train exactly like one process accumulating the same micro-batches; a server
SIGKILLed in the middle of a step costs no sample and counts none twice (its part is
redone on its stage's other server); a newcomer takes the stage left thin, downloads it
as of its last step, and steps with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peers.dht import BlockingDHT, DHTConfig
from peers.testing import LocalSwarm, PeerProcess
from swarm.experts import ExpertCallConfig
from swarm.experts.remote import run_blocking
from swarm.optim_spec import OptimizerSpec
from swarm.pipeline import CHARLM_STAGES, PipelineClient, PipelineConfig
from swarm.tasks import Batch, get_task

TARGET = "swarm.pipeline.testing:stage_server"
#: Seconds a report may take on a loaded 2-core machine (imports, DHT joins).
REPORT_TIMEOUT = 60.0
LR = 3e-3
MICRO_BATCH = 8
MICRO_BATCHES = 4
STEPS = 12
KILL_AT = 4  # in the middle of this step
NEWCOMER_AT = 7


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def _stats(proc: PeerProcess) -> dict[str, int]:
    proc.send({"op": "stats"})
    return proc.wait_report("stats", REPORT_TIMEOUT)


@pytest.mark.timeout(300)
def test_a_transformer_pipeline_loses_a_server_mid_step_and_takes_a_newcomer_like_one_process() -> (
    None
):
    torch.set_num_threads(1)
    task = get_task("charlm")
    data = task.batches(rank=0, num_peers=1, batch_size=MICRO_BATCH, seed=0)
    steps: list[list[Batch]] = [[next(data) for _ in range(MICRO_BATCHES)] for _ in range(STEPS)]
    options = {
        "model": "charlm",
        "synchronous": True,
        "clip": "none",
        "optimizer": "adam",
        "lr": LR,
        "announce_interval": 1.0,
    }
    local = CHARLM_STAGES.build_local()
    optimizer = OptimizerSpec(kind="adam", lr=LR).build(local.parameters())
    with LocalSwarm() as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        boot.wait_report("joined", REPORT_TIMEOUT)
        options["initial_peers"] = [boot.maddr]
        servers = swarm.start(
            6,
            target=TARGET,
            options=options,
            per_peer_options=[{"stage": i // 2} for i in range(6)],
        )
        for server in servers:
            assert server.wait_report("serving", REPORT_TIMEOUT)["stage"] in (0, 1, 2)
        config = PipelineConfig(
            num_stages=3,
            calls=ExpertCallConfig(forward_timeout=20.0, backward_timeout=20.0),
            refresh_seconds=1.0,
            seed=0,
            synchronous=True,
            step_timeout=60.0,
        )
        newcomer = None
        dht_config = DHTConfig(initial_peers=(boot.maddr,), rpc_timeout=2.0)
        with BlockingDHT(config=dht_config) as dht:
            client = PipelineClient(dht.node, config)
            for step, batches in enumerate(steps):
                if step == NEWCOMER_AT:
                    (newcomer,) = swarm.start(
                        1, target=TARGET, options={**options, "stage": "auto"}
                    )
                    joined = newcomer.wait_report("serving", REPORT_TIMEOUT)
                    assert joined["stage"] == 1, joined  # the thin stage: 1 server, the others 2
                    assert joined["loaded_version"] is not None  # downloaded from the survivor
                total = MICRO_BATCH * MICRO_BATCHES
                if step == KILL_AT:
                    before = [_stats(p)["backward_samples"] for p in servers[2:4]]
                losses = [
                    run_blocking(dht.peer, client.train_micro_batch(x, y, _loss, len(x) / total))
                    for x, y in batches
                ]
                if step == KILL_AT:  # a server of the middle stage, holding part of the step
                    served = [
                        _stats(p)["backward_samples"] - b
                        for p, b in zip(servers[2:4], before, strict=True)
                    ]
                    victim = servers[2 + served.index(max(served))]
                    swarm.kill(victim)  # SIGKILL
                assert run_blocking(dht.peer, client.end_step()) == step + 1
                expected = []
                for x, y in batches:  # one process: the same micro-batches, accumulated
                    loss = _loss(local(x), y)
                    (loss * len(x) / total).backward()
                    expected.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
                # every step's forward passes went through stages equal to the local model
                assert losses == pytest.approx(expected, abs=1e-4), step
            statistics = client.statistics()
            print("client", statistics.num_steps, "steps, redone", statistics.num_redone_backwards)
            assert statistics.num_redone_backwards > 0  # the victim's part of its step
            assert newcomer is not None and _stats(newcomer)["backward_samples"] > 0
            test_x, test_y = task.test_inputs[:64], task.test_targets[:64]
            outputs, _ = run_blocking(dht.peer, client.forward([test_x]))
            with torch.no_grad():
                expected_loss = _loss(local(test_x), test_y).item()
            assert _loss(outputs[0], test_y).item() == pytest.approx(expected_loss, rel=0.01)
