"""Pipelines of interchangeable servers (SWARM parallelism, Ryabinin et al. 2023).

A model is cut into stages (:class:`PipelineModel`, e.g. :class:`MLPStages`); each stage
is served by one or more :class:`StageServer` s, as the expert ``stage.{i}``.

- :class:`RemoteSequential` (blocking) and :class:`PipelineClient` (async) send each
  micro-batch through the stages, picking a server per stage by measured throughput and
  queue (:class:`Wiring`, stochastic wiring); a failed server is banned for a while and
  its micro-batch retried on another; activations and gradients may travel compressed
  (``PipelineConfig.calls.codec``).
- Replicas of a stage average their parameters periodically (:class:`StageReplica`,
  through ``averaging.Averager``) and share their state; a server joining a stage
  downloads it from them. Or, synchronous (``synchronous=True`` on servers and client),
  a stage's servers sum their gradients and step together once per global batch
  (:class:`SyncStage`): the pipeline trains like one process.
- A server started without a stage takes the most under-served one, and may move
  there later (:func:`stage_to_join`, :func:`stage_to_move`);
  :class:`BlockingStageServer` hosts one from a plain script.
"""

from swarm.pipeline.blocking import BlockingStageServer
from swarm.pipeline.client import (
    PipelineClient,
    PipelineConfig,
    PipelineStatistics,
    StageCall,
    Trace,
)
from swarm.pipeline.errors import (
    PipelineError,
    StageBehind,
    StageFailed,
    StageMiscounted,
    StageStateError,
    StageStepError,
    StageUnavailable,
)
from swarm.pipeline.models import BUILTIN_MODELS, pipeline_model
from swarm.pipeline.rebalance import StageLoad, pressures, stage_to_join, stage_to_move
from swarm.pipeline.remote import RemoteSequential
from swarm.pipeline.replicas import ReplicaConfig, ReplicaStatistics, StageReplica
from swarm.pipeline.server import StageServer, StageServerConfig, StageServerStatistics
from swarm.pipeline.stages import DIGITS_STAGES, MLPStages, PipelineModel
from swarm.pipeline.sync import SyncConfig, SyncStage
from swarm.pipeline.transformer import CHARLM_STAGES, CharLMStages
from swarm.pipeline.wiring import ServerRecord, Wiring, WiringConfig

__all__ = [
    "BUILTIN_MODELS",
    "CHARLM_STAGES",
    "DIGITS_STAGES",
    "BlockingStageServer",
    "CharLMStages",
    "MLPStages",
    "PipelineClient",
    "PipelineConfig",
    "PipelineError",
    "PipelineModel",
    "PipelineStatistics",
    "RemoteSequential",
    "ReplicaConfig",
    "ReplicaStatistics",
    "ServerRecord",
    "StageBehind",
    "StageCall",
    "StageFailed",
    "StageLoad",
    "StageMiscounted",
    "StageReplica",
    "StageServer",
    "StageServerConfig",
    "StageServerStatistics",
    "StageStateError",
    "StageStepError",
    "StageUnavailable",
    "SyncConfig",
    "SyncStage",
    "Trace",
    "Wiring",
    "WiringConfig",
    "pipeline_model",
    "pressures",
    "stage_to_join",
    "stage_to_move",
]
