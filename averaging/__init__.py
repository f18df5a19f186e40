"""averaging: compression, butterfly all-reduce, gossip, matchmaking, state sync.

- :mod:`averaging.compression`: seven codecs behind one interface.
- :mod:`averaging.matchmaking`: groups through the DHT, no coordinator.
- :mod:`averaging.butterfly`: one all-reduce round as a pure state machine (records in
  :mod:`averaging.butterfly_records`, a part's reduction in :mod:`averaging.reduction`,
  CenteredClip in :mod:`averaging.robust`); :mod:`averaging.allreduce` runs it over real
  streams, :mod:`averaging.allreduce_service` routes links to rounds.
- :mod:`averaging.averager`: named tensors averaged with peers on request
  (:class:`BlockingAverager` for plain scripts); :mod:`averaging.gossip`: Moshpit and
  random groups.
- :mod:`averaging.state_sync`: newcomers download state from several donors.

Layering: imports ``peers`` (and torch), never ``swarm``.
"""

from averaging.allreduce import RoundRunner
from averaging.allreduce_config import (
    AllReduceConfig,
    AllReduceError,
    AllReduceResult,
    TransferStatistics,
)
from averaging.allreduce_service import AllReduceService
from averaging.averager import Averager, AveragerConfig, AveragerError, AveragingStep
from averaging.blocking import BlockingAverager
from averaging.butterfly import DEFERRED_PARTS, MAX_SAMPLE_WEIGHT, ButterflyRound
from averaging.butterfly_records import (
    MAX_ROUND_ID_BYTES,
    REDUCERS_PER_PART,
    AveragedPart,
    ChunkDeferred,
    Outgoing,
    OutgoingAveraged,
    PartAbandoned,
    PartReady,
    PartReassigned,
    PartReport,
    PeerExcluded,
    RejectedChunk,
    RejectReason,
    RoundError,
    RoundEvent,
    RoundReport,
    RoundResult,
    RoundSpec,
    RoundStatistics,
    Withdrawn,
    plan_reassignment,
)
from averaging.compression import (
    DECODERS,
    MAX_DECODED_ELEMENTS,
    MAX_ENCODED_MAGNITUDE,
    MIN_COMPRESSED_ELEMENTS,
    MIN_QUANTIZED_ELEMENTS,
    ROLES,
    BFloat16Codec,
    Blockwise8BitCodec,
    Codec,
    CompressionError,
    EncodedTensor,
    EncodeError,
    ErrorFeedback,
    ErrorFeedbackConfig,
    ErrorFeedbackStatistics,
    Float16Codec,
    NoneCodec,
    PowerSGDCodec,
    PowerSGDConfig,
    PowerSGDStatistics,
    Role,
    TopKCodec,
    Uniform8BitCodec,
    choose_codec,
    decode_tensor,
)
from averaging.gossip import (
    GossipRound,
    GossipSchedule,
    MoshpitConfig,
    MoshpitGrid,
    RandomGroups,
    gossip,
    gossip_round,
)
from averaging.matchmaking import Matchmaker, MatchmakingStatistics
from averaging.matchmaking_records import (
    MAX_GROUP_SIZE,
    MAX_METADATA_BYTES,
    Group,
    MatchmakingConfig,
    MatchmakingError,
)
from averaging.partition import PartitionError, chunk_ranges, flatten, split_parts, unflatten
from averaging.reduction import PartReceipt, PartReduction
from averaging.replicated import Folded, fold, replicate
from averaging.robust import (
    CenteredClipConfig,
    CenteredClipReduction,
    centered_clip,
    spread_radius,
)
from averaging.state_donor import StateServer, StateServerConfig, StateServerStatistics, state_key
from averaging.state_manifest import (
    DonorError,
    Manifest,
    StateRequestError,
    StateSyncError,
    StateSyncTimeout,
)
from averaging.state_records import DonorReport, LoadedState, StateSyncConfig, SyncReport
from averaging.state_sync import load_state_from_peers

__all__ = [
    "DECODERS",
    "DEFERRED_PARTS",
    "MAX_DECODED_ELEMENTS",
    "MAX_ENCODED_MAGNITUDE",
    "MAX_GROUP_SIZE",
    "MAX_METADATA_BYTES",
    "MAX_ROUND_ID_BYTES",
    "MAX_SAMPLE_WEIGHT",
    "MIN_COMPRESSED_ELEMENTS",
    "MIN_QUANTIZED_ELEMENTS",
    "REDUCERS_PER_PART",
    "ROLES",
    "AllReduceConfig",
    "AllReduceError",
    "AllReduceResult",
    "AllReduceService",
    "AveragedPart",
    "Averager",
    "AveragerConfig",
    "AveragerError",
    "AveragingStep",
    "BFloat16Codec",
    "BlockingAverager",
    "Blockwise8BitCodec",
    "ButterflyRound",
    "CenteredClipConfig",
    "CenteredClipReduction",
    "ChunkDeferred",
    "Codec",
    "CompressionError",
    "DonorError",
    "DonorReport",
    "EncodeError",
    "EncodedTensor",
    "ErrorFeedback",
    "ErrorFeedbackConfig",
    "ErrorFeedbackStatistics",
    "Float16Codec",
    "Folded",
    "GossipRound",
    "GossipSchedule",
    "Group",
    "LoadedState",
    "Manifest",
    "Matchmaker",
    "MatchmakingConfig",
    "MatchmakingError",
    "MatchmakingStatistics",
    "MoshpitConfig",
    "MoshpitGrid",
    "NoneCodec",
    "Outgoing",
    "OutgoingAveraged",
    "PartAbandoned",
    "PartReady",
    "PartReassigned",
    "PartReceipt",
    "PartReduction",
    "PartReport",
    "PartitionError",
    "PeerExcluded",
    "PowerSGDCodec",
    "PowerSGDConfig",
    "PowerSGDStatistics",
    "RandomGroups",
    "RejectReason",
    "RejectedChunk",
    "Role",
    "RoundError",
    "RoundEvent",
    "RoundReport",
    "RoundResult",
    "RoundRunner",
    "RoundSpec",
    "RoundStatistics",
    "StateRequestError",
    "StateServer",
    "StateServerConfig",
    "StateServerStatistics",
    "StateSyncConfig",
    "StateSyncError",
    "StateSyncTimeout",
    "SyncReport",
    "TopKCodec",
    "TransferStatistics",
    "Uniform8BitCodec",
    "Withdrawn",
    "centered_clip",
    "choose_codec",
    "chunk_ranges",
    "decode_tensor",
    "flatten",
    "fold",
    "gossip",
    "gossip_round",
    "load_state_from_peers",
    "plan_reassignment",
    "replicate",
    "split_parts",
    "spread_radius",
    "state_key",
    "unflatten",
]
