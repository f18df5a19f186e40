"""A pipeline across real processes: a 3-stage model on 6 stage servers trains on the
digits task like the same model trained locally; one server is SIGKILLed mid-training
and its micro-batches are rerouted; a new server joins the thin stage, downloads its
state and receives traffic."""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from peers.dht import BlockingDHT, DHTConfig
from peers.testing import LocalSwarm, PeerProcess
from swarm.experts import ExpertCallConfig
from swarm.pipeline import DIGITS_STAGES, PipelineConfig, RemoteSequential
from swarm.tasks import Batch, get_task

TARGET = "swarm.pipeline.testing:stage_server"
#: Seconds a report may take on a loaded 2-core machine (imports, DHT joins).
REPORT_TIMEOUT = 60.0
LR = 3e-3
MICRO_BATCH = 32
MICRO_BATCHES_PER_STEP = 2
STEPS_BEFORE_KILL = 40
STEPS_AFTER_KILL = 40
#: Most steps the newcomer may take to get its first micro-batch.
MAX_STEPS_TO_JOIN = 40
#: Micro-batches whose mean loss is compared (the training loss is noisy per batch).
WINDOW = 40


def _stats(proc: PeerProcess) -> dict[str, int]:
    proc.send({"op": "stats"})
    return proc.wait_report("stats", REPORT_TIMEOUT)


def _local_losses(batches: list[Batch]) -> list[float]:
    """The same model, data and optimizer in this process: one step per micro-batch."""
    model = DIGITS_STAGES.build_local()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _steps(data: Iterator[Batch], num_steps: int) -> Iterator[list[Batch]]:
    for _ in range(num_steps):
        yield [next(data) for _ in range(MICRO_BATCHES_PER_STEP)]


def test_a_pipeline_trains_survives_a_killed_server_and_takes_a_newcomer() -> None:
    torch.set_num_threads(1)
    task = get_task("digits")
    data = task.batches(rank=0, num_peers=1, batch_size=MICRO_BATCH, seed=0)
    options = {
        "optimizer": "adam",
        "lr": LR,
        "average_interval": 1.0,
        "announce_interval": 1.0,
        "synchronous": False,  # each server steps on every backward, replicas average
    }
    with LocalSwarm() as local:
        (boot,) = local.start(1, target="peers.dht.testing:dht_node")
        boot.wait_report("joined", REPORT_TIMEOUT)
        options["initial_peers"] = [boot.maddr]
        servers = local.start(
            6,
            target=TARGET,
            options=options,
            per_peer_options=[{"stage": i // 2} for i in range(6)],
        )
        for server in servers:
            assert server.wait_report("serving", REPORT_TIMEOUT)["stage"] in (0, 1, 2)
        config = PipelineConfig(
            num_stages=DIGITS_STAGES.num_stages,
            calls=ExpertCallConfig(forward_timeout=10.0, backward_timeout=10.0),
            refresh_seconds=1.0,
            seed=0,
            synchronous=False,
        )
        losses: list[float] = []
        seen: list[Batch] = []
        dht_config = DHTConfig(initial_peers=(boot.maddr,), rpc_timeout=2.0)
        with BlockingDHT(config=dht_config) as dht:
            model = RemoteSequential(dht, config)
            for step in _steps(data, STEPS_BEFORE_KILL):
                losses += model.train_step(step, F.cross_entropy)
                seen += step
            # SIGKILL a server of the middle stage a moment into the next steps (while
            # training runs: micro-batches may be in flight there)
            victim = servers[2]
            killer = threading.Timer(0.1, local.kill, args=(victim,))
            killer.start()
            for step in _steps(data, STEPS_AFTER_KILL):
                losses += model.train_step(step, F.cross_entropy)  # no error: rerouted
                seen += step
            killer.join()
            assert not victim.alive
            rerouted = model.statistics().num_failed_calls
            assert rerouted >= 1  # the dead server was tried, and its micro-batches moved

            (newcomer,) = local.start(1, target=TARGET, options={**options, "stage": "auto"})
            joined = newcomer.wait_report("serving", REPORT_TIMEOUT)
            assert joined["stage"] == 1, joined  # the thin stage: 1 server, the others 2
            assert joined["loaded_version"] is not None  # downloaded from the survivor
            for i, step in enumerate(_steps(data, MAX_STEPS_TO_JOIN)):
                losses += model.train_step(step, F.cross_entropy)
                seen += step
                if i % 5 == 4 and _stats(newcomer)["backward_samples"] > 0:
                    break
            stats = _stats(newcomer)
            print("newcomer", stats, "client", model.statistics())
            assert stats["stage"] == 1 and stats["forward_samples"] > 0
            assert stats["backward_samples"] > 0 and stats["steps"] > 0
            survivor = _stats(servers[3])
            print("stage 0 server", _stats(servers[0]), "survivor", survivor)
            assert survivor["stage"] == 1 and survivor["backward_samples"] > 0

    local_losses = _local_losses(seen)
    kill_at = STEPS_BEFORE_KILL * MICRO_BATCHES_PER_STEP
    after_kill = kill_at + STEPS_AFTER_KILL * MICRO_BATCHES_PER_STEP

    def window(values: list[float], end: int) -> float:
        return statistics.mean(values[end - WINDOW : end])

    chance = math.log(10)  # the loss of a uniform guess over the 10 digits
    summary = {
        "first_window": window(losses, WINDOW),
        "at_kill": (window(losses, kill_at), window(local_losses, kill_at)),
        "after_kill": (window(losses, after_kill), window(local_losses, after_kill)),
        "final": (window(losses, len(losses)), window(local_losses, len(losses))),
        "rerouted": rerouted,
    }
    print("pipeline vs local mean losses:", summary)
    # it learns like the local run of the same model on the same micro-batches (replicas
    # that each see part of the data, and averaging once a second, cost it a little)
    for end in (after_kill, len(losses)):
        assert window(losses, end) < 0.25 * chance
        assert window(losses, end) < 3.0 * window(local_losses, end) + 0.1
    # still falling after the kill
    assert window(losses, after_kill) < 0.7 * window(losses, kill_at)
