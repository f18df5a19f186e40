"""A trainer's state as peers share it: parameters, optimizer state and counters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.collaborative.state import pack_state, unpack_state
from swarm.errors import SwarmError


def _adam(model: nn.Module, *, fused: bool) -> torch.optim.Adam:
    return torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)


def _trained(fused: bool) -> tuple[nn.Module, torch.optim.Adam]:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    optimizer = _adam(model, fused=fused)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 5)).square().mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("fused", [False, True])
def test_shared_state_leaves_out_the_implementation_and_the_loader_keeps_its_own(
    fused: bool,
) -> None:
    model, optimizer = _trained(fused)
    tensors, metadata = pack_state(list(model.parameters()), {"inner": optimizer}, {"step": 3})
    groups = metadata["optimizers"]["inner"]["param_groups"]
    assert groups and not any("fused" in g or "foreach" in g for g in groups)

    newcomer = nn.Linear(5, 3)
    newcomer_optimizer = _adam(newcomer, fused=not fused)
    counters = unpack_state(
        tensors, metadata, list(newcomer.parameters()), {"inner": newcomer_optimizer}
    )
    assert counters == {"step": 3}
    assert bool(newcomer_optimizer.param_groups[0]["fused"]) is not fused
    for a, b in zip(model.parameters(), newcomer.parameters(), strict=True):
        assert torch.equal(a, b)
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(newcomer_optimizer.state_dict()["state"][index][key], value)


def test_state_that_does_not_fit_is_refused_before_anything_changes() -> None:
    model, optimizer = _trained(True)
    tensors, metadata = pack_state(list(model.parameters()), {"inner": optimizer}, {})
    other = nn.Linear(5, 4)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(SwarmError, match="shape"):
        unpack_state(
            tensors, metadata, list(other.parameters()), {"inner": _adam(other, fused=True)}
        )
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), before, strict=True))


def test_a_shared_state_brings_no_hyperparameters_and_no_misshapen_moments() -> None:
    """A donor's learning rate stays the donor's; optimizer state shaped unlike its
    parameter (it would crash the next step) is refused before anything changes."""
    model, optimizer = _trained(False)
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = 1e6, 0.5
    tensors, metadata = pack_state(list(model.parameters()), {"inner": optimizer}, {"epoch": 3})
    newcomer = nn.Linear(5, 3)
    mine = _adam(newcomer, fused=False)
    counters = unpack_state(tensors, metadata, list(newcomer.parameters()), {"inner": mine})
    assert counters == {"epoch": 3}
    assert mine.param_groups[0]["lr"] == 1e-2 and mine.param_groups[0]["weight_decay"] == 0
    assert torch.equal(newcomer.weight, model.weight)

    other = nn.Linear(5, 3)
    before = [p.detach().clone() for p in other.parameters()]
    for key, bad in (
        ("optimizer/inner/0/exp_avg", torch.zeros(7)),
        ("optimizer/inner/9/exp_avg", torch.zeros(3, 5)),
        ("optimizer/other/0/exp_avg", torch.zeros(3, 5)),
        ("optimizer/inner/0/exp_avg", torch.zeros(3, 5, dtype=torch.bool)),
    ):
        with pytest.raises(SwarmError, match="does not fit"):
            unpack_state(
                {**tensors, key: bad},
                metadata,
                list(other.parameters()),
                {"inner": _adam(other, fused=False)},
            )
    broken = {**metadata, "optimizers": {"inner": {"plain": {}, "param_groups": [{}]}}}
    with pytest.raises(SwarmError, match="parameter groups"):
        unpack_state(
            tensors, broken, list(other.parameters()), {"inner": _adam(other, fused=False)}
        )
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), before, strict=True))
