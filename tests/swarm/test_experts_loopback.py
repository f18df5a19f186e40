"""Expert servers and clients on loopback, in one process: numerics, deadlines, bad
requests, batching, compression (port 0, bounded waits: CONTRIBUTING.md, "How tests are
organised")."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from peers import BlockingPeer, Peer, PeerConfig, RemoteError, runtime
from peers.dht import DHT, dht_time
from peers.wire import to_wire
from swarm.experts import (
    BlockingExpertServer,
    ExpertCallConfig,
    ExpertError,
    ExpertInputError,
    ExpertLocation,
    ExpertServer,
    ModuleBackend,
    RemoteExpert,
    ServerConfig,
    TensorSpec,
    call_backward,
    call_forward,
    call_info,
)
from swarm.experts import backend as backend_module
from swarm.experts import server as server_module
from swarm.experts import worker as worker_module
from swarm.experts.backend import DEFAULT_CLIP_GRAD_NORM
from swarm.experts.batching import Batcher
from swarm.experts.kept import KeptStore
from swarm.experts.layers import FeedforwardBlock
from swarm.experts.wire import (
    BACKWARD_PROTOCOL,
    FORWARD_PROTOCOL,
    BackwardRequest,
    BackwardResponse,
    ForwardRequest,
    ForwardResponse,
)
from swarm.experts.worker import ModuleWorker

LISTEN = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
CLIENT = PeerConfig(listen_addrs=())
Arun = Callable[[Coroutine[Any, Any, Any]], Any]

torch.set_num_threads(1)


class TwoWay(nn.Module):
    """Two inputs (one integer) and two outputs: every path of the protocol."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.embed = nn.Embedding(10, 6)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.linear(x) + self.embed(ids))
        return h, (h * x).sum(dim=-1, keepdim=True)


class Slow(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        out: torch.Tensor = self.linear(x)
        return out


def _ffn(
    uid: str = "ffn.0.0", dim: int = 16, max_batch: int = 32, lr: float = 0.0
) -> ModuleBackend:
    module = FeedforwardBlock(dim)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr) if lr else None
    spec = [TensorSpec(shape=[dim], dtype="float32")]
    return ModuleBackend(uid, module, inputs=spec, max_batch_size=max_batch, optimizer=optimizer)


def _location(peer: Peer, uid: str) -> ExpertLocation:
    return ExpertLocation(uid, peer.peer_id, tuple(str(a) for a in peer.listen_addrs))


@contextlib.asynccontextmanager
async def _served(
    backends: list[ModuleBackend], config: ServerConfig | None = None
) -> AsyncIterator[tuple[Peer, ExpertServer]]:
    async with (
        Peer(LISTEN) as server_peer,
        Peer(CLIENT) as client,
        ExpertServer(server_peer, backends, config) as server,
    ):
        client.add_addresses(server_peer.peer_id, server_peer.listen_addrs)
        yield client, server


@contextlib.contextmanager
def _hosted(backends: list[ModuleBackend]) -> Iterator[BlockingPeer]:
    """A server on its own BlockingPeer (its loop thread), stopped on exit."""
    with BlockingPeer(LISTEN) as peer, BlockingExpertServer(backends, peer=peer):
        yield peer


def test_an_expert_server_keeps_freed_memory_and_its_peer_alone_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The allocator tuning is opt-in: the expert server asks for it (its backward's
    gradients are freed and reused every call), its BlockingPeer does not."""
    calls: list[str] = []

    def spy(caller: str) -> Callable[[], bool]:
        def keep_freed_memory() -> bool:
            calls.append(caller)
            return True

        return keep_freed_memory

    monkeypatch.setattr(server_module, "keep_freed_memory", spy("server"))
    monkeypatch.setattr(runtime, "keep_freed_memory", spy("peers.runtime"))
    with BlockingPeer(LISTEN) as peer:
        assert calls == []
        with BlockingExpertServer([_ffn()], peer=peer):
            assert calls == ["server"]


def test_remote_expert_matches_local_module_values_gradients_and_updates() -> None:
    torch.manual_seed(0)
    remote_module, local_module = TwoWay(), TwoWay()
    local_module.load_state_dict(remote_module.state_dict())
    specs = [TensorSpec(shape=[6], dtype="float32"), TensorSpec(shape=[], dtype="int64")]
    backend = ModuleBackend(
        "two.1",
        remote_module,
        inputs=specs,
        max_batch_size=16,
        optimizer=torch.optim.SGD(remote_module.parameters(), lr=0.1),
    )
    local_opt = torch.optim.SGD(local_module.parameters(), lr=0.1)
    x = torch.randn(5, 6)
    ids = torch.randint(0, 10, (5,))
    with _hosted([backend]) as server, BlockingPeer(CLIENT) as client:
        expert = RemoteExpert(_location(server.peer, "two.1"), client)
        assert [s.shape for s in expert.info.outputs] == [[6], [1]]
        x_remote = x.clone().requires_grad_()
        h, s = expert(x_remote, ids)
        x_local = x.clone().requires_grad_()
        h_ref, s_ref = local_module(x_local, ids)
        torch.testing.assert_close(h, h_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=0)
        (h.square().sum() + 3 * s.sum()).backward()
        (h_ref.square().sum() + 3 * s_ref.sum()).backward()
        assert x_remote.grad is not None and x_local.grad is not None
        torch.testing.assert_close(x_remote.grad, x_local.grad, atol=1e-6, rtol=0)
        # the server clips by default (DEFAULT_CLIP_GRAD_NORM), and this loss's gradient
        # is larger: the reference clips the same way
        assert nn.utils.clip_grad_norm_(local_module.parameters(), DEFAULT_CLIP_GRAD_NORM) > 1
        local_opt.step()
        # the server steps after replying, before the next batch: a second forward runs
        # with the updated parameters on both sides
        with torch.no_grad():
            torch.testing.assert_close(
                expert(x, ids)[0], local_module(x, ids)[0], atol=1e-6, rtol=0
            )
        for p, q in zip(remote_module.parameters(), local_module.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)
        with pytest.raises(ExpertInputError, match=r"inputs\[1\]: expected dtype int64"):
            expert(x, ids.float())
    stats = backend.statistics()
    assert (stats.num_forward_samples, stats.num_backward_samples) == (10, 5)
    assert stats.num_optimizer_steps == 1
    assert stats.num_recomputed_samples == 0  # the forward kept its graph for the backward


def test_remote_expert_trains_without_input_gradients() -> None:
    backend = _ffn(lr=0.5)
    before = [p.detach().clone() for p in backend.module.parameters()]
    with _hosted([backend]) as server, BlockingPeer(CLIENT) as client:
        expert = RemoteExpert(_location(server.peer, "ffn.0.0"), client)
        out = expert(torch.randn(3, 16))  # the input needs no gradient; the expert still trains
        assert isinstance(out, torch.Tensor)
        out.square().sum().backward()
        expert(torch.randn(1, 16))  # runs after the step
    assert backend.statistics().num_optimizer_steps == 1
    assert any(
        not torch.equal(a, b) for a, b in zip(before, backend.module.parameters(), strict=True)
    )


def test_remote_expert_refuses_to_block_an_event_loop(arun: Arun) -> None:
    with _hosted([_ffn()]) as server, BlockingPeer(CLIENT) as client:
        expert = RemoteExpert(_location(server.peer, "ffn.0.0"), client)
        _ = expert.info

        async def inside_a_loop() -> None:
            with pytest.raises(ExpertError, match=r"asyncio\.to_thread"):
                expert(torch.randn(1, 16))

        arun(inside_a_loop())


def test_deadline_raises_and_the_server_goes_on(arun: Arun) -> None:
    module = Slow(2.0)
    slow = ModuleBackend(
        "slow.0", module, inputs=[TensorSpec(shape=[4], dtype="float32")], max_batch_size=4
    )

    async def main() -> None:
        async with _served([slow, _ffn()]) as (client, server):
            loc = _location(server.peer, "slow.0")
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await call_forward(
                    client, loc, [torch.randn(1, 4)], config=ExpertCallConfig(forward_timeout=0.3)
                )
            assert time.monotonic() - started < 1.5  # did not wait for the 2 s compute
            # the other module answers meanwhile; the slow one once it is free again
            fast = await call_forward(
                client,
                _location(server.peer, "ffn.0.0"),
                [torch.randn(2, 16)],
                config=ExpertCallConfig(),
            )
            assert fast.outputs[0].shape == (2, 16)
            module.seconds = 0.0
            out = await call_forward(client, loc, [torch.randn(1, 4)], config=ExpertCallConfig())
            assert out.outputs[0].shape == (1, 4)

    arun(main())


def test_bad_requests_get_clear_remote_errors_and_the_server_keeps_serving(arun: Arun) -> None:
    async def main() -> None:
        backend = _ffn(max_batch=8)
        async with _served([backend]) as (client, server):
            loc = _location(server.peer, "ffn.0.0")
            config = ExpertCallConfig(forward_timeout=10)
            x = torch.randn(3, 16)
            bad_inputs = [
                (
                    [torch.randn(3, 15)],
                    r"inputs\[0\]: expected shape \['batch', 16\], got \[3, 15\]",
                ),
                ([x.double()], r"inputs\[0\]: expected dtype float32, got float64"),
                ([torch.randn(9, 16)], "batch of 9 samples exceeds this expert's max_batch_size 8"),
                ([x, x], "expected 1 tensors, got 2"),
                ([torch.full((3, 16), float("nan"))], "NaN or infinite"),
            ]
            for inputs, message in bad_inputs:
                with pytest.raises(RemoteError, match=message) as caught:
                    await call_forward(client, loc, inputs, config=config)
                assert caught.value.remote_type == "BadExpertRequest"
            with pytest.raises(RemoteError, match=r"no expert 'ffn\.9\.9' here"):
                await call_forward(client, _location(server.peer, "ffn.9.9"), [x], config=config)
            with pytest.raises(
                RemoteError, match=r"grad_outputs\[0\]: batch size 2 differs from 3"
            ):
                await call_backward(client, loc, [x], [torch.randn(2, 16)], config=config)
            with pytest.raises(RemoteError, match="codec 'zip' is not one of"):
                request = ForwardRequest("ffn.0.0", [x], reply_codec="zip")
                await client.call_unary(
                    loc.peer_id, FORWARD_PROTOCOL, request, ForwardResponse, timeout=5
                )
            with pytest.raises(RemoteError, match=r"ForwardRequest\.inputs"):  # not a tensor at all
                await client.call_unary(
                    loc.peer_id, FORWARD_PROTOCOL, ["ffn.0.0", [[1, 2]]], ForwardResponse, timeout=5
                )
            with pytest.raises(RemoteError, match=r"BackwardRequest\.pass_id"):  # not an int
                request = BackwardRequest("ffn.0.0", [x], [x], pass_id="x")  # type: ignore[arg-type]
                await client.call_unary(
                    loc.peer_id, BACKWARD_PROTOCOL, request, BackwardResponse, timeout=5
                )
            with pytest.raises(RemoteError, match="exceeds the limit"):  # refused before it is read
                await call_forward(client, loc, [torch.randn(1 << 18, 16)], config=config)
            # none of it was computed, and the server serves the next caller as usual
            assert backend.statistics().num_batches == 0
            out = await call_forward(client, loc, [x], config=config)
            with torch.no_grad():
                torch.testing.assert_close(out.outputs[0], backend.module(x), atol=1e-6, rtol=0)
            assert to_wire(await call_info(client, loc, timeout=5)) == to_wire(backend.info)

    arun(main())


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(arun: Arun) -> None:
    async def main() -> None:
        backend = _ffn(dim=64, max_batch=64)
        async with _served([backend]) as (client, server):
            loc = _location(server.peer, "ffn.0.0")
            xs = [torch.randn(i + 1, 64) for i in range(12)]
            outs = await asyncio.gather(
                *(call_forward(client, loc, [x], config=ExpertCallConfig()) for x in xs)
            )
            with torch.no_grad():
                for x, out in zip(xs, outs, strict=True):
                    torch.testing.assert_close(out.outputs[0], backend.module(x), atol=1e-5, rtol=0)
            stats = backend.statistics()
            assert stats.num_forward_samples == sum(range(1, 13))
            assert stats.num_batches < 12  # requests that waited ran together

    arun(main())


def test_a_full_queue_refuses_with_server_busy(arun: Arun) -> None:
    async def main() -> None:
        slow = ModuleBackend(
            "slow.0", Slow(0.3), inputs=[TensorSpec(shape=[4], dtype="float32")], max_batch_size=2
        )
        async with _served([slow], ServerConfig(max_queued_batches=1)) as (client, server):
            loc = _location(server.peer, "slow.0")
            calls = [
                call_forward(client, loc, [torch.randn(2, 4)], config=ExpertCallConfig())
                for _ in range(4)
            ]
            results = await asyncio.gather(*calls, return_exceptions=True)
            busy = [r for r in results if isinstance(r, RemoteError)]
            assert busy and all(r.remote_type == "ServerBusy" for r in busy)
            assert any(not isinstance(r, BaseException) for r in results)

    arun(main())


@pytest.mark.parametrize(
    ("codec", "tolerance"),
    [("float16", 2e-3), ("bfloat16", 2e-2), ("uint8", 5e-2), ("blockwise8", 5e-2)],
)
def test_compressed_calls_stay_within_the_codec_error(
    arun: Arun, codec: str, tolerance: float
) -> None:
    async def main() -> None:
        backend = _ffn(dim=64)
        # The reference computes on a copy: the server's thread clears the served
        # module's gradients after each backward (its step) while this one would add
        # to them, and torch does not survive that race.
        reference = copy.deepcopy(backend.module)
        async with _served([backend]) as (client, server):
            loc = _location(server.peer, "ffn.0.0")
            config = ExpertCallConfig(codec=codec)
            x = torch.randn(8, 64)
            (out,), _ = await call_forward(client, loc, [x], config=config, info=backend.info)
            g = torch.randn(8, 64)
            (grad,) = await call_backward(client, loc, [x], [g], config=config)
            x_ref = x.clone().requires_grad_()
            ref = reference(x_ref)
            ref.backward(g)
            assert (out - ref).abs().max() < tolerance * ref.abs().max()
            assert grad is not None and x_ref.grad is not None
            assert (grad - x_ref.grad).abs().max() < tolerance * x_ref.grad.abs().max()

    arun(main())


def test_a_kept_forward_spares_the_recomputation_unless_a_step_made_it_stale(arun: Arun) -> None:
    async def main() -> None:
        backend = _ffn(dim=16, lr=0.1)
        reference = FeedforwardBlock(16)
        reference.load_state_dict(backend.module.state_dict())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        x1, x2, g1, g2 = (
            torch.randn(2, 16),
            torch.randn(3, 16),
            torch.randn(2, 16),
            torch.randn(3, 16),
        )
        async with _served([backend]) as (client, server):
            loc = _location(server.peer, "ffn.0.0")
            config = ExpertCallConfig()
            _, token1 = await call_forward(client, loc, [x1], config=config, keep=True)
            _, token2 = await call_forward(client, loc, [x2], config=config, keep=True)
            assert token1 and token2 and token1 != token2
            (grad1,) = await call_backward(
                client, loc, [x1], [g1], config=config, forward_token=token1
            )
            assert backend.statistics().num_recomputed_samples == 0
            # the step that followed made the second graph stale: it is recomputed on the
            # new parameters, as if it had not been kept
            (grad2,) = await call_backward(
                client, loc, [x2], [g2], config=config, forward_token=token2
            )
            assert backend.statistics().num_recomputed_samples == 3
            # a token that is not ours (or is gone) is no error: the forward is recomputed
            (grad3,) = await call_backward(
                client, loc, [x2], [g2], config=config, forward_token=token1
            )
            assert backend.statistics().num_recomputed_samples == 6
        expected = []
        for x, g in ((x1, g1), (x2, g2), (x2, g2)):
            leaf = x.clone().requires_grad_()
            reference(leaf).backward(g)
            nn.utils.clip_grad_norm_(reference.parameters(), DEFAULT_CLIP_GRAD_NORM)  # as served
            ref_opt.step()
            ref_opt.zero_grad()
            expected.append(leaf.grad)
        for got, want in zip((grad1, grad2, grad3), expected, strict=True):
            assert got is not None and want is not None
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    arun(main())


class Fragile(nn.Module):
    """Raises on a batch holding a sample whose first value is 42."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] == 42).any()):
            raise RuntimeError("module broke on a 42")
        out: torch.Tensor = self.linear(x)
        return out


def test_a_failing_module_fails_every_caller_of_its_batch_and_keeps_serving(
    arun: Arun,
) -> None:
    async def main() -> None:
        spec = [TensorSpec(shape=[4], dtype="float32")]
        backend = ModuleBackend("fragile.0", Fragile(), inputs=spec, max_batch_size=16)
        async with _served([backend]) as (client, server):
            loc = _location(server.peer, "fragile.0")
            config = ExpertCallConfig(forward_timeout=10)
            bad = torch.zeros(2, 4)
            bad[0, 0] = 42
            outcomes = await asyncio.gather(
                *(call_forward(client, loc, [bad], config=config) for _ in range(3)),
                return_exceptions=True,
            )
            for outcome in outcomes:
                assert isinstance(outcome, RemoteError), outcome
                assert outcome.remote_type == "RuntimeError"
                assert "module broke on a 42" in str(outcome)
            assert len({id(o) for o in outcomes}) == 3
            out = await call_forward(client, loc, [torch.ones(3, 4)], config=config)
            assert out.outputs[0].shape == (3, 4)

    arun(main())


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 300 ms: with the inline bound raised to 40 ms, a
    module with a 20 ms forward well under it and a backward far over it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return grad


class ThreadRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.forward_threads: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_threads.append(threading.current_thread().name)
        time.sleep(0.02)
        out: torch.Tensor = _SlowBackward.apply(self.linear(x))  # type: ignore[no-untyped-call]
        return out


def test_a_cheap_forward_runs_on_the_loop_even_after_dear_backward_batches(
    arun: Arun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a batch runs inline is judged by its own kind's cost per sample: 300 ms
    backwards must not send the 20 ms forward of the same module to a thread (judged by
    one rate smoothed over both kinds, it looked like 45 ms). The bound is raised to
    40 ms so that a forward delayed by a loaded machine stays under it."""
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.04)
    module = ThreadRecorder()
    spec = [TensorSpec(shape=[4], dtype="float32")]
    backend = ModuleBackend("slow.0", module, inputs=spec, max_batch_size=8)
    batcher: Batcher[int] = Batcher(max_batch_size=8, max_queued_samples=64)
    worker = ModuleWorker(backend, batcher, KeptStore(max_entries=4, ttl_seconds=60.0))

    async def main() -> str:
        running = asyncio.create_task(worker.run())
        try:
            x, grad = torch.randn(1, 4), torch.randn(1, 4)
            for _ in range(8):  # forward, backward, forward, backward...
                await asyncio.wait_for(worker.submit("forward", ([x],), 1), 10)
                await asyncio.wait_for(worker.submit("backward", ([x], [grad]), 1), 10)
            module.forward_threads.clear()
            await asyncio.wait_for(worker.submit("forward", ([x],), 1), 10)
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        return threading.current_thread().name

    loop_thread = arun(main())
    assert module.forward_threads == [loop_thread]


class GatedSGD(torch.optim.SGD):
    """SGD whose step waits for ``gate`` (bounded); its next ``failures`` steps raise."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.failures = 0
        self.num_done = 0

    def step(self, closure: Any = None) -> Any:
        self.started.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the optimizer broke")
        out = super().step(closure)
        self.num_done += 1
        return out


def _gated_worker(module: nn.Module) -> tuple[ModuleWorker, GatedSGD]:
    """A worker whose every batch runs in a thread (so a backward steps in its thread)."""
    optimizer = GatedSGD(module.parameters(), lr=0.5)
    spec = [TensorSpec(shape=[4], dtype="float32")]
    backend = ModuleBackend("gated.0", module, inputs=spec, max_batch_size=8, optimizer=optimizer)
    batcher: Batcher[int] = Batcher(max_batch_size=8, max_queued_samples=64)
    return ModuleWorker(backend, batcher, KeptStore(max_entries=4, ttl_seconds=60.0)), optimizer


@contextlib.asynccontextmanager
async def _working(worker: ModuleWorker) -> AsyncIterator[asyncio.Task[None]]:
    running = asyncio.create_task(worker.run())
    try:
        yield running
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(running, 10)


def test_a_threaded_backward_replies_before_its_step_and_the_next_batch_waits_for_it(
    arun: Arun, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)
    module = nn.Linear(4, 4)
    reference = nn.Linear(4, 4)
    reference.load_state_dict(module.state_dict())
    worker, optimizer = _gated_worker(module)
    x, grad = torch.randn(2, 4), torch.randn(2, 4)

    async def main() -> None:
        async with _working(worker):
            (grad_x,), _ = await asyncio.wait_for(worker.submit("backward", ([x], [grad]), 2), 10)
            assert optimizer.started.wait(10)
            assert optimizer.num_done == 0  # the gradients came back before the step ended
            forward = asyncio.ensure_future(worker.submit("forward", ([x],), 2))
            done, _ = await asyncio.wait([forward], timeout=0.3)
            assert not done  # bounded wait: the next batch waits for the step
            optimizer.gate.set()
            (out,), _ = await asyncio.wait_for(forward, 10)
        assert optimizer.num_done == 1
        xr = x.clone().requires_grad_()
        reference(xr).backward(grad)
        assert grad_x is not None and xr.grad is not None
        assert torch.allclose(grad_x, xr.grad)
        nn.utils.clip_grad_norm_(reference.parameters(), DEFAULT_CLIP_GRAD_NORM)  # as served
        torch.optim.SGD(reference.parameters(), lr=0.5).step()
        with torch.no_grad():
            assert torch.allclose(out, reference(x))  # computed after the step

    arun(main())


def test_a_failed_threaded_backward_fails_its_callers_and_takes_no_step(
    arun: Arun, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)
    worker, optimizer = _gated_worker(Fragile())
    optimizer.gate.set()
    bad = torch.zeros(1, 4)
    bad[0, 0] = 42

    async def main() -> None:
        async with _working(worker):
            with pytest.raises(RuntimeError, match="module broke on a 42"):
                await asyncio.wait_for(worker.submit("backward", ([bad], [bad]), 1), 10)
            assert not optimizer.started.is_set()
            good = torch.ones(1, 4)
            await asyncio.wait_for(worker.submit("backward", ([good], [good]), 1), 10)
            (out,), _ = await asyncio.wait_for(worker.submit("forward", ([good],), 1), 10)
            assert out.shape == (1, 4)
        assert optimizer.num_done == 1

    arun(main())


def test_a_failed_step_is_logged_and_the_worker_goes_on(
    arun: Arun, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)
    worker, optimizer = _gated_worker(nn.Linear(4, 4))
    optimizer.gate.set()
    optimizer.failures = 1
    x = torch.randn(1, 4)

    async def main() -> None:
        async with _working(worker):
            (grad_x,), _ = await asyncio.wait_for(worker.submit("backward", ([x], [x]), 1), 10)
            assert grad_x is not None
            assert grad_x.shape == (1, 4)
            await asyncio.wait_for(worker.submit("backward", ([x], [x]), 1), 10)
            await asyncio.wait_for(worker.submit("forward", ([x],), 1), 10)
        assert optimizer.num_done == 1

    with caplog.at_level("WARNING", logger="swarm.experts.worker"):
        arun(main())
    assert any("optimizer step failed" in r.getMessage() for r in caplog.records)


def test_a_worker_cancelled_during_a_step_stops_only_after_it(
    arun: Arun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parameters are never left half-stepped: ``run`` returns once the step is done,
    however many times it is cancelled meanwhile."""
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)
    worker, optimizer = _gated_worker(nn.Linear(4, 4))
    x = torch.randn(1, 4)

    async def main() -> None:
        running = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.submit("backward", ([x], [x]), 1), 10)
        assert optimizer.started.wait(10)
        for _ in range(2):  # a second cancellation (a task group aborting) changes nothing
            running.cancel()
            done, _ = await asyncio.wait([running], timeout=0.3)
            assert not done  # bounded wait: still stepping
        optimizer.gate.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(running, 10)
        assert optimizer.num_done == 1

    arun(main())


def test_announcements_expire_on_the_dhts_clock(arun: Arun) -> None:
    """An announcement's expiration is read against the DHT's clock (the swarm's wall
    clock; a virtual one in in-memory tests), so it is set on that clock too: set on
    this machine's, against a DHT clock an hour ahead, every store was refused as
    expired."""

    async def main() -> tuple[int, float]:
        async with (
            Peer(LISTEN) as peer,
            DHT(peer, clock=lambda: dht_time() + 3600.0) as dht,
            ExpertServer(peer, [_ffn()], ServerConfig(), dht=dht) as server,
        ):
            stored = await server.announce()
            return stored, dht.clock()

    stored, now = arun(main())
    assert stored >= 1, "every announcement was refused as expired"
    assert now > dht_time() + 3000.0


class _Turnstile:
    """Once armed, lets a module's first computation of each kind through at once and
    holds each later one until ``release`` is set (bounded), recording whether it was
    set in time."""

    def __init__(self) -> None:
        self.armed = False
        self.release = threading.Event()
        self.seen: dict[str, int] = {}
        self.in_time: list[bool] = []

    def pass_through(self, kind: str) -> None:
        if not self.armed:
            return
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if self.seen[kind] > 1:
            self.in_time.append(self.release.wait(10))


class _TurnstileModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.turnstile = _Turnstile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.turnstile.pass_through("forward")
        out: torch.Tensor = self.linear(x)
        return out


def _synchronous_worker(module: nn.Module) -> ModuleWorker:
    """A worker of a module that steps only when its owner says (a synchronous stage)."""
    spec = [TensorSpec(shape=[4], dtype="float32")]
    backend = ModuleBackend("sync.0", module, inputs=spec, max_batch_size=8, step_on_backward=False)
    batcher: Batcher[int] = Batcher(max_batch_size=8, max_queued_samples=64)
    return ModuleWorker(backend, batcher, KeptStore(max_entries=4, ttl_seconds=60.0))


def test_a_forward_that_runs_on_its_own_in_a_batch_is_answered_before_the_batch_ends(
    arun: Arun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a stage that steps only when told (synchronous), forwards that keep their
    graphs run one by one even when queued together: each is answered as soon as it is
    computed, so the next stage of a pipeline starts on it while this one computes the
    rest. The module holds every forward after the first until the first one's caller
    has its answer (bounded: 10 s)."""
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)  # in a thread
    module = _TurnstileModule()
    worker = _synchronous_worker(module)
    xs = [torch.randn(1, 4) for _ in range(3)]
    batch_sizes: list[int] = []
    compute = ModuleWorker._compute

    def counted(self: ModuleWorker, kind: Any, jobs: Any, *args: Any) -> Any:
        batch_sizes.append(len(jobs))
        return compute(self, kind, jobs, *args)

    monkeypatch.setattr(ModuleWorker, "_compute", counted)

    async def main() -> None:
        async with _working(worker):
            module.turnstile.armed = True
            # queued together: one batch of three, whose later two wait for the first's answer
            tasks = [
                asyncio.ensure_future(worker.submit("forward", ([x],), 1, keep=True)) for x in xs
            ]
            await asyncio.wait_for(tasks[0], 10)
            assert not tasks[1].done() and not tasks[2].done()
            module.turnstile.release.set()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        for x, ((out,), kept) in zip(xs, results, strict=True):
            assert kept is not None
            with torch.no_grad():
                assert torch.allclose(out, module.linear(x))

    arun(main())
    assert module.turnstile.in_time == [True, True]
    assert batch_sizes == [3]  # one batch, answered a request at a time


class _BreaksOn42(torch.autograd.Function):
    """Identity whose backward raises if the module's input held a 42 first."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, broken: bool) -> torch.Tensor:
        ctx.broken = broken
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.broken:
            raise RuntimeError("backward broke on a 42")
        return grad, None


class _FragileBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.outer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the break sits between the layers: the outer one's gradients come before it
        broken = bool((x[:, 0] == 42).any())
        out: torch.Tensor = self.outer(_BreaksOn42.apply(self.inner(x), broken))  # type: ignore[no-untyped-call]
        return out


def test_on_a_synchronous_module_a_failed_backward_costs_only_the_requests_not_answered(
    arun: Arun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module its owner steps (a synchronous stage) answers each backward of a batch
    once its gradients are in; the batch's second request fails half-way through its
    backward: the first keeps its answer and its gradients, the failed one adds none
    (a backward is all or nothing), and the rest of the batch is told to retry. The
    module counts the first's pass alone."""
    monkeypatch.setattr(worker_module, "INLINE_COMPUTE_SECONDS", 0.0)
    module = _FragileBackward()
    reference = _FragileBackward()
    reference.load_state_dict(module.state_dict())
    worker = _synchronous_worker(module)
    xs = [torch.randn(1, 4) for _ in range(3)]
    xs[1][0, 0] = 42
    grads = [torch.randn(1, 4) for _ in range(3)]

    async def main() -> list[Any]:
        async with _working(worker):
            kept = []
            for x in xs:
                _, graph = await asyncio.wait_for(
                    worker.submit("forward", ([x],), 1, keep=True), 10
                )
                kept.append(graph)
            calls = [
                asyncio.ensure_future(
                    worker.submit("backward", ([x], [g]), 1, kept=graph, tag=f"pass {i}")
                )
                for i, (x, g, graph) in enumerate(zip(xs, grads, kept, strict=True))
            ]  # queued together: one batch
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)

    first, second, third = arun(main())
    assert not isinstance(first, BaseException)
    assert isinstance(second, RuntimeError) and "broke on a 42" in str(second)
    assert isinstance(third, RuntimeError)  # not computed: its caller retries it
    reference(xs[0]).backward(grads[0])
    for p, r in zip(module.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and r.grad is not None
        assert torch.equal(p.grad, r.grad)  # the first request's, nothing of the second's
    assert worker.backend.counted == ("pass 0",)  # the passes the gradients hold


def test_the_passes_a_module_counts_are_bounded_and_leave_with_its_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ModuleBackend.counted``: each tagged backward's tags once its gradients are in,
    at most ``MAX_COUNTED_PASSES`` (the rest one overflow mark), gone with the
    gradients when they are taken or discarded."""
    monkeypatch.setattr(backend_module, "MAX_COUNTED_PASSES", 3)
    backend = _synchronous_worker(nn.Linear(4, 4)).backend
    x, grad = torch.randn(2, 4), torch.randn(2, 4)
    backend.backward([x], [grad], tags=["a"])
    backend.backward([x], [grad])  # untagged: counts no pass
    assert backend.counted == ("a",)
    for tag in "bcde":
        backend.backward([x], [grad], tags=[tag])
    assert backend.counted == ("a", "b", backend_module.COUNTED_OVERFLOW)
    assert backend.take_gradients() and backend.counted == ()
    backend.backward([x], [grad], tags=["f", "g"])
    backend.discard_gradients()
    assert backend.counted == ()
