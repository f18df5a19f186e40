"""A trainer's state (parameters, optimizer state, counters) as named tensors plus plain
metadata: the form peers share it in (``averaging`` state sync) and load it from.

A torch optimizer's ``state_dict`` is nested dicts of tensors and numbers; tensors go
out as ``optimizer/{param}/{name}``, everything else in the metadata (msgpack-able), so
nothing is ever unpickled
(CONTRIBUTING.md, "Wire messages are typed and decoded at the edge").
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
    """Named tensors and metadata for ``params``, the optimizers' state and ``counters``.
    The tensors are on the CPU (where peers read them): a device tensor is copied, a
    CPU one is not."""
    tensors = {f"param/{i}": p.detach().cpu() for i, p in enumerate(params)}
    metadata: dict[str, Any] = {"counters": dict(counters), "optimizers": {}}
    for name, optimizer in optimizers.items():
        state = optimizer.state_dict()
        plain: dict[str, dict[str, Any]] = {}
        for index, entries in state["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optimizer/{name}/{index}/{key}"] = value.detach().cpu()
                else:
                    plain.setdefault(str(index), {})[key] = value
        groups = portable_param_groups(state["param_groups"])
        metadata["optimizers"][name] = {"param_groups": groups, "plain": plain}
    return tensors, metadata


def state_problem(
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    metadata: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> str | None:
    """Why a state (its tensors' dtypes and shapes, and its metadata) made by
    :func:`pack_state` does not fit ``params`` and ``optimizers``, or ``None``. Checked
    on a donor's manifest before downloading (a state from a stranger), and again before
    loading: a parameter of the wrong shape or dtype, optimizer state that is neither a
    scalar nor shaped like its parameter (it would break the next ``step``), an
    unknown optimizer or parameter index, or counters and groups that are not what
    :func:`pack_state` writes."""
    for i, p in enumerate(params):
        got = tensors.get(f"param/{i}")
        if got is None:
            return f"it has no parameter {i}"
        if got != (p.dtype, tuple(p.shape)):
            return (
                f"its parameter {i} is {got[0]} of shape {list(got[1])}, "
                f"not {p.dtype} of shape {list(p.shape)}"
            )
    for name, (dtype, shape) in tensors.items():
        if name.startswith("param/"):
            continue
        parts = name.split("/")
        if len(parts) != 4 or parts[0] != "optimizer" or parts[1] not in optimizers:
            return f"it has an unexpected tensor {name!r}"
        if not parts[2].isdigit() or int(parts[2]) >= len(params):
            return f"its tensor {name!r} names no parameter"
        param = params[int(parts[2])]
        if shape and shape != tuple(param.shape):
            return f"its tensor {name!r} has shape {list(shape)}, not {list(param.shape)}"
        if not (dtype.is_floating_point or dtype in (torch.int64, torch.int32)):
            return f"its tensor {name!r} is {dtype}"
    counters = metadata.get("counters")
    if not isinstance(counters, dict) or not all(isinstance(k, str) for k in counters):
        return "its counters are not a dict"
    saved = metadata.get("optimizers")
    if not isinstance(saved, dict) or set(saved) != set(optimizers):
        return f"it has optimizer state for {sorted(saved) if isinstance(saved, dict) else saved}"
    for name, optimizer in optimizers.items():
        problem = _optimizer_problem(saved[name], optimizer, len(params))
        if problem is not None:
            return f"its optimizer {name!r}: {problem}"
    return None


def _optimizer_problem(
    info: object, optimizer: torch.optim.Optimizer, num_params: int
) -> str | None:
    if not isinstance(info, dict) or not isinstance(info.get("plain"), dict):
        return "not a packed optimizer state"
    groups = info.get("param_groups")
    own = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(own):
        return f"{len(groups) if isinstance(groups, list) else groups} parameter groups"
    for group, mine in zip(groups, own, strict=True):
        indices = group.get("params") if isinstance(group, dict) else None
        if not isinstance(indices, list) or len(indices) != len(mine["params"]):
            return "its parameter groups differ from ours"
        if not all(isinstance(i, int) and 0 <= i < num_params for i in indices):
            return "its parameter groups name no parameter"
    for index, entries in info["plain"].items():
        if not isinstance(index, str) or not index.isdigit() or int(index) >= num_params:
            return f"its state names no parameter {index!r}"
        plain = (int, float, bool, type(None))
        if not isinstance(entries, dict) or not all(isinstance(v, plain) for v in entries.values()):
            return f"its state for parameter {index} is not plain numbers"
    return None


def unpack_state(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    optimizers: Mapping[str, torch.optim.Optimizer],
) -> dict[str, Any]:
    """Load what :func:`pack_state` made into ``params`` and ``optimizers``; returns the
    counters. Raises :class:`SwarmError` if it does not fit (:func:`state_problem`),
    before anything is changed.

    Hyperparameters (learning rate, betas, weight decay, ...) stay this trainer's own:
    only the optimizers' per-parameter state (moments, step counts) is taken. A state
    from a peer must not set our learning rate, and a resumed checkpoint runs with the
    settings it is resumed with."""
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    problem = state_problem(specs, metadata, params, optimizers)
    if problem is not None:
        raise SwarmError(f"shared state does not fit this trainer: {problem}")
    states = {}
    for name, optimizer in optimizers.items():
        info = metadata["optimizers"][name]
        state: dict[int, dict[str, Any]] = {}
        for key, value in info["plain"].items():
            state.setdefault(int(key), {}).update(value)
        prefix = f"optimizer/{name}/"
        for full, tensor in tensors.items():
            if full.startswith(prefix):
                index, key = full[len(prefix) :].split("/", 1)
                state.setdefault(int(index), {})[key] = tensor
        groups = [
            {**{k: v for k, v in own.items() if k != "params"}, "params": saved["params"]}
            for own, saved in zip(optimizer.param_groups, info["param_groups"], strict=True)
        ]
        states[name] = {"state": state, "param_groups": groups}
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(tensors[f"param/{i}"])
    for name, optimizer in optimizers.items():
        try:
            load_optimizer_state(optimizer, states[name])
        except (KeyError, ValueError, RuntimeError) as e:
            raise SwarmError(f"shared optimizer state {name!r} does not fit: {e}") from e
    return dict(metadata["counters"])
