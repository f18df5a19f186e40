"""The charlm transformer as a pipeline (swarm.pipeline.transformer): how it is cut, what
crosses its stage boundaries, compressed both ways, and what a stage refuses."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from peers import RemoteError
from swarm.experts import ExpertCallConfig, ServerConfig
from swarm.experts.announce import find_experts
from swarm.experts.calls import call_forward
from swarm.experts.schema import TensorSpec
from swarm.optim_spec import OptimizerSpec
from swarm.pipeline import (
    CHARLM_STAGES,
    CharLMStages,
    PipelineClient,
    PipelineConfig,
    ReplicaConfig,
    StageFailed,
    StageServerConfig,
    pipeline_model,
)
from swarm.tasks import get_task
from swarm.tasks.charlm import CharLMConfig, TinyTransformerLM
from tests.swarm.pipeline_loop import local_swarm

torch.set_num_threads(1)
Run = Callable[[Coroutine[Any, Any, Any]], Any]


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def test_the_stages_hold_the_blocks_evenly_and_compose_to_the_task_model() -> None:
    model = CharLMStages(config=CharLMConfig(num_layers=5), stages=3)
    assert [list(model.blocks_of(i)) for i in range(3)] == [[0], [1, 2], [3, 4]]
    assert pipeline_model("charlm") is CHARLM_STAGES
    # the same parameters as the task's model, in the same order: one model, cut
    local = CHARLM_STAGES.build_local()
    whole = TinyTransformerLM(CHARLM_STAGES.config)
    assert [p.shape for p in local.parameters()] == [p.shape for p in whole.parameters()]
    with torch.no_grad():
        for mine, theirs in zip(local.parameters(), whole.parameters(), strict=True):
            theirs.copy_(mine)
        tokens = torch.randint(0, 128, (2, 64))
        assert torch.allclose(local(tokens), whole(tokens), atol=1e-6)

    narrow = CharLMStages(bottleneck=16)
    first, inputs = narrow.build_stage(0)
    assert (inputs[0].dtype, inputs[0].shape, inputs[0].high) == ("int64", [64], 128)
    assert first(tokens).shape == (2, 64, 16)  # what crosses the boundary
    middle, inputs = narrow.build_stage(1)
    assert inputs[0].shape == [64, 16] and middle(torch.zeros(2, 64, 16)).shape == (2, 64, 16)
    assert narrow.build_local()(tokens).shape == (2, 64, 128)

    with pytest.raises(ValueError, match="one block each at least"):
        CharLMStages(config=CharLMConfig(num_layers=2), stages=3)
    with pytest.raises(ValueError, match="bottleneck"):
        CharLMStages(bottleneck=0)
    with pytest.raises(ValueError, match="only integer specs"):
        TensorSpec(shape=[4], dtype="float32", high=3)
    with pytest.raises(ValueError, match="only integer specs"):
        TensorSpec(shape=[4], dtype="int64", high=0)


def _config(stage: int, model: CharLMStages) -> StageServerConfig:
    return StageServerConfig(
        model=model,
        stage=stage,
        optimizer=OptimizerSpec(kind="adam", lr=3e-3),
        clip_grad_norm=None,
        max_batch_size=64,
        server=ServerConfig(announce_interval=0.5, announce_ttl=1.5),
        replicas=ReplicaConfig(run_id="gpt", interval_seconds=3600.0, load_timeout=10.0),
        synchronous=True,
        probe_timeout=1.0,
    )


def test_a_bottlenecked_transformer_trains_with_8_bit_activations_and_refuses_bad_tokens(
    arun: Run,
) -> None:
    model = CharLMStages(bottleneck=16)
    task = get_task("charlm")

    async def main() -> None:
        async with local_swarm() as swarm:
            for stage in range(3):
                await swarm.serve(_config(stage, model))
            calls = ExpertCallConfig(
                forward_timeout=30.0, backward_timeout=30.0, codec="blockwise8"
            )
            client = PipelineClient(
                await swarm.node(),
                PipelineConfig(
                    num_stages=3,
                    calls=calls,
                    synchronous=True,
                    max_attempts=1,
                    server_wait_timeout=1.0,
                ),
            )
            await client.refresh()
            local = model.build_local()
            optimizer = OptimizerSpec(kind="adam", lr=3e-3).build(local.parameters())
            batches = task.batches(rank=0, num_peers=1, batch_size=8, seed=0)
            test_x, test_y = task.test_inputs[:64], task.test_targets[:64]
            with torch.no_grad():
                before = _loss(local(test_x), test_y).item()
            for _ in range(8):
                micro_batches = [next(batches) for _ in range(4)]
                await client.train(micro_batches, _loss)
                for x, y in micro_batches:
                    (_loss(local(x), y) / 4).backward()
                optimizer.step()
                optimizer.zero_grad()
            outputs, _ = await client.forward([test_x])
            remote = _loss(outputs[0], test_y).item()
            with torch.no_grad():
                exact = _loss(local(test_x), test_y).item()
            print("test loss", before, "->", remote, "uncompressed", exact)
            # 8-bit activations and gradients at 16 features: close to the exact run
            assert remote < 0.85 * before
            assert remote == pytest.approx(exact, rel=0.05)

            # a token outside the vocabulary is the caller's error, said before any compute
            bad = torch.full((2, 64), 200, dtype=torch.int64)
            (location,) = (await find_experts(client.dht, ["stage.0"]))["stage.0"]
            with pytest.raises(RemoteError, match=r"values must be in \[0, 128\), got 200 to 200"):
                await call_forward(client.peer, location.location, [bad], config=calls)
            with pytest.raises(StageFailed, match="values must be in"):
                await client.forward([bad])

    arun(main())
