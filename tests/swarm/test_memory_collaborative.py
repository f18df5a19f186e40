"""The collaborative optimizer on the in-memory network and its virtual clock: whole
training runs of the ``digits`` task among peers 80 ms apart, with the trainer's own
dealer choosing each peer's samples, in seconds of real time. A run matches one process
trained on the same global batches; a late joiner downloads the swarm's state and ends
on the same model; a peer killed mid-run costs the others nothing but its samples; two
halves of a cut swarm train apart and, healed, end on one model; DiLoCo (with its rounds
overlapped or not) ends with every peer on one model. The process tests
(test_collaborative.py) stay for real processes and sockets."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import torch

from peers.dht.config import DHTConfig
from peers.dht.node import DHT
from peers.memory_network import MemoryNetwork, MemoryPeer, run_virtual
from swarm.baseline import BaselineConfig, run_baseline
from swarm.collaborative.config import CollaborativeConfig, DiLoCoConfig
from swarm.collaborative.driver import CollaborativeDriver
from swarm.tasks import get_task
from swarm.tasks.base import SampleStream, Task
from swarm.trainer import RunPlan, _Dealer

T = TypeVar("T")
ROUND_TRIP = 0.080
BYTES_PER_SECOND = 12.5e6  # 100 Mbit/s each way
GLOBAL_BATCH = 64
#: Virtual seconds one local batch of the digits model takes (its real CPU time here is
#: a millisecond or two, which the virtual clock does not see).
COMPUTE_SECONDS = 0.05
#: As the process tests: a dead peer's record expires in 3 s, a peer waits 1 s for a
#: global step before it takes over what is missing.
FAST = {"progress_expiration": 3.0, "max_wait_seconds": 1.0}
SLOW_PEER_SECONDS = 5.0  # the trainer's patience with a member that delivers nothing
SEED = 0


@dataclasses.dataclass
class Trainer:
    """One peer of the run: its model, its driver, and how it ended."""

    peer: MemoryPeer
    dht: DHT[MemoryPeer]
    driver: CollaborativeDriver[MemoryPeer]
    model: torch.nn.Module
    moved: asyncio.Event  # set whenever the driver's epoch moves
    loaded: bool = False
    settled: bool = False

    async def reach(self, epoch: int) -> None:
        """Until this peer's epoch is ``epoch`` or more."""
        while self.driver.epoch < epoch:
            self.moved.clear()
            await self.moved.wait()

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


class Swarm:
    """Peers on one in-memory network, each a DHT node and a collaborative driver over
    the digits model; :meth:`train` runs one peer's training loop as the trainer does."""

    def __init__(
        self, net: MemoryNetwork, stack: contextlib.AsyncExitStack, config: CollaborativeConfig
    ) -> None:
        self.net = net
        self.stack = stack
        self.config = config
        self.task: Task = get_task("digits")
        self.trainers: list[Trainer] = []
        self.bootstrap: tuple[str, ...] = ()

    async def add(self) -> Trainer:
        loop = asyncio.get_running_loop()
        peer = self.net.add_peer()
        for other in self.trainers:
            self.net.set_bandwidth(peer, other.peer, BYTES_PER_SECOND)
        dht: DHT[MemoryPeer] = DHT(
            peer,
            DHTConfig(initial_peers=self.bootstrap, rpc_timeout=2.0, maintenance_interval=3600.0),
            clock=loop.time,
        )
        await self.stack.enter_async_context(dht)
        if not self.bootstrap:
            self.bootstrap = (str(peer.listen_addrs[0]),)
        model = self.task.make_model(SEED)
        model.train()
        inner = self.task.recipe.optimizer.build(model.parameters())
        moved = asyncio.Event()
        driver = CollaborativeDriver(inner, dht, self.config, on_epoch=moved.set)
        await self.stack.enter_async_context(driver)
        trainer = Trainer(peer, dht, driver, model, moved)
        self.trainers.append(trainer)
        return trainer

    def plan(self, num_samples: int) -> RunPlan:
        inner_steps = 1 if self.config.diloco is None else self.config.diloco.inner_steps
        return RunPlan(
            target_batch_size=GLOBAL_BATCH,
            local_batch_size=0,
            num_samples=num_samples,
            total_epochs=num_samples // (GLOBAL_BATCH * inner_steps),
            samples_per_epoch=GLOBAL_BATCH * inner_steps,
        )

    async def train(self, trainer: Trainer, plan: RunPlan, num_peers: int) -> None:
        """swarm.trainer.train's loop, on the driver: join (load the swarm's state, or
        wait for the run's peers), train the dealer's slots until the last epoch, then
        take the last round in and settle with the others."""
        driver, task = trainer.driver, self.task
        loop = asyncio.get_running_loop()
        trainer.loaded = await driver.load_state_from_peers()
        if not trainer.loaded and driver.epoch == 0:
            await driver.wait_for_peers(num_peers, timeout=30.0)
            trainer.loaded = await driver.load_state_from_peers()
        stream = SampleStream(task.num_train, SEED)
        dealer = _Dealer(driver, self.config.run_id, plan, SLOW_PEER_SECONDS, clock=loop.time)
        while driver.phase < plan.total_epochs:
            slot = dealer.next_slot()
            if slot is None:  # our part is done: the others are still on theirs
                await driver.step(0)
                continue
            loss = task.loss(trainer.model, task.examples(stream.indices(slot.start, slot.stop)))
            loss.backward()  # type: ignore[no-untyped-call]
            await asyncio.sleep(COMPUTE_SECONDS)
            await driver.step(slot.size)
        await driver.take_in_round()
        trainer.settled = await driver.finish()


def _run(
    scenario: Callable[[Swarm], Awaitable[T]],
    config: CollaborativeConfig,
    *,
    seed: int = 0,
    max_virtual_seconds: float = 1800.0,
) -> T:
    async def main() -> T:
        async with (
            MemoryNetwork(seed=seed, latency_seconds=ROUND_TRIP / 2) as net,
            contextlib.AsyncExitStack() as stack,
        ):
            return await scenario(Swarm(net, stack, config))

    torch.manual_seed(seed)
    return run_virtual(main(), max_virtual_seconds=max_virtual_seconds)


def _config(**fields: Any) -> CollaborativeConfig:
    return CollaborativeConfig(
        run_id="memory", target_batch_size=GLOBAL_BATCH, **{**FAST, **fields}
    )


def _baseline_loss(num_samples: int) -> float:
    task = get_task("digits")
    config = BaselineConfig(
        task="digits",
        batch_size=GLOBAL_BATCH,
        num_samples=num_samples,
        optimizer=task.recipe.optimizer,
        seed=SEED,
    )
    return run_baseline(config, task=task).metrics["loss"]


def _one_model(trainers: list[Trainer]) -> None:
    first = trainers[0].flat()
    for t in trainers[1:]:
        assert torch.equal(t.flat(), first), "the peers ended on different models"


def test_four_peers_80_ms_apart_train_the_single_process_model() -> None:
    """Every global step averages the whole global batch, the same samples as one
    process's step: the swarm's model is the baseline's up to float rounding, and every
    peer holds it bit for bit."""
    num_samples = GLOBAL_BATCH * 20

    async def scenario(swarm: Swarm) -> tuple[list[Trainer], float]:
        trainers = [await swarm.add() for _ in range(4)]
        started = asyncio.get_running_loop().time()
        plan = swarm.plan(num_samples)
        await asyncio.gather(*(swarm.train(t, plan, 4) for t in trainers))
        return trainers, asyncio.get_running_loop().time() - started

    trainers, seconds = _run(scenario, _config())
    print(f"20 global steps of 4 peers 80 ms apart: {seconds:.1f} virtual s")
    for t in trainers:
        stats = t.driver.statistics()
        assert t.driver.epoch == 20 and t.settled
        assert stats.num_rounds == 20 and stats.num_rounds_alone == 0, stats
        assert stats.num_state_loads == 0 and stats.num_splits == 0, stats
    _one_model(trainers)
    loss = get_task("digits").evaluate(trainers[0].model)["loss"]
    baseline = _baseline_loss(num_samples)
    assert abs(loss - baseline) <= 1e-4 * baseline, (loss, baseline)


def test_a_late_joiner_downloads_the_state_and_ends_on_the_same_model() -> None:
    num_samples = GLOBAL_BATCH * 16

    async def scenario(swarm: Swarm) -> list[Trainer]:
        plan = swarm.plan(num_samples)
        first = [await swarm.add() for _ in range(3)]
        runs = [asyncio.create_task(swarm.train(t, plan, 3)) for t in first]
        await first[0].reach(5)
        late = await swarm.add()
        await asyncio.gather(*runs, swarm.train(late, plan, 3))
        return [*first, late]

    trainers = _run(scenario, _config())
    late = trainers[-1]
    assert late.loaded and late.driver.statistics().num_state_loads >= 1
    for t in trainers:
        assert t.driver.epoch == 16 and t.settled
    _one_model(trainers)


def test_a_peer_killed_mid_run_costs_the_others_only_its_samples() -> None:
    """One of four peers dies at its fifth epoch: the other three take over its slots
    (after its record expires) and finish every epoch on one model, the one process's
    model still."""
    num_samples = GLOBAL_BATCH * 12

    async def scenario(swarm: Swarm) -> list[Trainer]:
        plan = swarm.plan(num_samples)
        trainers = [await swarm.add() for _ in range(4)]
        runs = [asyncio.create_task(swarm.train(t, plan, 4)) for t in trainers]
        victim = trainers[3]
        await victim.reach(5)
        swarm.net.kill(victim.peer)
        runs[3].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runs[3]
        await asyncio.gather(*runs[:3])
        return trainers[:3]

    survivors = _run(scenario, _config())
    for t in survivors:
        assert t.driver.epoch == 12 and t.settled
    _one_model(survivors)
    # The victim's slots went to the survivors, samples and all: each global step still
    # averaged the baseline's global batch.
    loss = get_task("digits").evaluate(survivors[0].model)["loss"]
    baseline = _baseline_loss(num_samples)
    assert abs(loss - baseline) <= 1e-4 * baseline, (loss, baseline)


def test_two_halves_of_a_cut_swarm_train_apart_and_end_on_one_model() -> None:
    """Five peers; the links between {0, 1, 2} and {3, 4} are cut for 8 virtual seconds
    (longer than a record lives), and each half steps on its own branch. Healed, they
    see each other's records, follow one branch by loading its state, and every peer
    ends the run on one model."""
    num_samples = GLOBAL_BATCH * 24

    async def scenario(swarm: Swarm) -> tuple[list[Trainer], list[int]]:
        plan = swarm.plan(num_samples)
        trainers = [await swarm.add() for _ in range(5)]
        runs = [asyncio.create_task(swarm.train(t, plan, 5)) for t in trainers]
        await trainers[0].reach(3)
        big, small = trainers[:3], trainers[3:]
        for a in big:
            for b in small:
                swarm.net.cut(a.peer, b.peer)
        at_cut = [t.driver.epoch for t in trainers]
        await asyncio.sleep(8.0)
        apart = [t.driver.epoch - e for t, e in zip(trainers, at_cut, strict=True)]
        for a in big:
            for b in small:
                swarm.net.heal(a.peer, b.peer)
        await asyncio.gather(*runs)
        return trainers, apart

    trainers, apart = _run(scenario, _config())
    assert all(n >= 2 for n in apart), apart  # both halves trained on while cut
    for t in trainers:
        assert t.driver.epoch == 24 and t.settled
    # The halves met on different branches: one of them loaded the other's state (by
    # split detection, or as peers behind the swarm's epoch: which, timing decides).
    loads = [t.driver.statistics().num_state_loads for t in trainers]
    assert all(n >= 1 for n in loads[:3]) or all(n >= 1 for n in loads[3:]), loads
    _one_model(trainers)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_diloco_peers_end_each_outer_step_on_one_model(overlap: bool) -> None:
    inner_steps = 5
    outer_steps = 6
    num_samples = GLOBAL_BATCH * inner_steps * outer_steps
    config = _config(diloco=DiLoCoConfig(inner_steps=inner_steps, overlap=overlap))

    async def scenario(swarm: Swarm) -> list[Trainer]:
        plan = swarm.plan(num_samples)
        trainers = [await swarm.add() for _ in range(4)]
        await asyncio.gather(*(swarm.train(t, plan, 4) for t in trainers))
        return trainers

    trainers = _run(scenario, config)
    for t in trainers:
        stats = t.driver.statistics()
        assert t.driver.epoch == outer_steps and t.settled
        assert stats.num_rounds == outer_steps and stats.num_state_loads == 0, stats
    _one_model(trainers)
    loss = get_task("digits").evaluate(trainers[0].model)["loss"]
    assert loss < 1.0, loss
