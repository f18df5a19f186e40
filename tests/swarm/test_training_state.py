"""A trainer's state as peers share it: parameters, optimizer state and counters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.errors import SwarmError
from swarm.training_state import pack_state, unpack_state


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
