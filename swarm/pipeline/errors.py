"""Errors of pipelines, by whose fault
(CONTRIBUTING.md, "Errors say whose fault it is").

A failed server is not an error for the caller: its micro-batch goes to another server
of the stage. The caller sees :class:`StageUnavailable` when a stage has no live server
left (the swarm's state, not any one server's fault), and :class:`StageFailed` when
every attempt of one stage call failed (the message names the servers and the last
error; if every server refused our request as bad, the model's stages do not fit
together, which is the caller's configuration).
"""

from __future__ import annotations

from swarm.errors import SwarmError


class PipelineError(SwarmError):
    """Base class of the errors raised by ``swarm.pipeline``."""


class StageUnavailable(PipelineError):
    """No live server of a stage could be found in the allowed time."""

    def __init__(self, message: str, stage: int) -> None:
        super().__init__(message)
        self.stage = stage


class StageFailed(PipelineError):
    """Every attempt of a stage call failed; ``stage`` says which."""

    def __init__(self, message: str, stage: int) -> None:
        super().__init__(message)
        self.stage = stage


class StageStateError(PipelineError):
    """A stage's state downloaded from peers does not fit the stage (the donors' fault
    or a different model): the server starts from its own initialisation instead."""


class StageStepError(PipelineError):
    """A synchronous stage could not end a step (:mod:`swarm.pipeline.sync`): a server
    asked to end a step it has not reached, or its round with the stage's other servers
    found no group or was not agreed. Nothing stepped; the gradients are kept."""


class StageBehind(StageStepError):
    """A synchronous stage's server is behind its stage (it missed a step, or loaded the
    state just before one): it refuses calls and steps until it has caught up."""


class StageMiscounted(StageStepError):
    """A synchronous stage's server holds gradients of other backward passes of the
    client's than the client had answered there, or of one twice (it computed a pass the
    client had given up on): it steps nothing until told to drop them."""
