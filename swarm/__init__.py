"""swarm: collaborative training, remote experts, the ``swarm`` command, monitoring.

- :mod:`swarm.collaborative`: ``CollaborativeOptimizer`` (gradient averaging to a
  global batch, or DiLoCo); :mod:`swarm.trainer` runs one peer on a built-in task
  (:mod:`swarm.tasks`), :mod:`swarm.demo` a whole local swarm.
- :mod:`swarm.experts`: expert servers, ``RemoteExpert``, ``RemoteMixtureOfExperts``;
  :mod:`swarm.pipeline`: SWARM pipelines (``RemoteSequential``).
- :mod:`swarm.cli`: the ``swarm`` command; :mod:`swarm.checkpoint`: safe checkpoints.
- Monitoring: :mod:`swarm.metrics` (Prometheus metrics of a peer), :mod:`swarm.status`
  and :mod:`swarm.status_view` (each peer's signed status record, and the swarm's view
  of them: ``swarm status``), :mod:`swarm.dashboard` (``swarm dashboard``).

Importing ``swarm`` stays light (no torch): torch-heavy modules are imported by name.
"""

__all__: list[str] = []
