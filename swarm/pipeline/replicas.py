"""Replicas of a stage stay close, and newcomers start from them.

Each server of a stage trains its own copy on the micro-batches it gets. Every
``interval_seconds`` (aligned on the shared wall clock: the round key is the interval's
index, so replicas meet without talking first) a replica averages with the stage's
other replicas through :class:`averaging.Averager`, under the prefix
``{run_id}.{uid}``: replicas of different stages never meet, even with equal shapes.

What is combined, by ``combine``:

- ``"mean"`` (the default): the parameters are averaged (local SGD's model averaging).
  Safe with any optimizer; with plain SGD it keeps only the mean of the replicas'
  updates, which divides a stage's learning rate by its number of replicas.
- ``"sum"``: each replica brings its parameters ``s_i`` and its update since the last
  round ``d_i = s_i - a_i`` (``a_i``: where that round left it) and takes ``mean(s) +
  (n - 1) * mean(d)``; with equal anchors that is ``a + sum(d)``, as if one model had
  trained on every replica's micro-batches (the linear scaling rule of Goyal et al.
  2017, "Accurate, Large Minibatch SGD", applied to local SGD). Averaging ``s`` as well
  reconciles replicas with different anchors (a newcomer, one that missed a round);
  ``n`` is counted per part of the round (a part some member failed to deliver counts
  only the members it averages). For plain SGD only: an adaptive optimizer (Adam)
  takes steps of a set size whatever the gradient, so summing two replicas' updates
  doubles its step (in the digits pipeline of the tests its loss then jumped back up).

Averaging runs on a snapshot while the server keeps serving; the result comes back as a
delta (``param += new - snapshot``), so the steps taken meanwhile are kept. Taking the
snapshot and applying the delta hold the module
(:meth:`~swarm.experts.worker.ModuleWorker.exclusive`), so no batch reads a half-written
parameter, and mark kept forward graphs stale (their backward recomputes).

After each round, averaged or alone, the replica shares its parameters and its
optimizer state (its tensors: SGD momentum, Adam moments and step) as a new version:
a server joining the stage downloads them (:meth:`StageReplica.load_from_peers`) from
several donors at once, verified (:func:`averaging.load_state_from_peers`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from averaging import (
    AllReduceConfig,
    Averager,
    AveragerConfig,
    AveragingStep,
    LoadedState,
    MatchmakingConfig,
    MatchmakingError,
    StateSyncConfig,
)
from peers.dht import DHT
from peers.errors import PeersError
from swarm.experts.backend import ModuleBackend
from swarm.experts.worker import ModuleWorker
from swarm.pipeline.errors import StageStateError
from swarm.pipeline.sync import part_counts

logger = logging.getLogger(__name__)
R = TypeVar("R")

#: Longest optimizer-state key accepted from a donor (``momentum_buffer``, ``exp_avg``):
#: names, not payloads.
MAX_STATE_KEY_CHARS = 64


def _default_matchmaking() -> MatchmakingConfig:
    # A stage has a handful of replicas, all waking at the same instant.
    return MatchmakingConfig(search_timeout=15.0, gather_timeout=2.0, poll_interval_seconds=0.25)


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    """How the replicas of a stage average, and share state with newcomers."""

    run_id: str = "pipeline"
    """Names the training run: replicas average only within one run."""
    interval_seconds: float = 30.0
    """Seconds between rounds; each averages (if ``average``) then shares state."""
    average: bool = True
    """Average with the stage's other replicas (else only share state)."""
    combine: Literal["mean", "sum"] = "mean"
    """``mean``: average the parameters; ``sum``: keep every replica's update (plain SGD
    only; see the module docstring). Replicas with different values never meet."""
    matchmaking: MatchmakingConfig = field(default_factory=_default_matchmaking)
    """Group forming; a round waits at most ``min(search_timeout, interval / 2)``."""
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    """Round timeouts, chunk size and codec of averaging."""
    state_sync: StateSyncConfig = field(default_factory=StateSyncConfig)
    """How a joining replica downloads."""
    load_timeout: float = 60.0
    """Seconds a joining replica spends downloading before it starts from its own
    initialisation."""

    def __post_init__(self) -> None:
        if self.combine not in ("mean", "sum"):
            raise ValueError(f"combine must be 'mean' or 'sum', got {self.combine!r}")
        if not self.run_id or "/" in self.run_id:
            raise ValueError("run_id must be a non-empty string without '/'")
        for name in ("interval_seconds", "load_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and positive, got {value!r}")


@dataclass(frozen=True, slots=True)
class ReplicaStatistics:
    num_rounds: int
    """Rounds averaged with at least one other replica."""
    num_alone: int
    """Rounds in which no other replica came (or the round failed)."""
    num_shared: int
    loaded_version: int | None
    """The version downloaded when joining, if any."""


class StageReplica:
    """One server's replica of a stage: its averager, snapshots and shared states.
    Use ``async with`` (it enters the averager); :meth:`run` is the periodic task."""

    def __init__(self, dht: DHT, backend: ModuleBackend, config: ReplicaConfig) -> None:
        self.backend = backend
        self.config = config
        self._clock = dht.clock  # the swarm's wall clock (a virtual one in tests)
        self.params = dict(backend.module.named_parameters())
        self.anchors = {name: p.detach().cpu().clone() for name, p in self.params.items()}
        """Where the last round left each parameter (the base of this replica's update)."""
        self.buffers = {f"param/{n}": a.clone() for n, a in self.anchors.items()}
        if config.combine == "sum":  # the names are in the averager's schema hash too
            self.buffers.update(
                {f"delta/{n}": torch.zeros_like(a) for n, a in self.anchors.items()}
            )
        averager_config = AveragerConfig(
            prefix=f"{config.run_id}.{backend.uid}",
            matchmaking=config.matchmaking,
            allreduce=config.allreduce,
            state_sync=config.state_sync,
        )
        self.averager = Averager(dht, self.buffers, averager_config)
        self.steps: Callable[[], int] | None = None
        """A synchronous stage's step count, shared with the state (a newcomer must know
        which step its download is the result of)."""
        self._version = 0
        self._counts = {"rounds": 0, "alone": 0, "shared": 0}
        self._loaded: int | None = None

    async def __aenter__(self) -> StageReplica:
        await self.averager.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.averager.__aexit__(None, None, None)

    # --- joining ---------------------------------------------------------------------

    async def load_from_peers(self, worker: ModuleWorker | None = None) -> LoadedState | None:
        """Download the stage's newest shared state and load it (while no batch runs, if
        ``worker`` serves the module). ``None`` if none could be had or it does not fit
        (logged; the replica keeps what it has)."""
        try:
            loaded = await self.averager.load_state_from_peers(
                timeout=self.config.load_timeout, apply=False
            )
            await self._hold(worker, lambda: self._apply_loaded(loaded))
        except (PeersError, TimeoutError, StageStateError) as e:
            logger.warning("%s: no state loaded from peers: %s", self.backend.uid, e)
            return None
        self._loaded = loaded.version
        return loaded

    def _apply_loaded(self, loaded: LoadedState) -> None:
        """Check everything, then copy: a bad state changes nothing."""
        params: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            got = loaded.tensors.get(f"extra/param/{name}")
            if got is None or got.shape != p.shape or got.dtype != p.dtype:
                raise StageStateError(f"the downloaded state does not fit parameter {name!r}")
            params[name] = got
        optimizer = _optimizer_state(loaded.tensors, self.params)
        for name, t in [*params.items(), *((f"{n}/{k}", v) for (n, k), v in optimizer.items())]:
            if not bool(torch.isfinite(t).all()):
                raise StageStateError(f"the downloaded {name!r} holds NaN or infinite values")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(params[name])
                self.anchors[name].copy_(params[name])
        if self.backend.optimizer is not None:
            for (name, key), value in optimizer.items():
                target = self.params[name]
                self.backend.optimizer.state[target][key] = value.clone().to(target.device)
        self.backend.parameters_changed()

    # --- rounds ----------------------------------------------------------------------

    async def _hold(self, worker: ModuleWorker | None, fn: Callable[[], R]) -> R:
        return fn() if worker is None else await worker.exclusive(fn)

    async def share(
        self, worker: ModuleWorker | None, step: Callable[[], int] | None = None
    ) -> None:
        """Serve the current parameters and optimizer state as a new version (with a
        synchronous stage's ``step()``, read with them while the module is held: the
        steps they are the result of)."""

        step = step or self.steps

        def snapshot() -> tuple[dict[str, torch.Tensor], int | None]:
            return self._state(), None if step is None else step()

        state, steps = await self._hold(worker, snapshot)
        self._version = max(self._version + 1, int(self._clock() * 1000))
        metadata: dict[str, object] = {"uid": self.backend.uid}
        if steps is not None:
            metadata["step"] = steps
        await self.averager.share_state(self._version, metadata, state, include_averaged=False)
        self._counts["shared"] += 1

    def _state(self) -> dict[str, torch.Tensor]:
        state = {f"param/{n}": p.detach().cpu().clone() for n, p in self.params.items()}
        if self.backend.optimizer is not None:
            names = {id(p): name for name, p in self.params.items()}
            for p, slots in self.backend.optimizer.state.items():
                for key, value in slots.items():
                    if isinstance(value, torch.Tensor) and id(p) in names:
                        state[f"opt/{names[id(p)]}/{key}"] = value.detach().cpu().clone()
        return state

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """Parameters and updates into the averager's buffers; the parameters' copy."""
        before = {}
        with torch.no_grad():
            for name, p in self.params.items():
                before[name] = p.detach().cpu().clone()
                self.buffers[f"param/{name}"].copy_(before[name])
                if self.config.combine == "sum":
                    torch.sub(before[name], self.anchors[name], out=self.buffers[f"delta/{name}"])
        return before

    def _apply(self, new: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.add_((new[name] - before[name]).to(p.device))
                self.anchors[name].copy_(new[name])
        self.backend.parameters_changed()

    def _combined(self, step: AveragingStep) -> dict[str, torch.Tensor]:
        """``mean(s)``, or for ``sum`` ``mean(s) + (n - 1) * mean(d)`` per parameter with
        ``n`` per part of the round."""
        if self.config.combine == "mean":
            return {name: self.buffers[f"param/{name}"].clone() for name in self.params}
        counts = part_counts(step, self.buffers)
        return {
            name: self.buffers[f"param/{name}"]
            + (counts[f"delta/{name}"] - 1) * self.buffers[f"delta/{name}"]
            for name in self.params
        }

    async def average_once(self, worker: ModuleWorker, round_key: str) -> bool:
        """One averaging round under ``round_key``; False if no other replica came."""
        before = await worker.exclusive(self._snapshot)
        timeout = min(self.config.matchmaking.search_timeout, self.config.interval_seconds / 2)
        try:
            step = await self.averager.step(round_key, timeout=timeout)
        except (MatchmakingError, TimeoutError) as e:
            logger.info("%s: averaged alone this round: %s", self.backend.uid, e)
            self._counts["alone"] += 1
            return False
        new = self._combined(step)
        await worker.exclusive(lambda: self._apply(new, before))
        self._counts["rounds" if step.num_peers > 1 else "alone"] += 1
        return step.num_peers > 1

    async def run(self, worker: ModuleWorker) -> None:
        """Rounds at every multiple of ``interval_seconds`` of the wall clock, until
        cancelled. A round's failure is logged; the next round tries again."""
        interval = self.config.interval_seconds
        while True:
            index = math.floor(self._clock() / interval) + 1
            await asyncio.sleep(max(0.0, index * interval - self._clock()))
            try:
                if self.config.average:
                    await self.average_once(worker, str(index))
                await self.share(worker)
            except (PeersError, TimeoutError, ValueError) as e:
                logger.warning("%s: replica round %d failed: %r", self.backend.uid, index, e)

    def statistics(self) -> ReplicaStatistics:
        return ReplicaStatistics(
            num_rounds=self._counts["rounds"],
            num_alone=self._counts["alone"],
            num_shared=self._counts["shared"],
            loaded_version=self._loaded,
        )


def _optimizer_state(
    tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]
) -> dict[tuple[str, str], torch.Tensor]:
    """The optimizer tensors of a downloaded state, by (parameter, key), checked: each
    names one of our parameters and is that parameter's shape or a scalar."""
    out: dict[tuple[str, str], torch.Tensor] = {}
    for full, value in tensors.items():
        if not full.startswith("extra/opt/"):
            continue
        name, _, key = full.removeprefix("extra/opt/").rpartition("/")
        p = params.get(name)
        if p is None or not key.isidentifier() or len(key) > MAX_STATE_KEY_CHARS:
            raise StageStateError(f"the downloaded optimizer state names {full[:100]!r}")
        if value.shape not in (p.shape, torch.Size([])) or not value.is_floating_point():
            raise StageStateError(f"the downloaded {full!r} does not fit its parameter")
        out[(name, key)] = value
    return out
