"""Collaborative training: a torch optimizer that steps with the swarm (docs/training.md).

- :mod:`~swarm.collaborative.optimizer`: :class:`CollaborativeOptimizer`, the blocking
  face of :mod:`~swarm.collaborative.driver`'s ``CollaborativeDriver`` (the same, as
  coroutines on the DHT's loop: async code, in-memory tests);
- :mod:`~swarm.collaborative.config`: :class:`CollaborativeConfig`, :class:`DiLoCoConfig`,
  :class:`OptimizerStatistics`, :class:`OptimizerError`;
- :mod:`~swarm.collaborative.machine`: when to wait, average, step or resync (pure);
- :mod:`~swarm.collaborative.updates`: what is averaged in each mode, and how it is applied;
- :mod:`~swarm.collaborative.progress`: the progress records peers publish, and their
  summary; :mod:`~swarm.collaborative.state`: the state a late joiner downloads;
- :mod:`~swarm.collaborative.face`: the ``torch.optim.Optimizer`` surface;
  :mod:`~swarm.collaborative.buffers`: host buffers for parameters on any device.

The names below load on first use, so that the torch-free modules (progress records,
read by bootstrap peers that have no torch) import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.collaborative.config import (
        CollaborativeConfig,
        DiLoCoConfig,
        OptimizerError,
        OptimizerStatistics,
    )
    from swarm.collaborative.optimizer import CollaborativeOptimizer

__all__ = [
    "CollaborativeConfig",
    "CollaborativeOptimizer",
    "DiLoCoConfig",
    "OptimizerError",
    "OptimizerStatistics",
]

_HOMES = {
    "CollaborativeOptimizer": "swarm.collaborative.optimizer",
    "CollaborativeConfig": "swarm.collaborative.config",
    "DiLoCoConfig": "swarm.collaborative.config",
    "OptimizerError": "swarm.collaborative.config",
    "OptimizerStatistics": "swarm.collaborative.config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'swarm.collaborative' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
