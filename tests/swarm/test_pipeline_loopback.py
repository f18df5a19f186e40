"""Pipelines on loopback, in one process: numerics against the local model, rerouting,
compression, replica averaging, state download, joining and moving (port 0, bounded
waits: CONTRIBUTING.md, "How tests are organised")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F

from averaging import MatchmakingConfig
from peers.dht import BlockingDHT, DHTConfig
from swarm.experts import ExpertCallConfig, ModuleBackend, ServerConfig
from swarm.experts.batching import Batcher
from swarm.experts.kept import KeptStore
from swarm.experts.worker import ModuleWorker
from swarm.metrics import pipeline_families
from swarm.optim_spec import OptimizerSpec
from swarm.pipeline import (
    MLPStages,
    PipelineClient,
    PipelineConfig,
    RemoteSequential,
    ReplicaConfig,
    StageReplica,
    StageServerConfig,
    StageUnavailable,
)
from tests.swarm.pipeline_loop import LISTEN, local_swarm, state_of

torch.set_num_threads(1)
Run = Callable[[Coroutine[Any, Any, Any]], Any]
MODEL = MLPStages(widths=((8, 16), (16, 24, 16), (16, 4)), seed=3)
LR = 0.1


def _config(stage: int | None, *, lr: float = 0.0, **kwargs: Any) -> StageServerConfig:
    return StageServerConfig(
        model=kwargs.pop("model", MODEL),
        stage=stage,
        optimizer=OptimizerSpec(kind="sgd", lr=lr, momentum=0.9) if lr else None,
        max_batch_size=64,
        server=ServerConfig(announce_interval=0.5, announce_ttl=1.5),
        replicas=ReplicaConfig(run_id="loop", interval_seconds=3600.0, load_timeout=10.0),
        probe_timeout=1.0,
        **{"synchronous": False, **kwargs},  # the asynchronous mode (test_pipeline_sync.py)
    )


def _client_config(**kwargs: Any) -> PipelineConfig:
    calls = ExpertCallConfig(forward_timeout=5.0, backward_timeout=5.0, **kwargs)
    return PipelineConfig(
        num_stages=MODEL.num_stages,
        calls=calls,
        refresh_seconds=0.2,
        server_wait_timeout=1.0,
        seed=0,
        synchronous=False,
    )


def _data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def test_a_pipeline_computes_and_trains_exactly_like_the_local_model(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            hosted = [await swarm.serve(_config(i, lr=LR)) for i in range(3)]
            client = PipelineClient(await swarm.node(), _client_config())
            x, y = _data(5)
            local = MODEL.build_local()
            local_optimizer = torch.optim.SGD(local.parameters(), lr=LR, momentum=0.9)
            xl = x.clone().requires_grad_()
            local_out = local(xl)
            F.cross_entropy(local_out, y).backward()

            outputs, trace = await client.forward([x], keep=True)
            assert torch.allclose(outputs[0], local_out.detach(), atol=1e-5)
            out = outputs[0].requires_grad_()
            (grad,) = torch.autograd.grad(F.cross_entropy(out, y), out)
            (grad_x,) = await client.backward(trace, [grad])
            assert grad_x is not None and torch.allclose(grad_x, xl.grad, atol=1e-5)

            local_optimizer.step()  # every server stepped once on exactly these gradients
            for i, h in enumerate(hosted):
                remote, expected = await state_of(h), local[i].state_dict()
                for name, value in expected.items():
                    assert torch.allclose(remote[name], value, atol=1e-5), (i, name)
                stats = h.server.statistics().server
                assert stats is not None
                (module,) = stats.modules.values()
                assert module.num_recomputed_samples == 0  # the kept graphs were used
            assert client.statistics().num_failed_calls == 0

    arun(main())


def test_remote_sequential_is_a_torch_module_with_autograd(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            for i in range(3):
                await swarm.serve(_config(i))  # not trained: results stay comparable

            def blocking() -> None:
                dht_config = DHTConfig(initial_peers=(swarm.initial,), rpc_timeout=2.0)
                with BlockingDHT(config=dht_config, peer_config=LISTEN) as dht:
                    model = RemoteSequential(dht, _client_config())
                    local = MODEL.build_local()
                    x, y = _data(6, seed=1)
                    x.requires_grad_()
                    F.cross_entropy(model(x), y).backward()
                    xl = x.detach().clone().requires_grad_()
                    F.cross_entropy(local(xl), y).backward()
                    assert x.grad is not None and torch.allclose(x.grad, xl.grad, atol=1e-5)
                    batches = [_data(4, seed=s) for s in range(3)]
                    losses = model.train_step(batches, F.cross_entropy)
                    expected = [F.cross_entropy(local(bx), by).item() for bx, by in batches]
                    assert losses == pytest.approx(expected, abs=1e-5)
                    with torch.no_grad():
                        assert torch.allclose(model(x), local(x), atol=1e-5)
                    stats = model.statistics()
                    assert (stats.num_forwards, stats.num_backwards) == (5, 4)
                    assert all(len(servers) == 1 for servers in stats.servers)

            await asyncio.to_thread(blocking)

    arun(main())


def test_a_dead_servers_micro_batches_are_rerouted_and_a_stage_without_servers_says_so(
    arun: Run,
) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            first = await swarm.serve(_config(0))
            replicas = [await swarm.serve(_config(1)) for _ in range(2)]  # equal replicas
            await swarm.serve(_config(2))
            client = PipelineClient(await swarm.node(), _client_config())
            local = MODEL.build_local()
            x, y = _data(5, seed=2)
            xl = x.clone().requires_grad_()
            F.cross_entropy(local(xl), y).backward()

            outputs, trace = await client.forward([x], keep=True)
            used = trace.calls[1].location.peer_id
            dead = next(h for h in replicas if h.server.peer.peer_id == used)
            survivor = next(h for h in replicas if h is not dead)
            await swarm.kill(dead)  # between this micro-batch's forward and backward
            out = outputs[0].requires_grad_()
            (grad,) = torch.autograd.grad(F.cross_entropy(out, y), out)
            (grad_x,) = await client.backward(trace, [grad])
            assert grad_x is not None and torch.allclose(grad_x, xl.grad, atol=1e-5)
            assert client.statistics().num_failed_calls == 1
            # Each stage call is timed by stage and direction; the dead server's one failed.
            latency = client.statistics().call_latency
            assert [latency[(s, "forward")].count for s in range(3)] == [1, 1, 1]
            assert [latency[(s, "backward")].count for s in range(3)] == [1, 2, 1]
            assert latency[(1, "backward")].failures == 1
            assert sum(v.failures for v in latency.values()) == 1
            scraped = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in pipeline_families(client.statistics())
                for s in family.samples
            }
            key = ("swarm_pipeline_call_seconds_count", (("direction", "backward"), ("stage", "1")))
            assert scraped[key] == 2
            assert scraped[("swarm_pipeline_failed_calls_total", ())] == 1
            stats = survivor.server.statistics().server
            assert stats is not None  # it recomputed the forward the dead server had kept
            assert next(iter(stats.modules.values())).num_recomputed_samples == 5

            for seed in range(4):  # the dead one is banned: later micro-batches avoid it
                await client.forward([_data(3, seed)[0]])
            assert client.statistics().num_failed_calls == 1

            await swarm.kill(survivor)
            with pytest.raises(StageUnavailable, match=r"stage 1 \(stage.1\)") as caught:
                await client.forward([x])
            assert caught.value.stage == 1
            assert first.server.statistics().stage == 0

    arun(main())


def test_activations_and_gradients_can_travel_as_float16(arun: Run) -> None:
    async def main() -> None:
        async with local_swarm() as swarm:
            for i in range(3):
                await swarm.serve(_config(i))
            client = PipelineClient(await swarm.node(), _client_config(codec="float16"))
            local = MODEL.build_local()
            x, y = _data(8, seed=3)
            xl = x.clone().requires_grad_()
            local_out = local(xl)
            F.cross_entropy(local_out, y).backward()
            outputs, trace = await client.forward([x], keep=True)
            assert not torch.equal(outputs[0], local_out.detach())  # it was compressed...
            assert torch.allclose(outputs[0], local_out.detach(), atol=1e-2)  # ...by a bit
            out = outputs[0].requires_grad_()
            (grad,) = torch.autograd.grad(F.cross_entropy(out, y), out)
            (grad_x,) = await client.backward(trace, [grad])
            assert grad_x is not None and torch.allclose(grad_x, xl.grad, atol=1e-3, rtol=1e-2)

    arun(main())


def _worker(backend: ModuleBackend) -> ModuleWorker:
    batcher: Batcher[int] = Batcher(max_batch_size=8, max_queued_samples=64)
    return ModuleWorker(backend, batcher, KeptStore(max_entries=4, ttl_seconds=60.0))


def _backend(model: MLPStages, stage: int, shift: float) -> ModuleBackend:
    module, inputs = model.build_stage(stage)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for p in module.parameters():  # a step, so there is momentum to share
        p.grad = torch.full_like(p, shift)
    optimizer.step()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(shift)
    backend = ModuleBackend(f"stage.{stage}", module, inputs=inputs, max_batch_size=8)
    backend.optimizer = optimizer
    return backend


@pytest.mark.parametrize("combine", ["mean", "sum"])
def test_replicas_of_a_stage_average_and_a_newcomer_downloads_theirstate_of(
    arun: Run, combine: Literal["mean", "sum"]
) -> None:
    model = MLPStages(widths=((8, 8), (8, 8), (8, 8)), seed=4)  # stages of equal shapes
    config = ReplicaConfig(
        run_id="avg",
        combine=combine,
        interval_seconds=3600.0,
        matchmaking=MatchmakingConfig(
            search_timeout=3.0, gather_timeout=1.0, request_timeout=2.0, poll_interval_seconds=0.2
        ),
        load_timeout=10.0,
    )

    async def main() -> None:
        async with local_swarm() as swarm:
            backends = [_backend(model, 1, 1.0), _backend(model, 1, 3.0), _backend(model, 0, 5.0)]
            async with contextlib.AsyncExitStack() as stack:
                replicas = [
                    await stack.enter_async_context(StageReplica(await swarm.node(), b, config))
                    for b in backends
                ]
                workers = [_worker(b) for b in backends]
                anchors = [
                    {k: v.clone() for k, v in b.module.state_dict().items()} for b in backends
                ]
                with torch.no_grad():  # each trains a little after its last round
                    for b, update in zip(backends, (0.5, -0.25, 1.0), strict=True):
                        for p in b.module.parameters():
                            p.add_(update)
                before = [
                    {k: v.clone() for k, v in b.module.state_dict().items()} for b in backends
                ]
                joined = await asyncio.gather(
                    *(r.average_once(w, "round-1") for r, w in zip(replicas, workers, strict=True))
                )
                # the two replicas of stage 1 met; stage 0's, same shapes and key, did not
                assert joined == [True, True, False]
                for name, value in backends[0].module.state_dict().items():
                    expected = (before[0][name] + before[1][name]) / 2
                    if combine == "sum":  # + (n - 1) * mean(d): both updates kept
                        expected += sum(before[i][name] - anchors[i][name] for i in (0, 1)) / 2
                    assert torch.allclose(value, expected, atol=1e-6)
                    assert torch.equal(value, backends[1].module.state_dict()[name])
                    assert torch.equal(backends[2].module.state_dict()[name], before[2][name])
                for replica, worker in zip(replicas[:2], workers[:2], strict=True):
                    await replica.share(worker)

                newcomer = _backend(model, 1, 0.0)
                newcomer.optimizer = torch.optim.SGD(
                    newcomer.module.parameters(), lr=0.1, momentum=0.9
                )
                async with StageReplica(await swarm.node(), newcomer, config) as replica:
                    loaded = await replica.load_from_peers()
                assert loaded is not None and replica.statistics().loaded_version == loaded.version
                for name, value in newcomer.module.state_dict().items():
                    assert torch.equal(value, backends[0].module.state_dict()[name])
                momenta = [
                    [b.optimizer.state[p]["momentum_buffer"] for p in b.module.parameters()]
                    for b in (backends[0], backends[1], newcomer)
                    if b.optimizer is not None
                ]
                assert any(
                    all(torch.equal(m, d) for m, d in zip(momenta[2], donor, strict=True))
                    for donor in momenta[:2]
                )

    arun(main())


def test_a_new_server_joins_the_thin_stage_and_a_server_moves_to_relieve_it(arun: Run) -> None:
    model = MLPStages(widths=((8, 16), (16, 4)), seed=6)

    async def main() -> None:
        async with local_swarm() as swarm:
            await swarm.serve(_config(0, model=model, lr=LR))
            await swarm.serve(_config(0, model=model, lr=LR))
            await swarm.serve(_config(1, model=model, lr=LR))
            newcomer = await swarm.serve(_config(None, model=model, lr=LR))
            assert newcomer.server.statistics().stage == 1  # 2 servers vs 1: it joins stage 1
            assert newcomer.server.statistics().loaded_version is not None  # from the other

            mover = await swarm.serve(
                _config(0, model=model, lr=LR, rebalance_interval_seconds=0.3)
            )
            await swarm.kill(newcomer)  # stage 1 is thin again: 3 servers vs 1
            assert await mover.next_stage() == 1
            stats = mover.server.statistics()
            assert stats.num_moves == 1 and stats.loaded_version is not None

            config = PipelineConfig(num_stages=2, refresh_seconds=0.2, seed=1, synchronous=False)
            client = PipelineClient(await swarm.node(), config)
            for seed in range(40):  # it receives traffic (the others too)
                x, y = _data(4, seed)
                await client.train_micro_batch(x[:, :8], y, F.cross_entropy)
                served = mover.server.statistics().server
                assert served is not None
                if next(iter(served.modules.values())).num_backward_samples > 0:
                    break
            else:
                pytest.fail(f"the moved server got no traffic: {client.statistics()}")

    arun(main())
