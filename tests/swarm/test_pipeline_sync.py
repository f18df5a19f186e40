"""Synchronous stages (swarm.pipeline.sync) on loopback, in one process: a stage's servers
sum their gradients and step together, once per global batch, so the pipeline trains
exactly like one process doing the same gradient accumulation."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from averaging import AllReduceConfig
from peers import RemoteError
from peers.identity import PeerID
from swarm.experts import ExpertCallConfig, ServerConfig
from swarm.experts import worker as worker_module
from swarm.experts.announce import ExpertLocation, find_experts
from swarm.experts.calls import call_backward
from swarm.optim_spec import OptimizerSpec
from swarm.pipeline import (
    CHARLM_STAGES,
    DIGITS_STAGES,
    MLPStages,
    PipelineClient,
    PipelineConfig,
    PipelineModel,
    ReplicaConfig,
    StageBehind,
    StageFailed,
    StageServer,
    StageServerConfig,
    StageUnavailable,
    WiringConfig,
)
from swarm.pipeline.sync import (
    MAX_STEP_PASSES,
    STEP_PROTOCOL,
    StepRequest,
    StepResponse,
    SyncConfig,
)
from swarm.tasks import get_task
from tests.swarm.pipeline_loop import Hosted, Swarm, local_swarm, state_of

torch.set_num_threads(1)
Run = Callable[[Coroutine[Any, Any, Any]], Any]
MODEL = MLPStages(widths=((8, 16), (16, 24, 16), (16, 4)), seed=5)
LR = 0.1
MICRO_BATCHES = 4
MICRO_BATCH = 8


def _config(
    stage: int, model: PipelineModel = MODEL, optimizer: OptimizerSpec | None = None
) -> StageServerConfig:
    return StageServerConfig(
        model=model,
        stage=stage,
        optimizer=optimizer or OptimizerSpec(kind="sgd", lr=LR, momentum=0.9),
        clip_grad_norm=None,  # the local baseline does not clip
        max_batch_size=64,
        server=ServerConfig(announce_interval=0.5, announce_ttl=1.5),
        replicas=ReplicaConfig(run_id="sync", interval_seconds=3600.0, load_timeout=10.0),
        synchronous=True,
        sync=SyncConfig(
            allreduce=AllReduceConfig(sender_timeout=3.0, reducer_timeout=6.0, round_timeout=12.0)
        ),
        probe_timeout=1.0,
    )


def _client_config(num_stages: int = 3) -> PipelineConfig:
    return PipelineConfig(
        num_stages=num_stages,
        calls=ExpertCallConfig(forward_timeout=30.0, backward_timeout=30.0),
        refresh_seconds=0.2,
        server_wait_timeout=1.0,
        seed=0,
        synchronous=True,
        step_timeout=60.0,
    )


def _batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 100 + index)
    return torch.randn(MICRO_BATCH, 8, generator=gen), torch.randint(
        0, 4, (MICRO_BATCH,), generator=gen
    )


def _backward_samples(hosted: Hosted) -> int:
    stats = hosted.server.statistics().server
    assert stats is not None
    return sum(m.num_backward_samples for m in stats.modules.values())


async def _assert_stages_are(local: torch.nn.Sequential, hosted: list[Hosted]) -> None:
    """Every server of each stage holds the local model's part, all of them the same bits."""
    for stage in range(len(local)):
        servers = [h for h in hosted if h.server.statistics().stage == stage]
        states = [await state_of(h) for h in servers]
        for name, value in local[stage].state_dict().items():
            assert all(torch.equal(states[0][name], s[name]) for s in states[1:])
            assert torch.allclose(states[0][name], value, atol=1e-5), (stage, name)


async def _backward_passes(client: PipelineClient, local: torch.nn.Sequential, step: int) -> None:
    """The step's micro-batches through the pipeline and the local model alike, each
    loss weighted by its share of the batch; nobody steps."""
    total = MICRO_BATCH * MICRO_BATCHES
    for x, y in (_batch(step, i) for i in range(MICRO_BATCHES)):
        await client.train_micro_batch(x, y, _loss, x.shape[0] / total)
        (_loss(local(x), y) * x.shape[0] / total).backward()


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position (the transformer's logits are per position)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


async def _client(swarm: Swarm) -> PipelineClient:
    """A synchronous client of ``swarm``'s stages that has read where they are."""
    client = PipelineClient(await swarm.node(), _client_config())
    await client.refresh()
    return client


async def _ask_step(client: PipelineClient, server: Hosted, request: StepRequest) -> StepResponse:
    """``request`` sent to ``server``'s step protocol as any peer could send it."""
    return await client.peer.call_unary(
        server.server.peer.peer_id, STEP_PROTOCOL, request, StepResponse, timeout=10.0
    )


#: (task, its model cut in 3 stages, steps): the digits MLP and the charlm transformer.
CASES = {"digits": (DIGITS_STAGES, 12), "charlm": (CHARLM_STAGES, 6)}


@pytest.mark.parametrize("task_name", sorted(CASES))
def test_stages_of_two_servers_step_together_like_one_process_accumulating(
    arun: Run, task_name: str
) -> None:
    model, steps = CASES[task_name]
    task = get_task(task_name)
    adam = OptimizerSpec(kind="adam", lr=3e-3)

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [
                await swarm.serve(_config(stage, model, adam))
                for stage in range(3)
                for _ in range(2)
            ]
            client = await _client(swarm)
            local = model.build_local()
            optimizer = adam.build(local.parameters())
            batches = task.batches(rank=0, num_peers=1, batch_size=MICRO_BATCH, seed=0)
            with torch.no_grad():
                before = _loss(local(task.test_inputs), task.test_targets).item()
            for step in range(steps):
                micro_batches = [next(batches) for _ in range(MICRO_BATCHES)]
                losses = await client.train(micro_batches, _loss)
                # one process: the batch's mean loss, accumulated micro-batch by
                # micro-batch, then one step
                expected = []
                for x, y in micro_batches:
                    loss = _loss(local(x), y)
                    (loss * x.shape[0] / (MICRO_BATCH * MICRO_BATCHES)).backward()
                    expected.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
                assert losses == pytest.approx(expected, abs=1e-4), step

            for stage in range(3):
                first, second = hosted[2 * stage : 2 * stage + 2]
                remote, other = await state_of(first), await state_of(second)
                for name, value in local[stage].state_dict().items():
                    # the replicas are one model, bit for bit, and it is the local one
                    assert torch.equal(remote[name], other[name]), (stage, name)
                    assert torch.allclose(remote[name], value, atol=1e-4), (stage, name)
                # every sample went through the stage once, whichever server took it
                served = _backward_samples(first) + _backward_samples(second)
                assert served == steps * MICRO_BATCHES * MICRO_BATCH
                for h in (first, second):
                    stats = h.server.statistics().server
                    assert stats is not None
                    (module,) = stats.modules.values()
                    assert module.num_optimizer_steps == steps
                    # forwards kept their graphs, batched or not: no backward recomputed
                    assert module.num_recomputed_samples == 0
            # the wiring spread the micro-batches: some server of a stage took some
            assert any(_backward_samples(h) for h in hosted[1::2])
            # and the pipeline's test loss is the local model's (within 1%), having learnt
            chunks = [(await client.forward([x]))[0][0] for x in task.test_inputs.split(64)]
            remote_loss = _loss(torch.cat(chunks), task.test_targets).item()
            with torch.no_grad():
                local_loss = _loss(local(task.test_inputs), task.test_targets).item()
            print(task_name, "test loss", before, "->", remote_loss, "local", local_loss)
            assert remote_loss == pytest.approx(local_loss, rel=0.01)
            assert local_loss < 0.9 * before

    arun(main())


def test_a_step_request_steps_once_and_a_server_behind_says_so(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3)]
            client = await _client(swarm)
            await client.train([_batch(0, 0)], F.cross_entropy)  # step 0 ended

            def ask(request: StepRequest) -> Coroutine[Any, Any, StepResponse]:
                return _ask_step(client, hosted[1], request)

            # step 0 again (a retry whose answer was lost): answered, not stepped
            again = await ask(StepRequest("stage.1", 0))
            assert (again.step, again.samples, again.group_size) == (1, MICRO_BATCH, 1)
            assert (await ask(StepRequest("stage.1", -1, end=False))).step == 1
            with pytest.raises(
                RemoteError, match="asked to end step 5, but this server has taken 1"
            ):
                await ask(StepRequest("stage.1", 5))
            with pytest.raises(RemoteError, match=r"does not serve 'stage\.2' synchronously"):
                await ask(StepRequest("stage.2", 1))
            stats = hosted[1].server.statistics().server
            assert stats is not None
            assert next(iter(stats.modules.values())).num_optimizer_steps == 1
            # the client goes on from where the stages are
            assert await client.end_step() == 2

            await swarm.kill(hosted[2])
            with pytest.raises(StageUnavailable, match="stage 2"):
                await client.end_step()  # its only server is gone: nobody can redo its part

    arun(main())


def test_a_server_lost_in_the_middle_of_a_step_has_its_part_redone_and_nothing_counted_twice(
    arun: Run,
) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3) for _ in range(2)]
            client = await _client(swarm)
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            for step in range(3):
                await _backward_passes(client, local, step)  # the step's, not yet ended
                optimizer.step()
                optimizer.zero_grad()
                if step == 1:  # a server of stage 1 that holds some of the step goes
                    victim = max(hosted[2:4], key=_backward_samples)
                    assert _backward_samples(victim) > 0
                    await swarm.kill(victim)
                    hosted.remove(victim)
                assert await client.end_step() == step + 1
            assert client.statistics().num_redone_backwards > 0
            await _assert_stages_are(local, hosted)

    arun(main())


def test_a_newcomer_downloads_the_stage_as_of_its_last_step_and_steps_with_it(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3)]
            client = await _client(swarm)
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            for step in range(4):
                if step == 2:  # joins the stage where the most work waits (stage 1 here)
                    newcomer = await swarm.serve(_config(1))
                    stats = newcomer.server.statistics()
                    assert stats.loaded_version is not None  # it downloaded the stage
                    hosted.append(newcomer)
                batches = [_batch(step, i) for i in range(MICRO_BATCHES)]
                await client.train(batches, _loss)
                for x, y in batches:
                    (_loss(local(x), y) * x.shape[0] / (MICRO_BATCH * MICRO_BATCHES)).backward()
                optimizer.step()
                optimizer.zero_grad()
            assert _backward_samples(hosted[-1]) > 0  # it took part in the last two steps
            await _assert_stages_are(local, hosted)

    arun(main())


def test_a_synchronous_step_is_clipped_whatever_a_caller_sends(arun: Run) -> None:
    """Stage servers train on strangers' gradients: synchronous too, each caller's
    contribution is clipped on its own and the step's sum again, so one huge gradient
    moves a stage by at most ``lr * clip_grad_norm`` (docs/experts-trust.md)."""

    async def main() -> None:
        async with local_swarm() as swarm:
            config = dataclasses.replace(
                _config(2), optimizer=OptimizerSpec(kind="sgd", lr=LR), clip_grad_norm=1.0
            )
            hosted = [await swarm.serve(_config(0)), await swarm.serve(_config(1))]
            hosted.append(await swarm.serve(config))
            client = await _client(swarm)
            before = await state_of(hosted[2])
            x = torch.randn(4, 16)
            (location,) = (await find_experts(client.dht, ["stage.2"]))["stage.2"]
            huge = torch.full((4, 4), 1e6)
            await call_backward(
                client.peer, location.location, [x], [huge], config=ExpertCallConfig(), step=0
            )
            assert await client.end_step() == 1
            after = await state_of(hosted[2])
            moved = torch.linalg.vector_norm(
                torch.cat([(after[k] - before[k]).flatten() for k in before])
            )
            assert 0 < moved <= LR * 1.0 + 1e-6

    arun(main())


def _fall_behind(server: StageServer) -> None:
    """As if it had loaded the state just before the last step: one step, old values."""
    sync = server._sync
    assert sync is not None
    sync.step -= 1
    with torch.no_grad():
        for p in sync.params.values():
            p.add_(1.0)


def test_a_server_behind_its_stage_refuses_calls_and_catches_up(arun: Run) -> None:
    """A server that missed a step (here: one made to look like it downloaded the state
    just before the last step, with older parameters) would compute on old parameters:
    it refuses every call naming the stage's step, the client reroutes to the stage's
    other server and leaves it out of the step, and it loads the stage's state."""

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in (0, 1, 1, 2)]
            client = await _client(swarm)
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            late = hosted[2].server
            for step in range(6):
                if step == 2:
                    assert late._sync is not None and late.worker is not None
                    await late.worker.exclusive(lambda: _fall_behind(late))
                batches = [_batch(step, i) for i in range(MICRO_BATCHES)]
                await client.train(batches, _loss)
                for x, y in batches:
                    (_loss(local(x), y) * x.shape[0] / (MICRO_BATCH * MICRO_BATCHES)).backward()
                optimizer.step()
                optimizer.zero_grad()
            sync = late._sync
            assert sync is not None
            # the client reroutes its calls while it is banned; the next that names a
            # later step (here, one made directly) has it load the stage again
            with pytest.raises(StageBehind):
                sync.check_step(6)
            for _ in range(100):  # bounded: 10 s
                if sync.step == 6:
                    break
                await asyncio.sleep(0.1)
            assert sync.step == 6
            await _assert_stages_are(local, hosted)  # and equal to the others, bit for bit

    arun(main())


def test_a_caller_naming_a_far_step_downloads_nothing_unless_the_stage_is_there(
    arun: Run,
) -> None:
    """A call naming a later step than the server's makes it catch up, but only to a step
    the stage's other servers say they took: a hostile caller naming step 10**9 would
    otherwise have it download the stage's state (and the others share theirs) again and
    again."""

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in (0, 1, 1, 2)]
            client = await _client(swarm)
            await client.train([_batch(0, i) for i in range(2)], _loss)  # step 0 ended
            target, other = hosted[1].server, hosted[2].server
            sync = target._sync
            assert sync is not None and sync.step == 1
            assert target.statistics().loaded_version is None  # the stage's first server

            def shared() -> int:
                replica = other.statistics().replica
                assert replica is not None
                return replica.num_shared

            shares_before = shared()
            with pytest.raises(RemoteError, match="asked to end step 1000000"):
                await _ask_step(client, hosted[1], StepRequest("stage.1", 10**6))
            for _ in range(3):
                with pytest.raises(StageBehind):
                    sync.check_step(10**9)
                catching = sync._catching
                assert catching is not None
                await asyncio.wait_for(asyncio.shield(catching), 10.0)
            assert target.statistics().loaded_version is None  # nothing downloaded
            assert shared() == shares_before  # nor asked of the other server
            assert (sync.step, sync.seen) == (1, 1)
            # it serves and steps as before
            await client.train([_batch(1, i) for i in range(2)], _loss)
            assert sync.step == 2

    arun(main())


def test_an_asynchronous_client_may_infer_but_not_train_on_synchronous_stages(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            for stage in range(3):
                await swarm.serve(_config(stage))
            config = dataclasses.replace(_client_config(), synchronous=False, max_attempts=1)
            client = PipelineClient(await swarm.node(), config)
            await client.refresh()
            x, y = _batch(0, 0)
            outputs, _ = await client.forward([x])  # inference names no step: served
            assert outputs[0].shape == (MICRO_BATCH, 4)
            with pytest.raises(StageFailed, match="a backward must name the client's step"):
                await client.train_micro_batch(x, y, _loss)

    arun(main())


def test_a_server_banned_for_slowness_still_steps_with_the_gradients_it_holds(arun: Run) -> None:
    """The wiring bans a server that failed a call (slow, busy) for a while; if it served
    backward passes of the step before that, its gradients are part of the step: it is
    asked to the step's round all the same."""

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3) for _ in range(2)]
            client = await _client(swarm)
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            for step in range(2):
                await _backward_passes(client, local, step)
                optimizer.step()
                optimizer.zero_grad()
                if step == 1:  # (banned, a server with no part in a step sits it out)
                    busiest = max(hosted[2:4], key=_backward_samples)
                    peer_id = busiest.server.peer.peer_id
                    client.wirings[1].on_failure(peer_id, 0, time.monotonic(), busy=False)
                    assert client.wirings[1].is_banned(peer_id, time.monotonic())
                assert await client.end_step() == step + 1
            await _assert_stages_are(local, hosted)

    arun(main())


def test_garbage_step_requests_are_refused_and_the_server_keeps_serving(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3)]
            client = await _client(swarm)

            def ask(request: StepRequest) -> Coroutine[Any, Any, StepResponse]:
                return _ask_step(client, hosted[1], request)

            for request, says in (
                (StepRequest("stage.1", 0, group_size=0), "group_size and members"),
                (StepRequest("stage.1", 0, group_size=10**6), "group_size and members"),
                (StepRequest("stage.1", 0, 2, members=[b"\\x00junk", b"x"]), "not peer IDs"),
                (StepRequest("stage.1", 0, 2, members=[b"p"] * 100), "group_size and members"),
                (StepRequest("x" * 10_000, 0), "does not serve"),
                (StepRequest("stage.1", 0, passes=["x"]), "passes"),  # type: ignore[list-item]
                (StepRequest("stage.1", 0, passes=[1] * (MAX_STEP_PASSES + 1)), "at most"),
            ):
                with pytest.raises(RemoteError, match=says):
                    await ask(request)
            # nothing stepped, and the stages train and step as before
            await client.train([_batch(0, 0)], _loss)
            assert (await ask(StepRequest("stage.1", -1, end=False))).step == 1

    arun(main())


class _LateOnce:
    """Wraps a backend's backward: once armed, its next backward sleeps ``seconds`` in
    the worker's thread before computing (a server too slow for the caller's timeout,
    which still computes the pass and adds its gradients after the caller gave up)."""

    def __init__(self, hosted: Hosted, seconds: float) -> None:
        worker = hosted.server.worker
        assert worker is not None
        self.backend = worker.backend
        self.seconds = seconds
        self.armed = False
        self.done = threading.Event()
        self._backward = self.backend.backward
        self.backend.backward = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor | None]:
        if self.armed:
            self.armed = False
            time.sleep(self.seconds)
            try:
                return self._backward(*args, **kwargs)
            finally:
                self.done.set()
        return self._backward(*args, **kwargs)


async def _pass_through(
    client: PipelineClient,
    local: torch.nn.Sequential,
    x: torch.Tensor,
    y: torch.Tensor,
    scale: float,
    via: Hosted,
) -> None:
    """One micro-batch whose stage-1 forward (so its backward, first) went to ``via``;
    the local model accumulates the same."""
    peer_id = via.server.peer.peer_id
    for _ in range(64):  # the wiring is random: forward until one goes through ``via``
        outputs, trace = await client.forward([x], keep=True)
        location = trace.calls[1].location
        if location is not None and location.peer_id == peer_id:
            break
    else:
        raise AssertionError("no forward went through the server")
    with torch.enable_grad():
        out = outputs[0].requires_grad_(True)
        (grad,) = torch.autograd.grad(_loss(out, y) * scale, out)
    await client.backward(trace, [grad])
    (_loss(local(x), y) * scale).backward()


@pytest.mark.parametrize("case", ["checked first", "found in the round", "killed after the drop"])
def test_a_backward_the_client_gave_up_on_counts_once_though_the_server_computed_it(
    arun: Run, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """A stage server too slow for the client's backward timeout computes the pass
    anyway, after the client had it redone on the stage's other server. At the step's
    end it holds a pass the client did not have answered there. The client, which gave
    up on a backward there, asks it before the round: it is told to drop the step's
    gradients, the passes it had answered are redone, and the stage takes exactly the
    step of one process at its first round. Without that check (a pass landing after
    it) the server refuses the round and the same happens at the next attempt. If it
    dies right after the drop, the stage steps without it (it is not waited for as a
    dropped server)."""
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)  # in a thread

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in (0, 1, 1, 2)]
            slow, other = hosted[1], hosted[2]
            late = _LateOnce(slow, seconds=2.5)
            config = dataclasses.replace(
                _client_config(),
                calls=ExpertCallConfig(forward_timeout=30.0, backward_timeout=1.0),
            )
            client = PipelineClient(await swarm.node(), config)
            await client.refresh()
            if case == "found in the round":

                async def unchecked(step: int) -> None:
                    pass

                monkeypatch.setattr(client, "_check_suspects", unchecked)
            if case == "killed after the drop":
                drop = client._drop

                async def drop_then_die(
                    stage: int, step: int, servers: list[ExpertLocation]
                ) -> set[PeerID]:
                    failed = await drop(stage, step, servers)
                    if servers:  # the slow server was told to drop: it dies
                        assert [s.peer_id for s in servers] == [slow.server.peer.peer_id]
                        await swarm.kill(slow)
                    return failed

                monkeypatch.setattr(client, "_drop", drop_then_die)
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            total = MICRO_BATCH * MICRO_BATCHES
            batches = [_batch(0, i) for i in range(MICRO_BATCHES)]
            await _pass_through(client, local, *batches[0], MICRO_BATCH / total, slow)
            late.armed = True  # the next: given up on at 1 s, redone at the other server
            await _pass_through(client, local, *batches[1], MICRO_BATCH / total, slow)
            for x, y in batches[2:]:
                await client.train_micro_batch(x, y, _loss, x.shape[0] / total)
                (_loss(local(x), y) * x.shape[0] / total).backward()
            assert await asyncio.to_thread(late.done.wait, 10.0)
            # the slow server holds both its passes, the late one too
            assert len(late.backend.counted) == 2
            assert _backward_samples(other) >= MICRO_BATCH  # the late one's redo
            assert await client.end_step() == 1
            optimizer.step()
            optimizer.zero_grad()
            if case == "killed after the drop":
                hosted.remove(slow)
            await _assert_stages_are(local, hosted)
            stats = client.statistics()
            assert stats.num_redone_backwards >= 1
            # the check before the round spares the round that would wait for it in vain
            assert (stats.num_step_retries == 0) == (case == "checked first")
            # and the next step is an ordinary one (the slow server, banned for a while
            # and holding nothing of it, sits it out)
            await _backward_passes(client, local, 1)
            optimizer.step()
            assert await client.end_step() == 2
            await _assert_stages_are(local, [h for h in hosted if h is not slow])

    arun(main())


def test_a_server_holding_a_pass_twice_steps_nothing_until_told_to_drop_it(arun: Run) -> None:
    """The step protocol's count, asked directly: a pass sent twice (a retry whose first
    answer was lost) is held twice and refused; a pass the client does not list, or one
    it lists and the server lacks, too; after a drop the server holds nothing of the
    step and steps with what it gets next."""

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3)]
            client = await _client(swarm)
            (found,) = (await find_experts(client.dht, ["stage.2"]))["stage.2"]
            x, grad = torch.randn(4, 16), torch.randn(4, 4)

            async def backward(pass_id: int) -> None:
                await call_backward(
                    client.peer,
                    found.location,
                    [x],
                    [grad],
                    config=ExpertCallConfig(),
                    step=0,
                    pass_id=pass_id,
                )

            def ask(passes: list[int], **kwargs: Any) -> Coroutine[Any, Any, StepResponse]:
                return _ask_step(
                    client, hosted[2], StepRequest("stage.2", 0, passes=passes, **kwargs)
                )

            await backward(7)
            await backward(7)
            for passes, says in (
                ([7], r"holds 1 passes it was not listed \(or one twice; e.g. \[7\]\) and lacks 0"),
                ([7, 7, 8], r"holds 0 .* and lacks 1 it was \(e.g. \[8\]\)"),
                ([], r"holds 2 .* and lacks 0"),
            ):
                with pytest.raises(RemoteError, match=says) as refused:
                    await ask(passes)
                assert refused.value.remote_type == "StageMiscounted"
            # the check alone (end=False), as a client asks it before the round
            with pytest.raises(RemoteError, match=r"holds 1 passes it was not listed"):
                await ask([7], end=False)
            assert (await ask([7, 7], end=False)).step == 0  # it holds those: nothing stepped
            before = await state_of(hosted[2])
            assert (await ask([], end=False, drop=True)).step == 0
            with pytest.raises(RemoteError, match=r"holds 0 .* and lacks 1"):
                await ask([7])  # dropped: it holds nothing now
            await backward(9)
            done = await ask([9])
            assert (done.step, done.samples) == (1, 4)
            after = await state_of(hosted[2])
            # the step is the one pass's, exactly: as a fresh server computes it
            reference = MODEL.build_local()[2]
            reference.load_state_dict(before)
            (reference(x) * grad).sum().backward()
            torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9).step()
            for name, value in reference.state_dict().items():
                assert torch.allclose(after[name], value, atol=1e-6), name

    arun(main())


class _FailsOnce:
    """Wraps a backend's backward: once armed, its backward after ``spared`` more
    raises (after the stages behind it in the backward have counted the micro-batch)."""

    def __init__(self, hosted: Hosted) -> None:
        worker = hosted.server.worker
        assert worker is not None
        self.backward = worker.backend.backward
        self.countdown: int | None = None
        worker.backend.backward = self  # type: ignore[method-assign]

    def arm(self, spared: int = 0) -> None:
        self.countdown = spared

    def __call__(self, *args: Any, **kwargs: Any) -> list[torch.Tensor | None]:
        if self.countdown is not None:
            self.countdown -= 1
            if self.countdown < 0:
                self.countdown = None
                raise RuntimeError("this backward breaks once")
        return self.backward(*args, **kwargs)


def test_a_micro_batch_whose_backward_fails_counts_nowhere_and_its_retry_once(
    arun: Run,
) -> None:
    """A micro-batch's backward goes through stages 2 and 1, then fails at stage 0 (its
    one attempt): the passes stages 2 and 1 made must not count, or the micro-batch
    tried again would count twice there. Their servers are checked at the step's end,
    drop the step's gradients and have the passes they answered redone: the step is
    one process's, with the micro-batch once. A batch whose train() fails counts
    nowhere, the micro-batches that came back included: trained again, it counts once."""

    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3)]
            breaks = _FailsOnce(hosted[0])
            config = dataclasses.replace(
                _client_config(), max_attempts=1, wiring=WiringConfig(ban_seconds=0.05)
            )
            client = PipelineClient(await swarm.node(), config)
            await client.refresh()
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            total = MICRO_BATCH * MICRO_BATCHES
            batches = [_batch(0, i) for i in range(MICRO_BATCHES)]
            await client.train_micro_batch(*batches[0], _loss, MICRO_BATCH / total)
            breaks.arm()
            with pytest.raises(StageFailed, match="stage 0"):
                await client.train_micro_batch(*batches[1], _loss, MICRO_BATCH / total)
            await asyncio.sleep(0.1)  # past the failed server's ban
            for x, y in batches[1:]:  # the failed one again, then the rest
                await client.train_micro_batch(x, y, _loss, MICRO_BATCH / total)
            for x, y in batches:
                (_loss(local(x), y) * MICRO_BATCH / total).backward()
            assert await client.end_step() == 1
            optimizer.step()
            await _assert_stages_are(local, hosted)
            # stages 2 and 1 held the failed pass: dropped, and their others redone
            assert client.statistics().num_redone_backwards == 2 * 4
            assert client.statistics().num_step_retries == 0
            optimizer.zero_grad()
            # the same with a whole batch: train() fails, and trained again counts once
            batches = [_batch(1, i) for i in range(MICRO_BATCHES)]
            breaks.arm(spared=1)  # one micro-batch comes back, then one fails
            with pytest.raises(StageFailed, match="stage 0"):
                await client.train(batches, _loss)
            await asyncio.sleep(0.1)
            await client.train(batches, _loss)
            for x, y in batches:
                (_loss(local(x), y) * MICRO_BATCH / total).backward()
            optimizer.step()
            await _assert_stages_are(local, hosted)

    arun(main())
