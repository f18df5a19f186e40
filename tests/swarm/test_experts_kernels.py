"""oneDNN kernels for hosted Linear layers: the same numbers and gradients as torch's,
each product on the kernel its bounds name, and a server that uses them
(CONTRIBUTING.md, "Numerics are checked as exact properties")."""

from __future__ import annotations

import copy
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import torch
from torch import nn

from peers import Peer, PeerConfig
from swarm.experts import (
    ExpertCallConfig,
    ExpertLocation,
    ExpertServer,
    ModuleBackend,
    ServerConfig,
    TensorSpec,
    call_backward,
    call_forward,
    kernels,
)
from swarm.experts.kernels import (
    LinearKernels,
    OneDNNLinear,
    linear,
    onednn_is_faster,
    use_linear_kernels,
)
from swarm.experts.layers import FeedforwardBlock

Arun = Callable[[Coroutine[Any, Any, Any]], Any]

needs_onednn = pytest.mark.skipif(
    kernels._onednn_op() is None, reason="this torch was built without oneDNN"
)

torch.set_num_threads(1)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 rounding of sums in another order (relative to the largest)."""
    scale = expected.abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, atol=2e-6 * scale, rtol=0)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 15, 16, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_torchs_below_and_above_every_bound(
    rows: int, bias: bool
) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(2048, 1024, requires_grad=True)
    b = torch.randn(2048, requires_grad=True) if bias else None
    x = torch.randn(rows, 1024, requires_grad=True)
    grad = torch.randn(rows, 2048)
    ours = linear(x, weight, b)
    torch.autograd.backward(ours, grad)
    ours_grads = [t.grad.clone() for t in (x, weight, b) if t is not None and t.grad is not None]
    for t in (x, weight, b):
        if t is not None:
            t.grad = None
    theirs = torch.nn.functional.linear(x, weight, b)
    torch.autograd.backward(theirs, grad)
    _close(ours, theirs)
    theirs_grads = [t.grad for t in (x, weight, b) if t is not None and t.grad is not None]
    assert len(ours_grads) == len(theirs_grads) == (3 if bias else 2)
    for g, h in zip(ours_grads, theirs_grads, strict=True):
        _close(g, h)


@needs_onednn
@pytest.mark.parametrize("wanted", ["weight", "bias", "input", "all"])
def test_one_row_gives_each_wanted_gradient_as_torch_does(wanted: str) -> None:
    """One row, batched as [1, 1, N]: only the wanted gradients, equal to torch's (the
    weight's, one product per element, bit for bit), laid out as the weight is."""
    torch.manual_seed(7)
    weight = torch.randn(4096, 1024, requires_grad=wanted in ("weight", "all"))
    bias = torch.randn(4096, requires_grad=wanted in ("bias", "all"))
    x = torch.randn(1, 1, 1024, requires_grad=wanted in ("input", "all"))
    grad = torch.randn(1, 1, 4096)
    leaves = [t for t in (x, weight, bias) if t.requires_grad]
    ours = torch.autograd.grad(linear(x, weight, bias), leaves, grad)
    theirs = torch.autograd.grad(torch.nn.functional.linear(x, weight, bias), leaves, grad)
    for mine, other, leaf in zip(ours, theirs, leaves, strict=True):
        assert mine.shape == leaf.shape and mine.stride() == leaf.stride()
        _close(mine, other)
    if weight.requires_grad:
        at = next(i for i, leaf in enumerate(leaves) if leaf is weight)
        assert torch.equal(ours[at], theirs[at])


@needs_onednn
def test_each_product_goes_to_onednn_exactly_where_its_bounds_say(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, ...]] = []
    real = kernels._onednn_mm

    def counting(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append((a.shape[0], w.shape[0]))
        return real(a, w, b)

    monkeypatch.setattr(kernels, "_onednn_mm", counting)
    weight = torch.randn(4096, 1024, requires_grad=True)

    def products(rows: int, in_features: int = 1024) -> list[tuple[int, ...]]:
        calls.clear()
        w = weight if in_features == 1024 else torch.randn(64, in_features, requires_grad=True)
        x = torch.randn(rows, in_features, requires_grad=True)
        torch.autograd.backward(linear(x, w, None).sum())
        return list(calls)

    assert products(1) == [(1, 4096)]  # one row to differentiate: only the forward
    assert products(2) == [(2, 4096), (2, 1024), (4096, 1024)]  # all three
    assert products(256, in_features=64) == []  # 256 x 64 x 64 < MIN_MACS
    with torch.no_grad():
        calls.clear()
        linear(torch.randn(1, 1024), weight, None)
        assert calls == [(1, 4096)]


def test_other_dtypes_and_small_products_take_torchs_path_unchanged() -> None:
    weight = torch.randn(64, 1 << 16, dtype=torch.float64)
    x = torch.randn(4, 1 << 16, dtype=torch.float64)
    assert torch.equal(linear(x, weight, None), torch.nn.functional.linear(x, weight))
    small = torch.randn(8, 8)
    assert torch.equal(linear(small, small, None), torch.nn.functional.linear(small, small))


@needs_onednn
def test_batched_inputs_keep_their_leading_dimensions() -> None:
    torch.manual_seed(1)
    weight = torch.randn(512, 1024)
    x = torch.randn(3, 5, 1024)
    out = linear(x, weight, None)
    assert out.shape == (3, 5, 512)
    _close(out, torch.nn.functional.linear(x, weight))


@needs_onednn
def test_a_second_derivative_is_refused_clearly() -> None:
    weight = torch.randn(1024, 1024, requires_grad=True)
    x = torch.randn(16, 1024, requires_grad=True)
    (grad_x,) = torch.autograd.grad(linear(x, weight, None).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        torch.autograd.backward(grad_x.sum())


class Scaled(nn.Linear):
    """A Linear subclass with its own forward, which the switch must leave alone."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(input)


@needs_onednn
def test_the_switch_keeps_parameters_state_and_optimizer_and_trains_the_same() -> None:
    torch.manual_seed(2)
    module = nn.Sequential(FeedforwardBlock(256), Scaled(256, 256))
    reference = copy.deepcopy(module)
    params = list(module.parameters())
    keys = list(module.state_dict())
    # Built before the switch. SGD with momentum, not Adam: Adam divides by the root of
    # each gradient's square, so on a coordinate whose gradient is near zero the two
    # kernels' rounding differences (1e-7) become differences of a whole step (1e-3),
    # far past any tolerance a comparison of parameters could allow.
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    assert use_linear_kernels(module, "onednn") is True
    assert [type(m) for m in module.modules()].count(OneDNNLinear) == 2
    assert type(module[1]) is Scaled
    assert list(module.parameters()) == params and list(module.state_dict()) == keys
    for _ in range(5):
        x = torch.randn(64, 256)
        for m, opt in ((module, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=1e-4)
    assert use_linear_kernels(module, "torch") is False
    assert OneDNNLinear not in {type(m) for m in module.modules()}


def test_the_switch_refuses_an_unknown_kind_and_auto_follows_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="linear kernels must be one of"):
        use_linear_kernels(module, "fast")  # type: ignore[arg-type]
    monkeypatch.setattr(kernels, "onednn_is_faster", lambda: False)
    assert use_linear_kernels(module, "auto") is False and type(module) is nn.Linear
    monkeypatch.setattr(kernels, "onednn_is_faster", lambda: True)
    assert use_linear_kernels(module, "auto") is True and type(module) is OneDNNLinear
    assert use_linear_kernels(module, "torch") is False and type(module) is nn.Linear
    assert isinstance(onednn_is_faster(), bool)  # the real probe answers, whatever it finds
    with pytest.raises(ValueError, match="linear kernels must be one of"):
        ServerConfig(linear_kernels="mkl")  # type: ignore[arg-type]
    monkeypatch.setattr(kernels, "_onednn_op", lambda: None)  # a torch without oneDNN
    with pytest.raises(ValueError, match="built without oneDNN"):
        ServerConfig(linear_kernels="onednn")
    assert use_linear_kernels(module, "torch") is False  # "torch" needs nothing


@needs_onednn
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_calls_it_cannot_take_go_to_torch_unchanged() -> None:  # (make_dual's warning)
    """A strided bias, autocast, forward-mode AD, torch.func transforms and shape errors:
    F.linear's results and errors, not oneDNN's."""
    torch.manual_seed(5)
    x, weight = torch.randn(64, 512), torch.randn(512, 512)
    strided_bias = torch.randn(1024)[::2]
    _close(linear(x, weight, strided_bias), torch.nn.functional.linear(x, weight, strided_bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, weight, None).dtype == torch.bfloat16
    import torch.autograd.forward_ad as fwad

    tangent = torch.randn_like(x)
    with fwad.dual_level():
        out = linear(fwad.make_dual(x, tangent), weight, None)
        _close(fwad.unpack_dual(out).tangent, tangent @ weight.t())
    with pytest.raises(RuntimeError):
        linear(torch.randn(64, 256), weight, None)  # 256 columns into a 512-wide layer
    vector = torch.randn(512)  # a 1-D weight, which F.linear takes (a matrix-vector product)
    _close(linear(x, vector, None), torch.nn.functional.linear(x, vector))
    for rows in (1, 64):  # torch.func transforms, which refuse our autograd function
        row = x[:rows]
        grad_weight = torch.func.grad(lambda w, r=row: linear(r, w, None).square().sum())(weight)
        _close(grad_weight, 2 * (row @ weight.t()).t() @ row)


@needs_onednn
@pytest.mark.parametrize("kind", ["onednn", "torch"])
def test_a_server_computes_with_the_kernels_its_config_names(
    arun: Arun, kind: LinearKernels
) -> None:
    torch.manual_seed(3)
    module = FeedforwardBlock(256)
    local = copy.deepcopy(module)
    spec = [TensorSpec(shape=[256], dtype="float32")]
    backend = ModuleBackend("ffn.0", module, inputs=spec, max_batch_size=64)
    x, grad = torch.randn(32, 256), torch.randn(32, 256)

    async def main() -> tuple[list[torch.Tensor], list[torch.Tensor | None], str]:
        async with (
            Peer(PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))) as server_peer,
            Peer(PeerConfig(listen_addrs=())) as client,
            ExpertServer(server_peer, [backend], ServerConfig(linear_kernels=kind)) as server,
        ):
            client.add_addresses(server_peer.peer_id, server_peer.listen_addrs)
            where = ExpertLocation(
                "ffn.0", server_peer.peer_id, tuple(str(a) for a in server_peer.listen_addrs)
            )
            config = ExpertCallConfig()
            forwarded = await call_forward(client, where, [x], config=config)
            grads = await call_backward(client, where, [x], [grad], config=config)
            return forwarded.outputs, grads, server.statistics().linear_kernels

    outputs, grads, used = arun(main())
    assert used == kind
    assert (type(module.ffn) is OneDNNLinear) == (kind == "onednn")
    leaf = x.clone().requires_grad_()
    expected = local(leaf)
    torch.autograd.backward(expected, grad)
    assert leaf.grad is not None and grads[0] is not None
    _close(outputs[0], expected)
    _close(grads[0], leaf.grad)
