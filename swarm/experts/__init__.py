"""Remote experts: host torch modules on servers, call them as modules with autograd.

- :class:`ExpertServer` hosts :class:`ModuleBackend` s under uids (``ffn.3.7``,
  ``stage.2``), batches requests, runs forward and backward, steps their optimizers,
  checks every request first, and announces the modules in the DHT.
- :class:`RemoteExpert` is a torch module whose forward and backward run on a server.
- :class:`RemoteMixtureOfExperts` scores an expert grid with a gate, finds the top-k
  live experts by beam search through the DHT, calls each chosen expert once for all
  its samples, and skips experts that fail or are slow.
- :func:`call_forward`, :func:`call_backward`, :func:`call_info`: the async core;
  :class:`BlockingExpertServer` hosts modules from a plain script.
"""

from swarm.experts.announce import (
    Announcement,
    ExpertLocation,
    declare_experts,
    find_experts,
)
from swarm.experts.backend import BackendStatistics, ModuleBackend
from swarm.experts.batching import Batch, Batcher
from swarm.experts.blocking import BlockingExpertServer
from swarm.experts.calls import ExpertCallConfig, call_backward, call_forward, call_info
from swarm.experts.errors import (
    BadExpertRequest,
    ExpertError,
    ExpertInputError,
    ExpertProtocolError,
    NotEnoughExperts,
    ServerBusy,
    TrainingNotAllowed,
)
from swarm.experts.layers import FeedforwardBlock, module_factory
from swarm.experts.moe import MoEConfig, MoEStatistics, RemoteMixtureOfExperts
from swarm.experts.remote import RemoteExpert, get_remote_experts
from swarm.experts.schema import ExpertInfo, TensorSpec
from swarm.experts.server import ExpertServer, ServerStatistics
from swarm.experts.server_config import ServerConfig

__all__ = [
    "Announcement",
    "BackendStatistics",
    "BadExpertRequest",
    "Batch",
    "Batcher",
    "BlockingExpertServer",
    "ExpertCallConfig",
    "ExpertError",
    "ExpertInfo",
    "ExpertInputError",
    "ExpertLocation",
    "ExpertProtocolError",
    "ExpertServer",
    "FeedforwardBlock",
    "MoEConfig",
    "MoEStatistics",
    "ModuleBackend",
    "NotEnoughExperts",
    "RemoteExpert",
    "RemoteMixtureOfExperts",
    "ServerBusy",
    "ServerConfig",
    "ServerStatistics",
    "TensorSpec",
    "TrainingNotAllowed",
    "call_backward",
    "call_forward",
    "call_info",
    "declare_experts",
    "find_experts",
    "get_remote_experts",
    "module_factory",
]
