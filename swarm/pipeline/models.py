"""Pipeline models known by name (``swarm serve-stage --model charlm``), and loading the
operator's own (``package.module:attribute``)."""

from __future__ import annotations

from typing import cast

from swarm.named import find_named
from swarm.pipeline.stages import DIGITS_STAGES, MAX_STAGES, PipelineModel
from swarm.pipeline.transformer import CHARLM_STAGES

#: Pipeline models known by name (``swarm serve-stage --model digits``).
BUILTIN_MODELS: dict[str, PipelineModel] = {"digits": DIGITS_STAGES, "charlm": CHARLM_STAGES}


def pipeline_model(name: str) -> PipelineModel:
    """A built-in model name, or ``package.module:attribute`` naming a
    :class:`PipelineModel`, or a class or function of no arguments that builds one
    (imported: it is the operator's own code). ValueError, saying why, if it cannot be
    found or built, or is not a model."""
    found = find_named(name, BUILTIN_MODELS, "pipeline model")
    model = found
    if isinstance(found, type) or (callable(found) and not hasattr(found, "build_stage")):
        try:  # a class or a factory: build the model
            model = found()
        except Exception as e:  # the operator's code: say whose failure it is
            raise ValueError(f"building pipeline model {name!r} failed: {e!r}") from e
    if not all(hasattr(model, a) for a in ("num_stages", "build_stage", "build_local")):
        raise ValueError(f"{name!r} is not a pipeline model (num_stages, build_stage, build_local)")
    num_stages = getattr(model, "num_stages", None)
    if not isinstance(num_stages, int) or not 1 <= num_stages <= MAX_STAGES:
        raise ValueError(
            f"pipeline model {name!r} has num_stages={num_stages!r}, not an int in "
            f"[1, {MAX_STAGES}]"
        )
    return cast(PipelineModel, model)
