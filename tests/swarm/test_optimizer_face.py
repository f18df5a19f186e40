"""The collaborative optimizer as a torch optimizer (one peer, stepping alone): the
training loop torch users write, schedulers, state_dict, and the codec chosen."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from averaging import Float16Codec, NoneCodec
from averaging.allreduce.config import AllReduceConfig
from peers.dht import BlockingDHT
from swarm.collaborative.config import CollaborativeConfig, DiLoCoConfig, OptimizerError
from swarm.collaborative.optimizer import CollaborativeOptimizer

LOCAL_BATCH, GLOBAL_BATCH = 4, 8  # two local steps per global step


def _data(seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(LOCAL_BATCH, 3, generator=generator)
        yield x, x.sum(dim=1, keepdim=True)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def _config(**fields: object) -> CollaborativeConfig:
    return CollaborativeConfig(
        run_id="face",
        target_batch_size=GLOBAL_BATCH,
        batch_size_per_step=LOCAL_BATCH,
        state_timeout=1.0,
        **fields,  # type: ignore[arg-type]
    )


def _step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(opt: CollaborativeOptimizer, model: nn.Module, data: Iterator, local_steps: int) -> None:
    for _ in range(local_steps):  # the loop as torch users write it
        x, y = next(data)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


@pytest.fixture
def dht() -> Iterator[BlockingDHT]:
    with BlockingDHT() as node:
        yield node


def test_a_torch_training_loop_with_a_scheduler_steps_once_per_global_step(
    dht: BlockingDHT,
) -> None:
    model, reference = _model(), _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CollaborativeOptimizer(inner, dht, _config(), scheduler=_step_lr) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        assert opt.param_groups is inner.param_groups and opt.state is inner.state
        _train(opt, model, _data(1), local_steps=10)
        assert opt.epoch == 5 and opt.scheduler is not None
        assert opt.scheduler.last_epoch == 5
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    # One process doing the same: the mean gradient of two local batches, one step, one
    # scheduler step.
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler, data = _step_lr(plain), _data(1)
    for _ in range(5):
        plain.zero_grad()
        for _ in range(2):
            x, y = next(data)
            (nn.functional.mse_loss(reference(x), y) / 2).backward()
        plain.step()
        scheduler.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_a_scheduler_built_on_the_collaborative_optimizer_sets_the_wrapped_rates(
    dht: BlockingDHT,
) -> None:
    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    with CollaborativeOptimizer(inner, dht, _config()) as opt:
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
        data = _data(2)
        for _ in range(3):
            before = opt.epoch
            _train(opt, model, data, local_steps=1)
            if opt.epoch != before:  # step the scheduler per global step
                scheduler.step()
        assert opt.epoch == 1 and inner.param_groups[0]["lr"] == pytest.approx(0.005)


def test_step_takes_a_closure_as_torch_optimizers_do(dht: BlockingDHT) -> None:
    model = _model()
    with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, _config()) as opt:
        x, y = next(_data(3))

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        first = opt.step(closure)
        second = opt.step(LOCAL_BATCH, closure)
        assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)
        assert first.requires_grad  # computed with gradients on, as torch's closures are
        assert opt.epoch == 1 and opt.accumulated == 0


def test_state_dict_round_trip_continues_the_same_run(dht: BlockingDHT) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with CollaborativeOptimizer(inner, dht, _config(), scheduler=_step_lr) as opt:
        data = _data(4)
        _train(opt, model, data, local_steps=6)
        saved = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
        _train(opt, model, data, local_steps=4)  # on to epoch 5
        expected = [p.detach().clone() for p in model.parameters()]
        lr = opt.param_groups[0]["lr"]
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)  # nothing to unpickle
    restored = _model()
    restored.load_state_dict(checkpoint["model"])
    inner = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    with (
        BlockingDHT() as other,
        CollaborativeOptimizer(inner, other, _config(), scheduler=_step_lr) as opt,
    ):
        opt.load_state_dict(checkpoint["optimizer"])
        assert opt.epoch == 3 and opt.scheduler is not None and opt.scheduler.last_epoch == 3
        data = _data(4)
        for _ in range(6):
            next(data)  # the batches the first run took before it saved
        _train(opt, restored, data, local_steps=4)
        assert opt.epoch == 5 and opt.param_groups[0]["lr"] == pytest.approx(lr)
    for ours, theirs in zip(restored.parameters(), expected, strict=True):
        assert torch.equal(ours.detach(), theirs)


def test_the_scheduler_follows_the_epoch_back_and_forth(dht: BlockingDHT) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with CollaborativeOptimizer(inner, dht, _config(), scheduler=_step_lr) as opt:
        opt.epoch = 5  # as a state download sets it
        opt._follow_epoch()
        assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
        opt.epoch = 1
        opt._follow_epoch()
        assert inner.param_groups[0]["lr"] == pytest.approx(0.1)
        assert opt.scheduler is not None and opt.scheduler.last_epoch == 1


def test_what_is_not_a_torch_optimizers_use_is_refused_clearly(dht: BlockingDHT) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    no_size = CollaborativeConfig(run_id="face", target_batch_size=GLOBAL_BATCH)
    with CollaborativeOptimizer(inner, dht, no_size) as opt:
        with pytest.raises(OptimizerError, match="step needs the local batch size"):
            opt.step()
        for bad in (0, -1, 2.5, True):
            with pytest.raises(OptimizerError, match="batch_size must be a positive int"):
                opt.step(bad)  # type: ignore[arg-type]
        with pytest.raises(OptimizerError, match="parameters are fixed"):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
        good = opt.state_dict()
        for broken, message in (
            ({}, "not a collaborative optimizer's state_dict"),
            ({**good, "format": 99}, "not a collaborative optimizer's state_dict"),
            ({**good, "epoch": -1}, "epoch must be an int >= 0"),
            ({**good, "epoch": "3"}, "epoch must be an int >= 0"),
            ({**good, "scheduler": {"last_epoch": 2}}, "has no scheduler"),
            ({**good, "outer": {}, "anchor": []}, "a DiLoCo optimizer's state_dict"),
        ):
            with pytest.raises(OptimizerError, match=message):
                opt.load_state_dict(broken)
        assert opt.epoch == 0  # nothing changed
        opt.load_state_dict(good)
    with pytest.raises(OptimizerError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        CollaborativeOptimizer(object(), dht, no_size)  # type: ignore[arg-type]
    with pytest.raises(OptimizerError, match="must return a learning-rate scheduler"):
        CollaborativeOptimizer(inner, dht, no_size, scheduler=lambda o: 5)  # type: ignore[arg-type,return-value]


def test_the_codec_chosen_is_the_codec_used_or_refused_with_a_reason(dht: BlockingDHT) -> None:
    model = _model()
    half = AllReduceConfig(
        sender_timeout=5.0, reducer_timeout=10.0, round_timeout=20.0, codec=Float16Codec()
    )
    with CollaborativeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), dht, _config(allreduce=half)
    ) as opt:
        assert isinstance(opt.driver.averager.config.allreduce.codec, Float16Codec)
    with pytest.raises(OptimizerError, match=r"diloco\.codec"):
        _config(allreduce=half, diloco=DiLoCoConfig())
    assert isinstance(_config(diloco=DiLoCoConfig()).allreduce.codec, NoneCodec)
    with pytest.raises(OptimizerError, match="batch_size_per_step"):
        CollaborativeConfig(run_id="face", target_batch_size=8, batch_size_per_step=-4)


def test_a_diloco_state_dict_keeps_the_outer_optimizer_and_anchor(dht: BlockingDHT) -> None:
    model = _model()
    config = _config(diloco=DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9))
    with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, config) as opt:
        _train(opt, model, _data(5), local_steps=4)
        assert opt.epoch == 2
        state = opt.state_dict()
        assert set(state) >= {"outer", "anchor"} and len(state["anchor"]) == 2
        opt.driver.diloco.anchor[0].add_(1.0)
        opt.load_state_dict(state)
        assert torch.equal(opt.driver.diloco.anchor[0], state["anchor"][0])
        with pytest.raises(OptimizerError, match="anchor does not fit"):
            opt.load_state_dict({**state, "anchor": [torch.zeros(7)] * 2})


def _run_lone(dht: BlockingDHT, diloco: bool) -> list[torch.Tensor]:
    model = _model()
    config = _config(diloco=DiLoCoConfig(inner_steps=2)) if diloco else _config()
    with CollaborativeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dht, config) as opt:
        _train(opt, model, _data(6), local_steps=8)
        assert opt.epoch == 4
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("diloco", [False, True], ids=["gradients", "diloco"])
def test_the_device_path_accumulates_apart_and_copies_once_per_global_step(
    dht: BlockingDHT, monkeypatch: pytest.MonkeyPatch, diloco: bool
) -> None:
    """Parameters on a GPU accumulate on their device and cross to the host buffers once
    per global step. That path runs here on CPU tensors (an accumulator apart from each
    host buffer, as a CUDA parameter gets): the same parameters, bit for bit."""
    from swarm.collaborative import buffers as device_buffers

    host_path = _run_lone(dht, diloco)
    copies: list[int] = []
    real_to_host = device_buffers.AveragingBuffers.to_host

    def counted(self: device_buffers.AveragingBuffers) -> None:
        assert all(a is not h for a, h in zip(self.accumulators, self.host, strict=True))
        copies.append(1)
        real_to_host(self)

    monkeypatch.setattr(device_buffers, "_separate", lambda param: True)
    monkeypatch.setattr(device_buffers.AveragingBuffers, "to_host", counted)
    with BlockingDHT() as other:
        device_path = _run_lone(other, diloco)
    assert len(copies) == 4  # once per global step, not per local step
    for a, b in zip(host_path, device_path, strict=True):
        assert torch.equal(a, b)


def test_averaging_buffers_cast_gradients_to_each_parameters_dtype() -> None:
    from swarm.collaborative.buffers import AveragingBuffers

    params = [nn.Parameter(torch.ones(3, dtype=torch.float64)), nn.Parameter(torch.ones(2))]
    buffers = AveragingBuffers(params)
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    buffers.add_gradients(params, 3.0)
    buffers.to_host()
    assert [h.dtype for h in buffers.host] == [torch.float32, torch.float32]
    buffers.divide_host(2.0)
    buffers.host_as_gradients(params)
    assert params[0].grad is not None and params[0].grad.dtype == torch.float64
    assert torch.equal(params[0].grad, torch.full((3,), 3.0, dtype=torch.float64))
    buffers.zero()  # the gradients are copies, not the buffers
    assert params[1].grad is not None and torch.equal(params[1].grad, torch.full((2,), 3.0))
