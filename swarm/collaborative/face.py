"""The face a :class:`~swarm.collaborative.optimizer.CollaborativeOptimizer` shows a training
loop: a ``torch.optim.Optimizer``.

Code written for torch optimizers (``zero_grad``, ``param_groups``, ``state_dict`` and
``load_state_dict``, learning-rate schedulers) works on a collaborative optimizer:

- ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects,
  so a scheduler built on the collaborative optimizer changes the rates the wrapped
  optimizer steps with;
- a scheduler made by the ``scheduler=`` factory steps once per global step (an epoch:
  the swarm's optimizer step, or DiLoCo's outer step), and is moved to the swarm's epoch
  when this peer loads the swarm's state, so every peer steps with the same rate;
- ``state_dict`` holds the wrapped optimizer's state, the epoch, DiLoCo's outer
  optimizer and anchor, and the scheduler's state; like a torch optimizer's, it holds
  no parameters (save the model's ``state_dict`` beside it). Samples of an epoch in
  progress are not in it: a restored peer starts that epoch afresh.

Parameter groups are fixed at construction (``add_param_group`` is refused): the
averaging buffers are sized for them once.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from swarm.collaborative.config import OptimizerError

#: The ``state_dict`` format this module writes and reads.
STATE_FORMAT = 1


class Scheduler(Protocol):
    """What we need of a learning-rate scheduler (every ``torch.optim.lr_scheduler``)."""

    last_epoch: int

    def step(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


SchedulerFactory = Callable[[torch.optim.Optimizer], Scheduler]
"""Builds a scheduler for the wrapped optimizer, e.g.
``lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)``."""


class TorchOptimizerFace(torch.optim.Optimizer):
    """The torch-optimizer surface of :class:`~swarm.collaborative.optimizer.CollaborativeOptimizer`
    (see the module docstring). ``torch.optim.Optimizer.__init__`` is not called: the
    parameter groups and state are the wrapped optimizer's, not copies."""

    optimizer: torch.optim.Optimizer
    """The wrapped optimizer: it takes every step."""
    params: list[torch.Tensor]
    epoch: int

    def _init_face(self, scheduler: SchedulerFactory | None) -> None:
        for name in (  # what torch.optim.Optimizer.__init__ sets for its hooks
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._scheduler_factory = scheduler
        self.scheduler: Scheduler | None = None
        """The scheduler ``scheduler=`` made; it steps once per global step."""
        if scheduler is not None:
            if not callable(scheduler):
                raise OptimizerError("scheduler must be a function of the wrapped optimizer")
            self.scheduler = scheduler(self.optimizer)
            self._check_scheduler(self.scheduler)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise OptimizerError(
            "a collaborative optimizer's parameters are fixed when it is made: give every "
            "parameter group to the wrapped optimizer first"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients, as a torch optimizer does. (``step`` consumes
        them already: they are in the swarm's accumulator once it returns.)"""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's whole state (no parameters; see the module docstring)."""
        return {
            "format": STATE_FORMAT,
            "epoch": self.epoch,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            **self._extra_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Raises :class:`OptimizerError` if it
        is not one (or was saved with or without a scheduler this one lacks or has),
        before anything changes; what the wrapped optimizer raises for state that does
        not fit its parameters passes through."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != STATE_FORMAT:
            raise OptimizerError("not a collaborative optimizer's state_dict (format 1)")
        epoch = state_dict.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise OptimizerError(f"state_dict epoch must be an int >= 0, got {epoch!r}")
        saved = state_dict.get("scheduler")
        if (saved is None) != (self.scheduler is None):
            has = "has" if self.scheduler is not None else "has no"
            raise OptimizerError(f"this optimizer {has} scheduler; the state_dict's differs")
        self._check_extra_state(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._load_extra_state(state_dict)
        if self.scheduler is not None and saved is not None:
            self.scheduler.load_state_dict(saved)
        self.epoch = epoch
        self._follow_epoch()
        self._restarted()

    # --- for the subclass -------------------------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _check_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        """Raise :class:`OptimizerError` if ``state_dict``'s extra state does not fit."""

    def _load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        pass

    def _restarted(self) -> None:
        """The epoch was set from outside (a state_dict): start it afresh."""

    def _follow_epoch(self) -> None:
        """Bring the scheduler to ``epoch`` global steps: forward by stepping it, back by
        making it anew from the groups' initial rates and stepping it from there."""
        scheduler = self.scheduler
        if scheduler is None or scheduler.last_epoch == self.epoch:
            return
        if scheduler.last_epoch > self.epoch:
            assert self._scheduler_factory is not None
            for group in self.optimizer.param_groups:
                if "initial_lr" in group:
                    group["lr"] = group["initial_lr"]
            scheduler = self.scheduler = self._scheduler_factory(self.optimizer)
            self._check_scheduler(scheduler)
        with warnings.catch_warnings():
            # torch warns of a scheduler stepped before its optimizer: here the epochs
            # were stepped elsewhere (the state we loaded), as they should have been.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step")
            for _ in range(self.epoch - scheduler.last_epoch):
                scheduler.step()

    @staticmethod
    def _check_scheduler(scheduler: object) -> None:
        if not all(hasattr(scheduler, a) for a in ("step", "state_dict", "last_epoch")):
            raise OptimizerError(
                "scheduler must return a learning-rate scheduler (step, state_dict, "
                f"last_epoch), got {type(scheduler).__name__}"
            )
        if scheduler.last_epoch != 0:  # type: ignore[attr-defined]
            raise OptimizerError("scheduler must return a new scheduler (last_epoch 0)")
