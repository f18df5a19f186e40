"""Synchronous stages (swarm.pipeline.sync) on loopback, in one process: a stage's servers
sum their gradients and step together, once per global batch, so the pipeline trains
exactly like one process doing the same gradient accumulation."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from averaging import AllReduceConfig
from peers import RemoteError
from swarm.experts import ExpertCallConfig, ServerConfig
from swarm.optim_spec import OptimizerSpec
from swarm.pipeline import (
    MLPStages,
    PipelineClient,
    PipelineConfig,
    ReplicaConfig,
    StageServerConfig,
    StageStepError,
)
from swarm.pipeline.sync import STEP_PROTOCOL, StepRequest, StepResponse, SyncConfig
from tests.swarm.pipeline_loop import Hosted, local_swarm, state_of

torch.set_num_threads(1)
Run = Callable[[Coroutine[Any, Any, Any]], Any]
MODEL = MLPStages(widths=((8, 16), (16, 24, 16), (16, 4)), seed=5)
LR = 0.1
STEPS = 4
MICRO_BATCHES = 4
MICRO_BATCH = 8


def _config(stage: int) -> StageServerConfig:
    return StageServerConfig(
        model=MODEL,
        stage=stage,
        optimizer=OptimizerSpec(kind="sgd", lr=LR, momentum=0.9),
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


def _client_config() -> PipelineConfig:
    return PipelineConfig(
        num_stages=MODEL.num_stages,
        calls=ExpertCallConfig(forward_timeout=5.0, backward_timeout=5.0),
        refresh_seconds=0.2,
        server_wait_timeout=1.0,
        seed=0,
        synchronous=True,
        step_timeout=20.0,
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


def test_stages_of_two_servers_step_together_like_one_process_accumulating(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3) for _ in range(2)]
            client = PipelineClient(await swarm.node(), _client_config())
            await client.refresh()
            local = MODEL.build_local()
            optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            for step in range(STEPS):
                batches = [_batch(step, i) for i in range(MICRO_BATCHES)]
                losses = await client.train(batches, F.cross_entropy)
                # one process: the batch's mean loss, accumulated micro-batch by
                # micro-batch, then one step
                expected = []
                for x, y in batches:
                    loss = F.cross_entropy(local(x), y)
                    (loss * x.shape[0] / (MICRO_BATCH * MICRO_BATCHES)).backward()
                    expected.append(loss.item())
                optimizer.step()
                optimizer.zero_grad()
                assert losses == pytest.approx(expected, abs=1e-5), step

            for stage in range(3):
                first, second = hosted[2 * stage : 2 * stage + 2]
                remote, other = await state_of(first), await state_of(second)
                for name, value in local[stage].state_dict().items():
                    # the replicas are one model, bit for bit, and it is the local one
                    assert torch.equal(remote[name], other[name]), (stage, name)
                    assert torch.allclose(remote[name], value, atol=1e-5), (stage, name)
                # every sample went through the stage once, whichever server took it
                served = _backward_samples(first) + _backward_samples(second)
                assert served == STEPS * MICRO_BATCHES * MICRO_BATCH
                for h in (first, second):
                    stats = h.server.statistics().server
                    assert stats is not None
                    (module,) = stats.modules.values()
                    assert module.num_optimizer_steps == STEPS
            # the wiring spread the micro-batches: some server of a stage took some
            assert any(_backward_samples(h) for h in hosted[1::2])

    arun(main())


def test_a_step_request_steps_once_and_a_server_behind_says_so(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(stage)) for stage in range(3)]
            client = PipelineClient(await swarm.node(), _client_config())
            await client.refresh()
            await client.train([_batch(0, 0)], F.cross_entropy)  # step 0 ended
            server = hosted[1].server.peer.peer_id
            peer = client.peer

            async def ask(request: StepRequest) -> StepResponse:
                return await peer.call_unary(
                    server, STEP_PROTOCOL, request, StepResponse, timeout=10.0
                )

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
            with pytest.raises(StageStepError):
                await client.end_step()  # no server of stage 2 is listed any more, or dead

    arun(main())
