"""Faster CPU kernels for the ``nn.Linear`` layers of hosted modules.

torch computes a float32 ``nn.Linear`` on the CPU with MKL's sgemm. On AMD CPUs MKL
takes its AVX2 code path even where the CPU has AVX-512, and oneDNN, which torch also
ships, runs the same products much faster with AVX-512
(docs/benchmarks.md, "Figures behind constants"). oneDNN is reached through
``torch.ops.mkldnn._linear_pointwise``, the op torch's own compiler emits for CPU linear
layers; it takes ordinary dense tensors, so parameters, optimizers, checkpoints and
averaging see nothing different.

A server therefore computes its modules' Linear layers (forward, input gradient and
weight gradient) with oneDNN where that is faster, and with torch's kernels where it is
not: for small products oneDNN's fixed cost per call loses (the ``MIN_*`` bounds below).
``"auto"`` first times both on one product and keeps torch's kernels unless oneDNN is
clearly faster (:data:`AUTO_MIN_SPEEDUP`), so a CPU where MKL is at its best (Intel's)
keeps them. The results are float32 products, as before, summed in another order: they
agree with torch's to float32 rounding, not bit for bit.

Rejected: ``torch.backends.mkldnn.matmul.fp32_precision`` (routes float32 products to
oneDNN only at reduced precision, bf16 or tf32) and ``torch.compile`` (a compile per
batch shape on the request path, seconds each).
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Literal

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable

LinearKernels = Literal["auto", "torch", "onednn"]
LINEAR_KERNELS: tuple[LinearKernels, ...] = ("auto", "torch", "onednn")

#: Below this many multiply-adds (rows x in x out) a product keeps torch's kernel:
#: there oneDNN's fixed cost per call makes it slower than MKL
#: (docs/benchmarks.md, "Figures behind constants").
MIN_MACS = 1 << 21
#: Fewest rows for which each product goes to oneDNN: the forward is faster on it at
#: any row count; both gradients of a single row (matrix-vector and outer products) are
#: faster without it. A single row's weight gradient is an outer product, which a
#: broadcast multiply writes faster than MKL's one-deep matrix product, with the same
#: values: each element is one product, nothing is summed
#: (docs/benchmarks.md, "Figures behind constants").
MIN_ROWS_FORWARD = 1
MIN_ROWS_GRAD_INPUT = 2
MIN_ROWS_GRAD_WEIGHT = 2
#: ``"auto"`` uses oneDNN only if it runs the probe product this much faster: a margin
#: over timing noise, far below its gain where it helps
#: (docs/benchmarks.md, "Figures behind constants").
AUTO_MIN_SPEEDUP = 1.25
#: The probe: a (rows, in) x (in, out) product, timed this many times each way.
PROBE_SHAPE = (128, 1024, 1024)
PROBE_REPEATS = 5


def _onednn_op() -> Any | None:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    return getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def _onednn_mm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``a @ weight.T + bias`` by oneDNN; strided views are read in place."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(a, weight, bias, "none", [], "")
    return out


class _Linear(torch.autograd.Function):
    """``F.linear`` on 2-D float32 CPU tensors, every product by oneDNN where faster."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # only what the wanted gradients need: x for the weight's, the weight for x's
        ctx.save_for_backward(
            x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None
        )
        ctx.has_bias = bias is not None
        return _onednn_mm(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        rows = grad.shape[0]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            if rows >= MIN_ROWS_GRAD_INPUT:
                grad_x = _onednn_mm(grad, weight.t(), None)
            else:
                grad_x = grad @ weight
        if ctx.needs_input_grad[1]:
            if rows >= MIN_ROWS_GRAD_WEIGHT:
                grad_weight = _onednn_mm(grad.t(), x.t(), None)
            elif rows == 1:
                grad_weight = grad.t() * x  # the outer product
            else:
                grad_weight = grad.t() @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


#: torch's query for the innermost active ``torch.func`` transform (None outside any),
#: looked up once: :func:`linear` asks it on every call.
_MAYBE_FUNCTORCH_LEVEL = getattr(torch._C._functorch, "maybe_current_level", None)


def _functorch_level() -> int | None:
    """The innermost active ``torch.func`` transform's level, None outside any."""
    return None if _MAYBE_FUNCTORCH_LEVEL is None else _MAYBE_FUNCTORCH_LEVEL()


def _onednn_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """The rows of this call's product if it is one for oneDNN, else 0 (one for torch's
    own ``F.linear``): anything but float32 on the CPU with matching 2-D weight and
    contiguous 1-D bias; a product under the bounds; autocast (which would pick another
    dtype), forward-mode AD (whose tangents only torch's ops carry) or a ``torch.func``
    transform (which an autograd function without ``setup_context`` refuses)."""
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dim() < 2
        or weight.dim() != 2
        or x.shape[-1] != weight.shape[1]
        or (bias is not None and (bias.dim() != 1 or not bias.is_contiguous()))
        or torch.is_autocast_enabled("cpu")
        or getattr(forward_ad, "_current_level", -1) >= 0
        or _functorch_level() is not None
    ):
        return 0
    rows = x.numel() // x.shape[-1] if x.shape[-1] > 0 else 0
    if rows < MIN_ROWS_FORWARD or rows * weight.shape[0] * weight.shape[1] < MIN_MACS:
        return 0
    return rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear``, with oneDNN's products where they are faster:
    float32 on the CPU, at least :data:`MIN_MACS` multiply-adds. Differentiable once (a
    second derivative through it raises)."""
    rows = _onednn_rows(x, weight, bias)
    if not rows:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        # even at one row, where neither gradient goes to oneDNN: the forward's gain and
        # the outer product's outweigh the autograd function's own cost
        # (docs/benchmarks.md, "Figures behind constants")
        out: torch.Tensor = _Linear.apply(flat, weight, bias)  # type: ignore[no-untyped-call]
    else:  # nothing to differentiate: no autograd function to go through
        out = _onednn_mm(flat, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` computed by :func:`linear`. Same parameters, state dict and
    hooks as the layer it was: :func:`use_linear_kernels` only changes its class. Tools
    that look for ``nn.Linear`` by exact class (``torch.ao`` quantization,
    ``torch.fx`` leaf tracing) see it as a module of its own; ``use_linear_kernels(m,
    "torch")`` turns it back."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


@functools.cache
def onednn_is_faster() -> bool:
    """Whether oneDNN runs :data:`PROBE_SHAPE`'s product at least
    :data:`AUTO_MIN_SPEEDUP` times faster than torch's kernel, here, on torch's
    current threads, and agrees with it; timed once per process (about 40 ms)."""
    if _onednn_op() is None:
        return False
    rows, n_in, n_out = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=generator)
    weight = torch.randn(n_out, n_in, generator=generator) / n_in**0.5
    try:
        ours = _onednn_mm(x, weight, None)
    except RuntimeError:  # built without it after all
        return False
    if not torch.allclose(ours, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4):
        return False
    theirs_seconds, ours_seconds = [], []
    for _ in range(PROBE_REPEATS):  # interleaved, so a passing load hits both
        start = time.perf_counter()
        torch.nn.functional.linear(x, weight)
        middle = time.perf_counter()
        _onednn_mm(x, weight, None)
        theirs_seconds.append(middle - start)
        ours_seconds.append(time.perf_counter() - middle)
    return statistics.median(theirs_seconds) >= AUTO_MIN_SPEEDUP * statistics.median(ours_seconds)


def check_linear_kernels(kernels: str) -> None:
    """ValueError for an unknown ``kernels``, or ``"onednn"`` where this torch has none."""
    if kernels not in LINEAR_KERNELS:
        raise ValueError(f"linear kernels must be one of {LINEAR_KERNELS}, got {kernels!r}")
    if kernels == "onednn" and _onednn_op() is None:
        raise ValueError("linear kernels 'onednn': this torch was built without oneDNN")


def use_linear_kernels(module: nn.Module, kernels: LinearKernels) -> bool:
    """Make ``module``'s ``nn.Linear`` layers (exactly that class, not subclasses, which
    may compute otherwise) compute with oneDNN if ``kernels`` says so: ``"onednn"``
    always, ``"auto"`` if :func:`onednn_is_faster`, ``"torch"`` never (layers switched
    before are switched back). The module is changed in place, for good. Returns
    whether oneDNN is used. ValueError as :func:`check_linear_kernels`."""
    check_linear_kernels(kernels)
    use = kernels == "onednn" or (kernels == "auto" and onednn_is_faster())
    source, target = (nn.Linear, OneDNNLinear) if use else (OneDNNLinear, nn.Linear)
    for layer in module.modules():
        if type(layer) is source:
            layer.__class__ = target
    return use
