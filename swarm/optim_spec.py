"""A small, serialisable description of a torch optimizer.

The baseline trainer, the built-in tasks' recipes and the demo all name an optimizer
the same way, so the swarm and the single-process baseline it is compared with are
built from one :class:`OptimizerSpec`. A spec round-trips through a plain dict
(:meth:`OptimizerSpec.to_dict`), which is what a checkpoint's metadata stores.

Adam and AdamW are built with torch's fused implementation (``fused=True``) wherever
torch supports it for the parameters (floating point, on CPU or an accelerator): the
same update in one pass over each tensor instead of a dozen element-wise kernels,
several times faster on CPU, where the plain step was most of a small batch's time on an
expert server (docs/benchmarks.md, "Figures behind constants"). The results equal the
plain implementation's up to float rounding. Parameters it does not support get the
plain implementation. SGD keeps torch's default: its fused form gains little and does
not take sparse gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from swarm.errors import TaskError

OptimizerKind = Literal["sgd", "adam", "adamw"]
KINDS: tuple[OptimizerKind, ...] = ("sgd", "adam", "adamw")
#: Devices with fused Adam kernels in torch (checked by torch only at the first step).
FUSED_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu"})
#: Entries of a torch param group that choose how a step is computed, not what it
#: computes: they stay out of shared state, and loading keeps the loader's own.
IMPLEMENTATION_KEYS = ("fused", "foreach")


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Which torch optimizer to build, with which hyperparameters."""

    kind: OptimizerKind
    """``"sgd"`` (:class:`torch.optim.SGD`), ``"adam"`` or ``"adamw"``."""
    lr: float
    """Learning rate."""
    momentum: float = 0.0
    """SGD only: momentum factor (0 for plain SGD)."""
    nesterov: bool = False
    """SGD only: Nesterov momentum (needs ``momentum > 0``)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam/AdamW only: the paper's beta1, beta2 (Kingma & Ba 2015, Algorithm 1)."""
    eps: float = 1e-8
    """Adam/AdamW only: the paper's epsilon."""
    weight_decay: float = 0.0
    """L2 penalty (SGD, Adam) or decoupled weight decay (AdamW)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TaskError(f"optimizer kind must be one of {KINDS}, got {self.kind!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise TaskError(f"lr must be finite and positive, got {self.lr!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise TaskError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.nesterov and (self.kind != "sgd" or self.momentum == 0):
            raise TaskError("nesterov needs kind='sgd' and momentum > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise TaskError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.eps > 0:
            raise TaskError(f"eps must be positive, got {self.eps!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise TaskError(f"weight_decay must be finite and >= 0, got {self.weight_decay!r}")

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """A new optimizer over ``params`` (no state yet)."""
        if self.kind == "sgd":
            return torch.optim.SGD(
                params,
                lr=self.lr,
                momentum=self.momentum,
                nesterov=self.nesterov,
                weight_decay=self.weight_decay,
            )
        cls = torch.optim.Adam if self.kind == "adam" else torch.optim.AdamW
        params = list(params)
        options: dict[str, Any] = {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        return cls(params, fused=_fused_supported(params), **options)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (msgpack- and JSON-friendly); inverse of :meth:`from_dict`."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerSpec:
        """Rebuild a spec; raises :class:`TaskError` for unknown or invalid fields."""
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise TaskError(f"unknown optimizer fields {sorted(unknown)}")
        fields = dict(data)
        if "betas" in fields:
            fields["betas"] = tuple(fields["betas"])
        try:
            return cls(**fields)
        except TypeError as e:
            raise TaskError(f"invalid optimizer spec {dict(data)!r}: {e}") from e


def default_optimizer() -> OptimizerSpec:
    """How a hosted expert or pipeline stage trains unless told: Adam at lr 1e-3."""
    return OptimizerSpec(kind="adam", lr=1e-3)


def _fused_supported(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused Adam takes ``params``: real floating point, on one kind of
    device that has the kernels (torch itself would only fail at the first step)."""
    if not all(isinstance(p, torch.Tensor) for p in params):
        return False  # parameter groups: leave the choice to torch
    devices = {p.device.type for p in params}
    return (
        len(devices) == 1
        and devices <= FUSED_DEVICES
        and all(torch.is_floating_point(p) for p in params)
    )


def portable_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` (a ``state_dict``'s) without the entries that pick torch's
    implementation: what peers running different implementations still agree on."""
    return [{k: v for k, v in g.items() if k not in IMPLEMENTATION_KEYS} for g in groups]


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, except that ``optimizer`` keeps its own
    implementation (fused or not): torch would take the saved one's, so state saved by
    a plain Adam would silently turn a fused one plain, and fused state could turn an
    optimizer fused over parameters its kernels do not take. Raises what
    ``load_state_dict`` raises."""
    own = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(dict(state))
    for group, keys in zip(optimizer.param_groups, own, strict=True):
        group.update(keys)
