"""Item 7 of the security issue, the experts' trust model (docs/experts-trust.md).

What a hostile caller of an expert server tries, and what stops it: huge gradients
(clipping, on by default, per caller and per step), flooding a module's queue (a share
per caller, served round-robin), training a module it should not (``allowed_trainers``).
Pure parts without a loop; the server's handlers on loopback peers in one process; and
``swarm serve`` as a real process, attacked by peers written here. Each attack is also
run against the old behaviour (no clipping, no per-caller share), where it succeeds, so
no test passes whatever the code does.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from peers import BlockingPeer, KeyPair, Peer, PeerConfig, PeerID, RemoteError
from swarm.experts import (
    Batch,
    Batcher,
    ExpertCallConfig,
    ExpertLocation,
    ExpertServer,
    ModuleBackend,
    RemoteExpert,
    ServerBusy,
    ServerConfig,
    TensorSpec,
    call_backward,
    call_forward,
)
from swarm.experts.backend import DEFAULT_CLIP_GRAD_NORM
from swarm.experts.serve import ServeConfig

Arun = Callable[[Coroutine[Any, Any, Any]], Any]
SWARM = [sys.executable, "-m", "swarm.cli"]
LISTEN = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
TRAINER = KeyPair.from_seed(bytes([71]) * 32)
OUTSIDER = KeyPair.from_seed(bytes([72]) * 32)
SPEC = [TensorSpec(shape=[4], dtype="float32")]
#: The hostile factor: gradients (and inputs) this many times an honest caller's.
HUGE = 1e6
LR = 0.1
#: Seconds any one step of these tests may take on a loaded 2-core machine.
WAIT = 30.0

torch.set_num_threads(1)


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


# --- pure: the batcher's per-caller share and rotation ----------------------------------


def test_a_caller_past_its_share_is_refused_and_only_it() -> None:
    b: Batcher[int] = Batcher(
        max_batch_size=4, max_queued_samples=16, max_queued_samples_per_caller=8
    )
    b.submit(1, "backward", 4, 0.0, caller="flood")
    b.submit(2, "backward", 4, 0.0, caller="flood")
    with pytest.raises(ServerBusy, match=r"you have 8 samples queued here already \(at most 8 per"):
        b.submit(3, "backward", 1, 0.0, caller="flood")
    b.submit(4, "forward", 4, 0.0, caller="honest")  # the others' half is still open
    assert (b.queued_samples_of("flood"), b.queued_samples_of("honest")) == (8, 4)
    assert b.cancel(1)
    b.submit(3, "backward", 4, 0.0, caller="flood")  # back under its share
    with pytest.raises(ValueError, match="max_queued_samples_per_caller"):
        Batcher(max_batch_size=4, max_queued_samples=16, max_queued_samples_per_caller=2)


def test_callers_are_served_round_robin_not_first_come() -> None:
    """A caller with one request gets into the next batch however many another queued."""
    b: Batcher[str] = Batcher(max_batch_size=4, max_queued_samples=64)
    for i in range(6):
        b.submit(f"f{i}", "backward", 2, float(i), caller="flood")
    b.submit("h0", "backward", 2, 10.0, caller="honest")
    b.submit("h1", "backward", 2, 11.0, caller="honest")
    assert b.next_batch(12.0) == Batch("backward", ("f0", "h0"), 4)
    assert b.next_batch(12.0) == Batch("backward", ("f1", "h1"), 4)
    assert b.next_batch(12.0) == Batch("backward", ("f2", "f3"), 4)
    # served callers go to the back: a newcomer is next, not behind the rest of the flood
    b.submit("n0", "forward", 4, 13.0, caller="new")
    assert b.next_batch(13.0) == Batch("backward", ("f4", "f5"), 4)
    assert b.next_batch(13.0) == Batch("forward", ("n0",), 4)


def test_the_rotation_lets_another_kind_go_first() -> None:
    b: Batcher[str] = Batcher(max_batch_size=8, max_queued_samples=64)
    b.submit("a", "forward", 1, 0.0, caller="A")
    b.submit("b", "backward", 1, 1.0, caller="B")
    b.submit("a2", "forward", 1, 2.0, caller="A")
    assert b.next_batch(3.0) == Batch("forward", ("a", "a2"), 2)
    assert b.next_batch(3.0) == Batch("backward", ("b",), 1)
    assert b.next_batch(3.0) is None


def test_random_callers_get_bounded_shares_and_every_request_is_served_once() -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    b: Batcher[int] = Batcher(
        max_batch_size=8, max_queued_samples=64, max_queued_samples_per_caller=24
    )
    queued: dict[int, tuple[str, int]] = {}
    served: list[int] = []
    for ticket in range(2000):
        caller = rng.choice("ABCD")
        if rng.random() < 0.6:
            size = rng.randint(1, 8)
            mine = sum(n for c, n in queued.values() if c == caller)
            try:
                b.submit(ticket, rng.choice(["forward", "backward"]), size, ticket, caller=caller)
                queued[ticket] = (caller, size)
            except ServerBusy:
                assert mine + size > 24 or sum(n for _, n in queued.values()) + size > 64
        elif rng.random() < 0.2 and queued:
            victim = rng.choice(list(queued))
            assert b.cancel(victim)
            del queued[victim]
        else:
            batch = b.next_batch(ticket)
            if isinstance(batch, Batch):
                assert 1 <= batch.num_samples <= 8
                assert batch.num_samples == sum(queued.pop(t)[1] for t in batch.tickets)
                served.extend(batch.tickets)
        for c in "ABCD":
            assert b.queued_samples_of(c) == sum(n for x, n in queued.values() if x == c) <= 24
    assert len(served) == len(set(served))


# --- pure: clipping, per caller and per step --------------------------------------------


def _linear_backend(clip: float | None = DEFAULT_CLIP_GRAD_NORM) -> tuple[ModuleBackend, nn.Module]:
    torch.manual_seed(0)
    module = nn.Linear(4, 4)
    reference = nn.Linear(4, 4)
    reference.load_state_dict(module.state_dict())
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    backend = ModuleBackend(
        "lin.0", module, inputs=SPEC, max_batch_size=64, optimizer=optimizer, clip_grad_norm=clip
    )
    return backend, reference


def test_clipping_is_on_by_default_and_bounds_a_step_whatever_the_gradient() -> None:
    assert DEFAULT_CLIP_GRAD_NORM == 1.0
    assert ServeConfig(uids=("lin.0",)).clip_grad_norm == DEFAULT_CLIP_GRAD_NORM
    module = nn.Linear(4, 4)
    assert ModuleBackend("lin.0", module, inputs=SPEC, max_batch_size=4).clip_grad_norm == 1.0
    moved = {}
    for clip in (DEFAULT_CLIP_GRAD_NORM, None):
        backend, _ = _linear_backend(clip)
        before = _flat(backend.module)
        x, g = torch.randn(8, 4) * 1e3, torch.randn(8, 4) * HUGE
        backend.backward([x], [g])
        backend.step()
        moved[clip] = float((_flat(backend.module) - before).norm())
        assert torch.isfinite(_flat(backend.module)).all()
        assert backend.statistics().num_clipped_contributions == (clip is not None)
    assert moved[DEFAULT_CLIP_GRAD_NORM] <= LR * DEFAULT_CLIP_GRAD_NORM * (1 + 1e-5)
    assert moved[None] > 1e6 * LR * DEFAULT_CLIP_GRAD_NORM  # what the attack did before


def test_each_callers_contribution_is_clipped_on_its_own_then_their_sum() -> None:
    """A hostile caller sharing a step with an honest one: its contribution counts at
    most ``clip`` in norm, and the honest one's still shows in the step (clipping only
    the sum, as before, the hostile gradient would be the whole step)."""
    backend, reference = _linear_backend()
    x, g = torch.randn(3, 4), torch.randn(3, 4) * 0.1  # honest: a small gradient
    hx, hg = torch.randn(3, 4), torch.randn(3, 4) * HUGE  # hostile
    before = _flat(backend.module)
    backend.backward([x], [g])
    backend.end_contribution()
    backend.backward([hx], [hg])
    backend.end_contribution()
    backend.step()
    stats = backend.statistics()
    assert (stats.num_contributions, stats.num_clipped_contributions) == (2, 1)
    assert stats.num_optimizer_steps == 1

    def grads(inputs: torch.Tensor, grad_outputs: torch.Tensor) -> list[torch.Tensor]:
        reference.zero_grad()
        reference(inputs).backward(grad_outputs)
        out = [p.grad.clone() for p in reference.parameters() if p.grad is not None]
        scale = min(
            1.0, DEFAULT_CLIP_GRAD_NORM / float(torch.cat([t.flatten() for t in out]).norm())
        )
        return [t * scale for t in out]

    summed = [a + b for a, b in zip(grads(x, g), grads(hx, hg), strict=True)]
    total = float(torch.cat([t.flatten() for t in summed]).norm())
    expected = torch.cat([t.flatten() for t in summed]) * min(1.0, DEFAULT_CLIP_GRAD_NORM / total)
    torch.testing.assert_close(before - _flat(backend.module), LR * expected, atol=1e-6, rtol=1e-4)
    # the honest gradient is in the step: it is not the hostile direction alone
    hostile_only = torch.cat([t.flatten() for t in grads(hx, hg)])
    assert float((expected - hostile_only).norm()) > 0.01


def test_a_contribution_that_overflows_is_dropped_and_the_step_keeps_the_rest() -> None:
    """Finite inputs can still overflow float32 in the backward (1e30 x 1e30); clipping an
    infinite norm would write NaN into the parameters."""
    backend, _ = _linear_backend()
    before = _flat(backend.module)
    backend.backward([torch.full((2, 4), 1e30)], [torch.full((2, 4), 1e30)])
    backend.end_contribution()
    backend.step()
    assert torch.equal(_flat(backend.module), before)  # nothing else contributed: no step
    stats = backend.statistics()
    assert (stats.num_dropped_contributions, stats.num_optimizer_steps) == (1, 0)
    backend.backward([torch.randn(2, 4)], [torch.full((2, 4), 1e30)])
    backend.end_contribution()
    backend.backward([torch.randn(2, 4)], [torch.randn(2, 4)])
    backend.step()  # the open gradients count as one contribution
    assert torch.isfinite(_flat(backend.module)).all()
    assert not torch.equal(_flat(backend.module), before)
    assert backend.statistics().num_optimizer_steps == 1


def test_half_precision_gradients_are_measured_in_float32() -> None:
    """An honest float16 gradient whose norm is past 65504 is clipped, not dropped as an
    overflow."""
    from swarm.experts.backend import clip_gradients

    grads = [torch.full((10,), 60000.0, dtype=torch.float16)]
    norm = clip_gradients(grads, 1.0)
    assert math.isclose(norm, 60000.0 * math.sqrt(10), rel_tol=1e-3)
    assert math.isclose(float(grads[0].float().norm()), 1.0, rel_tol=1e-2)
    small = [torch.full((4,), 0.25)]
    assert clip_gradients(small, 1.0) == 0.5 and torch.equal(small[0], torch.full((4,), 0.25))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_clip_grad_norm_must_be_finite_and_positive_or_none(bad: float) -> None:
    with pytest.raises(ValueError, match="finite and positive, or None"):
        ServeConfig(uids=("lin.0",), clip_grad_norm=bad)
    with pytest.raises(ValueError, match="finite and positive, or None"):
        ModuleBackend("lin.0", nn.Linear(4, 4), inputs=SPEC, max_batch_size=4, clip_grad_norm=bad)
    assert ServeConfig(uids=("lin.0",), clip_grad_norm=None).clip_grad_norm is None


def test_server_config_checks_its_trust_fields() -> None:
    ServerConfig(allowed_trainers=frozenset({TRAINER.peer_id}))
    ServerConfig(allowed_trainers=frozenset())  # nobody trains: inference only
    with pytest.raises(ValueError, match="frozenset of PeerIDs"):
        ServerConfig(allowed_trainers=[TRAINER.peer_id])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="frozenset of PeerIDs"):
        ServerConfig(allowed_trainers=frozenset({str(TRAINER.peer_id)}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queued_batches_per_caller must be at least 1"):
        ServerConfig(max_queued_batches_per_caller=0)


def test_the_cli_builds_the_trust_fields_from_its_flags() -> None:
    from swarm import cli

    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--uids", "lin.0"])
    assert args.clip_grad_norm == DEFAULT_CLIP_GRAD_NORM  # the config's own default
    assert args.allow_trainer is None and args.allow_trainer_file is None
    args = parser.parse_args(["serve", "--uids", "lin.0", "--clip-grad-norm", "none"])
    assert args.clip_grad_norm is None
    args = parser.parse_args(["serve", "--uids", "lin.0", "--clip-grad-norm", "2.5"])
    assert args.clip_grad_norm == 2.5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--clip-grad-norm", "0"], "--clip-grad-norm: must be a finite positive number, or none"),
        (["--clip-grad-norm", "inf"], "must be a finite positive number"),
        (["--allow-trainer", "nope"], "--allow-trainer: 'nope' is not a peer ID"),
        (["--allow-trainer-file", "/nonexistent/trainers"], "--allow-trainer-file /nonexistent"),
    ],
)
def test_bad_trust_flags_exit_2_before_anything_starts(args: list[str], message: str) -> None:
    out = subprocess.run(
        [*SWARM, "serve", "--uids", "lin.0", "--listen", "/ip4/127.0.0.1/tcp/0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and message in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


# --- loopback: the server's handlers, peers in one process ------------------------------


class Gated(nn.Module):
    """Linear(4, 4) whose forward waits for ``gate`` (bounded) and records the first value
    of each batch it computes, so a test knows which request ran when."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gate = threading.Event()
        self.gate.set()  # open for the backend's trial forward
        self.seen: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(float(x[0, 0].detach()))
        assert self.gate.wait(WAIT), "the test never opened the gate"
        out: torch.Tensor = self.linear(x)
        return out


def _gated(max_batch_size: int, lr: float = 0.0) -> tuple[ModuleBackend, Gated]:
    """A backend of a Gated module, its gate closed."""
    module = Gated()
    optimizer = torch.optim.SGD(module.parameters(), lr=lr) if lr else None
    backend = ModuleBackend(
        "gated.0", module, inputs=SPEC, max_batch_size=max_batch_size, optimizer=optimizer
    )
    module.gate.clear()
    module.seen.clear()
    return backend, module


@contextlib.asynccontextmanager
async def _serving(
    backend: ModuleBackend, config: ServerConfig
) -> AsyncIterator[tuple[ExpertServer, Peer, Peer, ExpertLocation]]:
    """A server and two callers on loopback: the trainer and the outsider."""
    async with (
        Peer(LISTEN) as server_peer,
        Peer(PeerConfig(identity=TRAINER, listen_addrs=())) as trainer,
        Peer(PeerConfig(identity=OUTSIDER, listen_addrs=())) as outsider,
        ExpertServer(server_peer, [backend], config) as server,
    ):
        for client in (trainer, outsider):
            client.add_addresses(server_peer.peer_id, server_peer.listen_addrs)
        location = ExpertLocation(backend.uid, server_peer.peer_id)
        yield server, trainer, outsider, location


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) until ``condition()`` holds, looking every few milliseconds."""
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        await asyncio.sleep(0.005)


def _flood_then_call(arun: Arun, per_caller_batches: int) -> tuple[list[Any], object, list[float]]:
    """The outsider floods a module (2 samples a batch, a queue of 4 batches) while its
    first batch computes; then the trainer makes one call. Returns the flood's outcomes,
    the trainer's outcome, and the order batches ran in (by their first value: 10 + i for
    the flood's i-th call, 2 for the trainer's)."""
    backend, module = _gated(max_batch_size=2)
    config = ServerConfig(max_queued_batches=4, max_queued_batches_per_caller=per_caller_batches)
    calls = ExpertCallConfig(forward_timeout=WAIT)

    async def main() -> tuple[list[Any], object]:
        async with _serving(backend, config) as (server, trainer, outsider, loc):

            def flood(i: int) -> asyncio.Future[Any]:
                x = torch.full((2, 4), 10.0 + i)
                return asyncio.ensure_future(call_forward(outsider, loc, [x], config=calls))

            first = flood(0)
            await _until(lambda: len(module.seen) == 1, "the first batch computes")
            rest = [flood(i) for i in range(1, 9)]
            refused = 8 - per_caller_batches
            await _until(lambda: sum(f.done() for f in rest) == refused, "the excess is refused")
            queued = server.statistics().queued_samples["gated.0"]
            assert queued == 2 * per_caller_batches
            mine = asyncio.ensure_future(
                call_forward(trainer, loc, [torch.full((1, 4), 2.0)], config=calls)
            )
            await _until(
                lambda: mine.done() or server.statistics().queued_samples["gated.0"] > queued,
                "the trainer's call is queued or refused",
            )
            module.gate.set()
            outcomes = await asyncio.gather(first, *rest, return_exceptions=True)
            (outcome,) = await asyncio.gather(mine, return_exceptions=True)
            return outcomes, outcome

    outcomes, outcome = arun(main())
    return outcomes, outcome, module.seen


def test_a_flooding_caller_cannot_starve_another(arun: Arun) -> None:
    outcomes, outcome, seen = _flood_then_call(arun, per_caller_batches=2)
    assert not isinstance(outcome, BaseException), outcome  # served, not refused
    busy = [o for o in outcomes if isinstance(o, RemoteError)]
    assert len(busy) == 6  # the flood's excess, and only it, was refused
    for error in busy:
        assert error.remote_type == "ServerBusy"
        assert "you have 4 samples queued here already (at most 4 per caller)" in str(error)
    # round-robin: the trainer's batch ran second after the one computing when it came,
    # ahead of the flood's last queued request
    assert seen[0] == 10.0 and seen[2] == 2.0 and len(seen) == 4, seen


def test_without_a_per_caller_share_the_flood_starves_the_other_caller(arun: Arun) -> None:
    """The old behaviour (one queue bound for all callers): the attack works."""
    outcomes, outcome, _ = _flood_then_call(arun, per_caller_batches=4)
    assert isinstance(outcome, RemoteError) and outcome.remote_type == "ServerBusy", outcome
    assert "samples are queued already" in str(outcome)
    assert sum(not isinstance(o, BaseException) for o in outcomes) == 5


def test_an_outsiders_backward_is_refused_and_touches_nothing(arun: Arun) -> None:
    backend, _ = _linear_backend()
    config = ServerConfig(allowed_trainers=frozenset({TRAINER.peer_id}))
    calls = ExpertCallConfig(forward_timeout=WAIT, backward_timeout=WAIT)
    before = _flat(backend.module)

    async def main() -> None:
        async with _serving(backend, config) as (server, trainer, outsider, loc):
            x = torch.randn(3, 4)
            # forward is open to all, but keeps no graph for a peer that may not train
            (out,), token = await call_forward(outsider, loc, [x], config=calls, keep=True)
            assert out.shape == (3, 4) and token == 0
            with pytest.raises(RemoteError, match="not one of them") as caught:
                await call_backward(outsider, loc, [x], [torch.randn(3, 4) * HUGE], config=calls)
            assert caught.value.remote_type == "TrainingNotAllowed"
            assert str(OUTSIDER.peer_id) in str(caught.value)
            assert torch.equal(_flat(backend.module), before)
            assert all(p.grad is None for p in backend.module.parameters())
            assert server.statistics().num_refused_trainings == 1
            assert backend.statistics().num_backward_samples == 0
            # the trainer trains
            _, token = await call_forward(trainer, loc, [x], config=calls, keep=True)
            assert token != 0
            await call_backward(
                trainer, loc, [x], [torch.randn(3, 4)], config=calls, forward_token=token
            )
            await _until(lambda: backend.statistics().num_optimizer_steps == 1, "it steps")
            assert not torch.equal(_flat(backend.module), before)

    arun(main())


def test_callers_sharing_a_backward_batch_are_clipped_each_on_their_own(arun: Arun) -> None:
    """Through the worker: two callers' backwards run in one batch (they queued while the
    module computed), and the step is the per-caller clipped sum, as in the pure test."""
    backend, module = _gated(max_batch_size=8, lr=LR)
    reference = nn.Linear(4, 4)
    reference.load_state_dict(module.linear.state_dict())
    calls = ExpertCallConfig(forward_timeout=WAIT, backward_timeout=WAIT)
    x, g = torch.randn(2, 4), torch.randn(2, 4) * 0.1
    hx, hg = torch.randn(2, 4), torch.randn(2, 4) * HUGE

    async def main() -> None:
        async with _serving(backend, ServerConfig()) as (server, trainer, outsider, loc):
            busy = asyncio.ensure_future(call_forward(trainer, loc, [x], config=calls))
            await _until(lambda: len(module.seen) == 1, "the module computes")
            both = [
                asyncio.ensure_future(call_backward(trainer, loc, [x], [g], config=calls)),
                asyncio.ensure_future(call_backward(outsider, loc, [hx], [hg], config=calls)),
            ]
            await _until(lambda: server.statistics().queued_samples["gated.0"] == 4, "both queue")
            module.gate.set()
            await asyncio.gather(busy, *both)
            await _until(lambda: backend.statistics().num_optimizer_steps == 1, "it steps")

    before = _flat(module)
    arun(main())
    stats = backend.statistics()
    assert (stats.num_contributions, stats.num_clipped_contributions) == (2, 1)
    parts = []
    for inputs, grad_outputs in ((x, g), (hx, hg)):
        reference.zero_grad()
        reference(inputs).backward(grad_outputs)
        flat = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None])
        parts.append(flat * min(1.0, DEFAULT_CLIP_GRAD_NORM / float(flat.norm())))
    summed = parts[0] + parts[1]
    expected = summed * min(1.0, DEFAULT_CLIP_GRAD_NORM / float(summed.norm()))
    torch.testing.assert_close(before - _flat(module), LR * expected, atol=1e-6, rtol=1e-4)


# --- real processes: `swarm serve`, attacked by peers written here -----------------------


@contextlib.contextmanager
def _swarm_serve(*flags: str) -> Iterator[str]:
    """``swarm serve`` hosting ``lin.0`` (a Linear(8, 8), SGD at LR); yields its multiaddr."""
    proc = subprocess.Popen(
        [
            *SWARM,
            "serve",
            *("--module", "linear", "--hidden-dim", "8", "--uids", "lin.0", "--seed", "0"),
            *("--optimizer", "sgd", "--lr", str(LR), "--linear-kernels", "torch"),
            *("--listen", "/ip4/127.0.0.1/tcp/0", *flags),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        maddr = proc.stdout.readline().strip()  # bounded by the pytest timeout
        assert maddr.startswith("/ip4/127.0.0.1/tcp/"), proc.stderr.read() if proc.stderr else ""
        assert proc.stdout.readline().startswith("serving 1 experts")
        yield maddr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT)


def _client(key: KeyPair, maddr: str) -> tuple[BlockingPeer, ExpertLocation]:
    peer = BlockingPeer(PeerConfig(identity=key, listen_addrs=()))
    peer.connect(maddr, timeout=WAIT)
    return peer, ExpertLocation("lin.0", PeerID.from_base58(maddr.rsplit("/", 1)[1]))


CALLS = ExpertCallConfig(forward_timeout=WAIT, backward_timeout=WAIT)


def _parameters(peer: BlockingPeer, location: ExpertLocation) -> torch.Tensor:
    """The served Linear's weight and bias, read through its forward: y(0) is the bias,
    y(e_i) - y(0) the weight's column i. (So anyone who may call forward can read a
    linear expert's parameters: docs/experts-trust.md.)"""
    probe = torch.cat([torch.zeros(1, 8), torch.eye(8)])
    (out,), _ = peer.run(call_forward(peer.peer, location, [probe], config=CALLS), WAIT)
    bias = out[0]
    return torch.cat([(out[1:] - bias).T.flatten(), bias])


def _attack(peer: BlockingPeer, location: ExpertLocation, num_calls: int) -> None:
    """Backward calls with inputs a thousand and gradients a million times too large."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(num_calls):
        x = torch.randn(4, 8, generator=gen) * 1e3
        g = torch.randn(4, 8, generator=gen) * HUGE
        peer.run(call_backward(peer.peer, location, [x], [g], config=CALLS), WAIT)


def _steps_after_attack(*flags: str, num_calls: int) -> tuple[float, torch.Tensor]:
    """How far ``num_calls`` hostile backward calls moved the parameters of a served
    expert, and the parameters after an honest caller trained on."""
    with _swarm_serve(*flags) as maddr:
        hostile, location = _client(OUTSIDER, maddr)
        honest, _ = _client(TRAINER, maddr)
        with hostile, honest:
            before = _parameters(hostile, location)
            _attack(hostile, location, num_calls)
            after = _parameters(hostile, location)  # runs after the last step
            expert = RemoteExpert(location, honest, CALLS)
            x = torch.randn(5, 8, requires_grad=True)
            expert(x).square().mean().backward()  # the run goes on at its pace
            assert x.grad is not None and torch.isfinite(x.grad).all()
            return float((after - before).norm()), _parameters(honest, location)


def test_huge_gradients_move_a_served_expert_at_most_lr_times_the_clip_per_step() -> None:
    moved, final = _steps_after_attack(num_calls=5)
    print(f"moved {moved:.4f} with clipping (bound {5 * LR * DEFAULT_CLIP_GRAD_NORM})")
    # 1e-4: the forward's float32 rounding in reading the parameters
    assert moved <= 5 * LR * DEFAULT_CLIP_GRAD_NORM + 1e-4
    assert torch.isfinite(final).all() and float(final.abs().max()) < 10
    # the same attack on the old default, no clipping: the model is gone
    moved, _ = _steps_after_attack("--clip-grad-norm", "none", num_calls=5)
    print(f"moved {moved:.3g} without clipping")
    assert moved > 1e6 * 5 * LR * DEFAULT_CLIP_GRAD_NORM


def test_swarm_serve_trains_only_on_its_allowed_trainers() -> None:
    with _swarm_serve("--allow-trainer", str(TRAINER.peer_id)) as maddr:
        outsider, location = _client(OUTSIDER, maddr)
        trainer, _ = _client(TRAINER, maddr)
        with outsider, trainer:
            before = _parameters(outsider, location)  # forward is open to the outsider
            with pytest.raises(RemoteError, match="not one of them") as caught:
                _attack(outsider, location, 1)
            assert caught.value.remote_type == "TrainingNotAllowed"
            assert torch.equal(_parameters(outsider, location), before)
            expert = RemoteExpert(location, trainer, CALLS)
            expert(torch.randn(3, 8)).sum().backward()
            assert not torch.equal(_parameters(trainer, location), before)
