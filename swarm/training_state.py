"""A trainer's state (parameters, optimizer state, counters) as named tensors plus plain
metadata: the form peers share it in (``averaging`` state sync) and load it from.

A torch optimizer's ``state_dict`` is nested dicts of tensors and numbers; tensors go
out as ``optimizer/{param}/{name}``, everything else in the metadata (msgpack-able), so
nothing is ever unpickled (STYLE.md 8).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarm.errors import SwarmError
from swarm.optim_spec import load_optimizer_state, portable_param_groups


def pack_state(
    params: Sequence[torch.Tensor],
    optimizers: Mapping[str, torch.optim.Optimizer],
    counters: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Named tensors and metadata for ``params``, the optimizers' state and ``counters``."""
    tensors = {f"param/{i}": p.detach() for i, p in enumerate(params)}
    metadata: dict[str, Any] = {"counters": dict(counters), "optimizers": {}}
    for name, optimizer in optimizers.items():
        state = optimizer.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for index, entries in state["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{name}/{index}/{key}"] = value.detach()
                else:
                    plain.setdefault(str(index), {})[key] = value
        groups = portable_param_groups(state["param_groups"])
        metadata["optimizers"][name] = {"param_groups": groups, "plain": plain}
    return tensors, metadata


def unpack_state(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """Load what :func:`pack_state` made into ``params`` and ``optimizers``; returns the
    counters. Raises :class:`SwarmError` if it does not fit (parameters are checked before
    anything is changed)."""
    try:
        loaded = [tensors[f"param/{i}"] for i in range(len(params))]
        states = {}
        for name in optimizers:
            info = metadata["optimizers"][name]
            state: dict[int, dict[str, Any]] = {}
            for key, value in info["plain"].items():
                state.setdefault(int(key), {}).update(value)
            prefix = f"optimizer/{name}/"
            for full, tensor in tensors.items():
                if full.startswith(prefix):
                    index, key = full[len(prefix) :].split("/", 1)
                    state.setdefault(int(index), {})[key] = tensor
            states[name] = {"state": state, "param_groups": info["param_groups"]}
        counters = dict(metadata["counters"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SwarmError(f"shared state does not fit this trainer: {e!r}") from e
    for p, t in zip(params, loaded, strict=True):
        if p.shape != t.shape:
            raise SwarmError(f"shared parameter of shape {tuple(t.shape)} for {tuple(p.shape)}")
    with torch.no_grad():
        for p, t in zip(params, loaded, strict=True):
            p.copy_(t)
    for name, optimizer in optimizers.items():
        try:
            load_optimizer_state(optimizer, states[name])
        except (KeyError, ValueError, RuntimeError) as e:
            raise SwarmError(f"shared optimizer state {name!r} does not fit: {e}") from e
    return counters
