"""DiLoCo's tensor work, by hand: the outer step on the averaged change, and with overlap
the late outer step under the local steps taken while the round ran."""

from __future__ import annotations

import torch

from swarm.collaborative.buffers import AveragingBuffers
from swarm.collaborative.config import DiLoCoConfig
from swarm.collaborative.updates import DiLoCoUpdates


def _updates(outer_lr: float = 0.5, momentum: float = 0.0) -> tuple[DiLoCoUpdates, torch.Tensor]:
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    inner = torch.optim.SGD([param], lr=0.1)
    config = DiLoCoConfig(inner_steps=2, outer_lr=outer_lr, outer_momentum=momentum)
    return DiLoCoUpdates(inner, [param], AveragingBuffers([param]), config), param


def _local_step(updates: DiLoCoUpdates, param: torch.Tensor, grad: list[float]) -> None:
    param.grad = torch.tensor(grad)
    updates.take_batch(1)


def test_the_late_outer_step_lands_under_the_steps_taken_while_the_round_ran() -> None:
    late, param = _updates()
    _local_step(late, param, [1.0, 0.0, -1.0])  # params 0.9, 2.0, 3.1
    late.build(1)  # the update: anchor - params = 0.1, 0.0, -0.1
    assert torch.allclose(late.buffers.host[0], torch.tensor([0.1, 0.0, -0.1]))
    late.launched()
    # Training goes on from the anchor moved by this peer's update standing in for the
    # average, as outer SGD at 0.5 would move it: 0.95, 2.0, 3.05.
    assert torch.allclose(param.detach(), torch.tensor([0.95, 2.0, 3.05]))
    _local_step(late, param, [0.0, 1.0, 0.0])  # meanwhile: 0.95, 1.9, 3.05
    late.buffers.host[0].copy_(torch.tensor([0.2, 0.2, 0.2]))  # the swarm's average
    param.grad = torch.tensor([7.0, 7.0, 7.0])  # a batch not stepped yet
    late.apply_late()
    # Outer SGD at 0.5 from the anchor (1, 2, 3): 0.9, 1.9, 2.9; then the step taken
    # since the launch (0, -0.1, 0) on top.
    assert torch.allclose(late.anchor[0], torch.tensor([0.9, 1.9, 2.9]))
    assert torch.allclose(param.detach(), torch.tensor([0.9, 1.8, 2.9]))
    assert param.grad is not None and param.grad.tolist() == [7.0, 7.0, 7.0]
    assert late.launch_point is None
    late.build(1)  # the next update is the local steps since the outer step's anchor
    assert torch.allclose(late.buffers.host[0], torch.tensor([0.0, 0.1, 0.0]))


def test_with_nothing_trained_meanwhile_the_late_step_is_the_plain_one() -> None:
    plain, plain_param = _updates(momentum=0.9)
    late, late_param = _updates(momentum=0.9)
    for _ in range(3):  # three outer steps, so that momentum counts
        for updates, param in ((plain, plain_param), (late, late_param)):
            _local_step(updates, param, [1.0, -2.0, 0.5])
            updates.build(1)
            updates.buffers.host[0].mul_(0.5)  # "the swarm's average"
        plain.apply()
        late.launched()
        late.apply_late()
        assert torch.equal(plain_param.detach(), late_param.detach())
        assert torch.equal(plain.anchor[0], late.anchor[0])


def test_the_provisional_start_is_the_outer_step_on_this_peers_share() -> None:
    updates, param = _updates(outer_lr=0.5, momentum=0.5)
    # Nesterov at lr 0.5, momentum 0.5 moves by 0.5 x (1.5 g + 0.25 b): this peer's 0.1
    # for g, and b the momentum of the steps before (none, then 0.1).
    for moved in (0.5 * 1.5 * 0.1, 0.5 * (1.5 * 0.1 + 0.25 * 0.1)):
        _local_step(updates, param, [1.0, 1.0, 1.0])
        updates.build(1)
        anchor = updates.anchor[0].clone()
        updates.launched()
        assert torch.allclose(param.detach(), anchor - moved)
        updates.apply_late()  # (the buffers hold this peer's 0.1: it averaged alone)


def test_a_restart_forgets_the_round_in_flight() -> None:
    updates, param = _updates()
    _local_step(updates, param, [1.0, 1.0, 1.0])
    updates.build(1)
    updates.launched()
    updates.restart()
    assert updates.launch_point is None
    assert torch.equal(updates.anchor[0], param.detach())
