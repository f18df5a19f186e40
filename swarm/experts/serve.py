"""Hosting modules from a config: what ``swarm serve`` runs.

:class:`ServeConfig` names the uids to host, the module each runs (built in, like
``ffn``, or ``package.module:function``), its size, batch bound and optimizer.
:func:`build_backends` makes the modules; :func:`serve` hosts them on a peer and DHT
until ``stop`` is set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from peers.dht import DHT
from peers.host import Peer
from swarm.experts.backend import DEFAULT_CLIP_GRAD_NORM, ModuleBackend, check_clip_grad_norm
from swarm.experts.errors import ModuleFactoryError
from swarm.experts.layers import module_factory
from swarm.experts.schema import MAX_BATCH_SIZE, TensorSpec
from swarm.experts.server import ExpertServer
from swarm.experts.server_config import ServerConfig
from swarm.experts.uids import check_uid
from swarm.optim_spec import OptimizerSpec, default_optimizer


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Which modules a server hosts, and how it trains them."""

    uids: tuple[str, ...]
    """The uids to host, e.g. ``("ffn.0.0", "ffn.0.1")``; one module each."""
    module: str = "ffn"
    """Built-in module name (``ffn``, ``linear``) or ``package.module:function``."""
    hidden_dim: int = 1024
    """The module's width (``ffn``: 1024 -> 4096 -> 1024, as hivemind's default)."""
    max_batch_size: int = 1024
    """Most samples one batch (and one request) may hold."""
    optimizer: OptimizerSpec | None = field(default_factory=default_optimizer)
    """How each module is trained on its backward passes; ``None``: not trained."""
    clip_grad_norm: float | None = DEFAULT_CLIP_GRAD_NORM
    """Bound each caller's gradient contribution to an optimizer step, and the step's
    whole gradient, to this norm; none (``None``): do not clip, only for callers you
    trust. At the default (:data:`swarm.experts.backend.DEFAULT_CLIP_GRAD_NORM`, 1.0) an
    SGD step moves the parameters by at most ``lr``, whatever a caller sends."""
    seed: int | None = None
    """Seeds module initialisation (module i gets ``seed + i``); unset (``None``):
    random."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Batching, per-caller queue shares, who may train, announcing."""

    def __post_init__(self) -> None:
        if not self.uids:
            raise ValueError("a server needs at least one uid to host")
        for uid in self.uids:
            check_uid(uid)
        if len(set(self.uids)) != len(self.uids):
            raise ValueError("uids must be distinct")
        module_factory(self.module)  # fails early for an unknown module
        if not 1 <= self.hidden_dim <= 1 << 16:
            raise ValueError(f"hidden_dim must be in [1, 65536], got {self.hidden_dim}")
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be in [1, {MAX_BATCH_SIZE}]")
        check_clip_grad_norm(self.clip_grad_norm)


def build_backends(config: ServeConfig) -> list[ModuleBackend]:
    """One backend per uid, each a module from ``config.module``'s factory. Raises
    :class:`ModuleFactoryError` if the factory returns anything but ``(module, specs)``,
    and ValueError if the module's outputs are not batch-first."""
    factory = module_factory(config.module)
    backends = []
    for i, uid in enumerate(config.uids):
        if config.seed is not None:
            torch.manual_seed(config.seed + i)
        module, inputs = _checked(config.module, factory(config.hidden_dim))
        optimizer = (
            None if config.optimizer is None else config.optimizer.build(module.parameters())
        )
        backends.append(
            ModuleBackend(
                uid,
                module,
                inputs=inputs,
                max_batch_size=config.max_batch_size,
                optimizer=optimizer,
                clip_grad_norm=config.clip_grad_norm,
            )
        )
    return backends


def _checked(name: str, result: object) -> tuple[nn.Module, list[TensorSpec]]:
    """What factory ``name`` returned, if it is ``(module, input_specs)``; else raises
    :class:`ModuleFactoryError` naming what it returned."""
    if isinstance(result, tuple | list) and len(result) == 2:
        module, inputs = result
        if (
            isinstance(module, nn.Module)
            and isinstance(inputs, tuple | list)
            and all(isinstance(spec, TensorSpec) for spec in inputs)
        ):
            return module, list(inputs)
    shown = "None" if result is None else f"a {type(result).__name__}"
    if isinstance(result, tuple | list):
        shown += f" of ({', '.join(type(item).__name__ for item in result[:4])})"
    raise ModuleFactoryError(
        f"module factory {name!r} returned {shown}; expected a tuple (torch.nn.Module, "
        "[TensorSpec, ...]): the module and the specs of its inputs"
    )


async def serve(
    peer: Peer,
    dht: DHT | None,
    config: ServeConfig,
    stop: asyncio.Event,
    on_ready: Callable[[ExpertServer], None] | None = None,
) -> None:
    """Host ``config``'s modules on ``peer`` until ``stop`` is set; ``on_ready`` is
    called once they are announced (at once without a DHT)."""
    backends = await asyncio.to_thread(build_backends, config)
    async with ExpertServer(peer, backends, config.server, dht=dht) as server:
        if on_ready is not None:
            on_ready(server)
        await stop.wait()
