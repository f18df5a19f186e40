"""Built-in modules a server can host by name (``swarm serve --module ffn``).

``ffn`` is hivemind's "ffn" expert, layer for layer (``hivemind.moe.server.layers.
common.FeedforwardBlock``): Linear(h, 4h), tanh-approximated GELU, Linear(4h, h), then
LayerNorm of the residual sum; so benchmarks compare the same computation. Other
modules come from a factory named ``package.module:function`` that takes the hidden
size and returns ``(module, input_specs)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from swarm.experts.schema import TensorSpec
from swarm.named import find_named

ModuleFactory = Callable[[int], tuple[nn.Module, list[TensorSpec]]]


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016, section 2), as hivemind has it."""
    out: torch.Tensor = 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))
    return out


class FeedforwardBlock(nn.Module):
    """A transformer's feed-forward block with its residual and LayerNorm."""

    def __init__(self, hidden_dim: int) -> None:
        super().__init__()
        self.ffn = nn.Linear(hidden_dim, 4 * hidden_dim)
        self.ffn_output = nn.Linear(4 * hidden_dim, hidden_dim)
        self.layer_norm = nn.LayerNorm(hidden_dim, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer_norm(x + self.ffn_output(gelu_fast(self.ffn(x))))
        return out


def ffn(hidden_dim: int) -> tuple[nn.Module, list[TensorSpec]]:
    return FeedforwardBlock(hidden_dim), [TensorSpec(shape=[hidden_dim], dtype="float32")]


def linear(hidden_dim: int) -> tuple[nn.Module, list[TensorSpec]]:
    """A single Linear(h, h): the smallest expert, for tests and demos."""
    return nn.Linear(hidden_dim, hidden_dim), [TensorSpec(shape=[hidden_dim], dtype="float32")]


BUILTIN: dict[str, ModuleFactory] = {"ffn": ffn, "linear": linear}


def module_factory(name: str) -> ModuleFactory:
    """A built-in name, or ``package.module:function`` (:func:`swarm.named.find_named`).
    ValueError if it cannot be found or is not callable."""
    factory = find_named(name, BUILTIN, "module factory")
    if not callable(factory):
        raise ValueError(f"{name!r} is not callable")
    result: ModuleFactory = factory
    return result
