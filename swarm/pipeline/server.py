"""A stage server: hosts one stage of a pipeline, keeps it close to its replicas, and
goes where it is needed most.

:meth:`StageServer.run` picks its stage (the configured one, or with ``stage=None`` the
most under-served one: :func:`~swarm.pipeline.rebalance.stage_to_join` over the live
servers it finds in the DHT, each probed first so a dead server's lingering entries do
not count), builds the stage's module, downloads the stage's parameters and optimizer
state from the servers already on it, shares its own, and serves it as the expert
``{uid_prefix}.{stage}`` (:class:`~swarm.experts.ExpertServer`: batching, training on
every backward, DHT announcements with load and throughput). Meanwhile its replica
averages with the stage's other servers (:mod:`swarm.pipeline.replicas`); or, with
``synchronous``, it steps only when a client ends a step, together with the stage's
other servers, on their summed gradients (:mod:`swarm.pipeline.sync`). With
``rebalance_interval_seconds``, it checks whether moving to another stage would relieve
the pipeline's bottleneck (:func:`~swarm.pipeline.rebalance.stage_to_move`, confirmed
by a second reading a moment later, so one failed DHT read does not move it); if so it
stops serving its stage and joins the other the same way a newcomer does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from peers.dht import DHT
from peers.rpc import CallContext
from swarm.experts.announce import Announcement, ExpertLocation, find_experts
from swarm.experts.backend import DEFAULT_CLIP_GRAD_NORM, ModuleBackend, check_clip_grad_norm
from swarm.experts.calls import call_info
from swarm.experts.schema import MAX_BATCH_SIZE
from swarm.experts.server import ExpertServer, ServerStatistics
from swarm.experts.server_config import ServerConfig
from swarm.experts.uids import check_name
from swarm.experts.worker import ModuleWorker
from swarm.optim_spec import OptimizerSpec, default_optimizer
from swarm.pipeline.errors import StageStepError
from swarm.pipeline.rebalance import StageLoad, stage_to_join, stage_to_move
from swarm.pipeline.replicas import ReplicaConfig, ReplicaStatistics, StageReplica
from swarm.pipeline.stages import PipelineModel
from swarm.pipeline.sync import (
    STEP_PROTOCOL,
    StepRequest,
    StepResponse,
    SyncConfig,
    SyncStage,
    call_step,
)

logger = logging.getLogger(__name__)

#: Loads a synchronous server behind its stage makes in a row before it waits for a
#: call to show it behind again.
MAX_CATCH_UP_LOADS = 5
#: Seconds between those loads (for the stage's servers to share a newer step).
CATCH_UP_RETRY_SECONDS = 0.5
#: Announced servers probed at once when judging the stages' loads.
MAX_CONCURRENT_PROBES = 32


@dataclass(frozen=True, kw_only=True)
class StageServerConfig:
    """Which model's stage a server hosts, how it trains it, and when it moves."""

    model: PipelineModel
    """The model cut into stages (e.g. :class:`~swarm.pipeline.MLPStages`)."""
    stage: int | None = None
    """The stage to serve; ``None``: the most under-served one at start."""
    uid_prefix: str = "stage"
    """Name part of the stages' uids (``stage.0``, ``stage.1``, ...)."""
    optimizer: OptimizerSpec | None = field(default_factory=default_optimizer)
    """How the stage trains on every backward it serves; ``None``: not trained."""
    clip_grad_norm: float | None = DEFAULT_CLIP_GRAD_NORM
    """Bound each caller's gradient contribution, and each optimizer step's gradient,
    to this norm (as an expert server does: docs/experts-trust.md); none (``None``): do
    not clip, for callers you trust."""
    max_batch_size: int = 1024
    """Most samples one request (one micro-batch) may hold."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Batching and announcing of the stage."""
    replicas: ReplicaConfig = field(default_factory=ReplicaConfig)
    """Averaging with the stage's other servers, and state sharing."""
    synchronous: bool = True
    """Step together with the stage's other servers, once per global batch, when the
    client ends its step (:mod:`swarm.pipeline.sync`): the pipeline trains like one
    model, and the replicas stay equal (they never average parameters). False: step on
    every backward served, and average with the replicas every interval (clients must
    be asynchronous too)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How a synchronous stage's servers sum their gradients."""
    rebalance_interval_seconds: float | None = None
    """Seconds between checks whether to move to another stage; unset (``None``): never
    move."""
    rebalance_hysteresis: float = 0.2
    """A move must lower the bottleneck stage's pressure by more than this fraction."""
    probe_timeout: float = 3.0
    """Seconds an announced server has to answer the liveness probe."""

    def __post_init__(self) -> None:
        check_name(self.uid_prefix)
        check_clip_grad_norm(self.clip_grad_norm)
        if self.stage is not None and not 0 <= self.stage < self.model.num_stages:
            raise ValueError(f"stage {self.stage} is outside [0, {self.model.num_stages})")
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size must be in [1, {MAX_BATCH_SIZE}]")
        interval = self.rebalance_interval_seconds
        if interval is not None and not (math.isfinite(interval) and interval > 0):
            raise ValueError("rebalance_interval_seconds must be finite and positive")
        if not (math.isfinite(self.rebalance_hysteresis) and self.rebalance_hysteresis >= 0):
            raise ValueError("rebalance_hysteresis must be finite and >= 0")
        if not (math.isfinite(self.probe_timeout) and self.probe_timeout > 0):
            raise ValueError("probe_timeout must be finite and positive")

    @property
    def uids(self) -> list[str]:
        return [f"{self.uid_prefix}.{i}" for i in range(self.model.num_stages)]


@dataclass(frozen=True, slots=True)
class StageServerStatistics:
    stage: int | None
    """The stage served now (``None`` between stages)."""
    num_moves: int
    loaded_version: int | None
    """The state version downloaded when joining the current stage, if any."""
    replica: ReplicaStatistics | None
    server: ServerStatistics | None


class StageServer:
    """Hosts a stage of ``config.model`` on ``dht``'s peer; see the module docstring."""

    def __init__(self, dht: DHT, config: StageServerConfig) -> None:
        self.dht = dht
        self.peer = dht.peer
        self.config = config
        self.stage: int | None = None
        self._server: ExpertServer | None = None
        self._replica: StageReplica | None = None
        self._sync: SyncStage | None = None
        self._num_moves = 0
        self._rng = random.Random()

    async def run(
        self, stop: asyncio.Event, on_ready: Callable[[StageServer], None] | None = None
    ) -> None:
        """Serve until ``stop`` is set; ``on_ready`` is called each time a stage is
        served (after a move too). Raises what building the module or
        :class:`ExpertServer` raise; a failed download or averaging round is logged."""
        stage = self.config.stage
        if stage is None:
            stage = stage_to_join(await self.stage_loads(), self._rng)
        while True:
            target = await self._serve_stage(stage, stop, on_ready)
            if target is None:
                return
            logger.info("moving from stage %d to stage %d", stage, target)
            self._num_moves += 1
            stage = target

    async def stage_loads(self) -> list[StageLoad]:
        """Every stage's servers, as announced, that answer a probe now (this server
        counts for the stage it serves now, whatever stale entries say)."""
        found = await find_experts(self.dht, self.config.uids)
        listed = [found[uid] for uid in self.config.uids]
        semaphore = asyncio.Semaphore(MAX_CONCURRENT_PROBES)

        async def alive(a: Announcement) -> bool:
            if a.location.peer_id == self.peer.peer_id:
                return self.stage is not None and a.location.uid == self.config.uids[self.stage]
            async with semaphore:
                try:
                    await call_info(self.peer, a.location, timeout=self.config.probe_timeout)
                except Exception as e:  # whatever the reason, it does not serve it now
                    logger.info("probe of %s failed: %r", a.location.peer_id, e)
                    return False
            return True

        answers = iter(await asyncio.gather(*(alive(a) for stage in listed for a in stage)))
        live = [[a for a in stage if next(answers)] for stage in listed]
        return [StageLoad(len(stage), tuple(a.throughput for a in stage)) for stage in live]

    def _build(self, stage: int) -> ModuleBackend:
        module, inputs = self.config.model.build_stage(stage)
        spec = self.config.optimizer
        return ModuleBackend(
            self.config.uids[stage],
            module,
            inputs=inputs,
            max_batch_size=self.config.max_batch_size,
            optimizer=None if spec is None else spec.build(module.parameters()),
            clip_grad_norm=self.config.clip_grad_norm,
            step_on_backward=not self.config.synchronous,
        )

    async def _serve_stage(
        self, stage: int, stop: asyncio.Event, on_ready: Callable[[StageServer], None] | None
    ) -> int | None:
        """Serve ``stage`` until ``stop`` (``None``) or a decision to move (the target)."""
        backend = await asyncio.to_thread(self._build, stage)
        uid = backend.uid
        replicas = self.config.replicas
        if self.config.synchronous:  # its averager sums gradients instead (SyncStage)
            sync_config = self.config.sync
            replicas = dataclasses.replace(
                replicas,
                average=False,
                matchmaking=sync_config.matchmaking,
                allreduce=sync_config.allreduce,
            )
        async with (
            StageReplica(self.dht, backend, replicas) as replica,
            self._synchronous(backend, replica) as sync,
        ):
            listed = (await find_experts(self.dht, [uid]))[uid]
            if any(
                a.location.peer_id != self.peer.peer_id for a in listed
            ):  # joining a served stage: start from where its replicas are
                if sync is not None:
                    await self._ask_to_share(uid, listed)
                loaded = await replica.load_from_peers()
                if sync is not None and loaded is not None:
                    sync.start_at(loaded.metadata.get("step"))
            await replica.share(None)
            server_config = self.config.server
            server = ExpertServer(self.peer, [backend], server_config, dht=self.dht)
            if sync is not None:  # calls for another step than the stage's are refused
                server.step_guard = lambda _uid, step, kind: sync.check_step(step, kind)
            async with server:
                self.stage, self._server, self._replica = stage, server, replica
                self._sync = sync
                try:
                    if on_ready is not None:
                        on_ready(self)
                    return await self._until_stop_or_move(stage, server, replica, stop)
                finally:
                    self.stage, self._server, self._sync = None, None, None

    @contextlib.asynccontextmanager
    async def _synchronous(
        self, backend: ModuleBackend, replica: StageReplica
    ) -> AsyncIterator[SyncStage | None]:
        """A synchronous stage's step on the replica's averager, answering
        :data:`STEP_PROTOCOL` while it serves (``None`` for an asynchronous one)."""
        if not self.config.synchronous:
            yield None
            return
        sync = SyncStage(
            backend,
            replica.averager,
            {name: replica.buffers[f"param/{name}"] for name in replica.params},
            clip_grad_norm=self.config.clip_grad_norm,
            on_step=replica.share,  # a newcomer downloads the stage as of its last step
            catch_up=lambda: self._catch_up(replica, sync),
        )
        replica.steps = sync.steps  # and every share says which step that is
        self.peer.add_unary_handler(STEP_PROTOCOL, self.rpc_step, StepRequest)
        try:
            yield sync
        finally:
            self.peer.remove_stream_handler(STEP_PROTOCOL)
            sync.close()

    async def _catch_up(self, replica: StageReplica, sync: SyncStage) -> None:
        """A caller named a later step than this server's: if the stage's other servers
        confirm one, load the stage's newest state (held), again while they are past the
        one loaded, a bounded number of times. A step nobody else has taken is a
        caller's mistake or a lie, and downloads nothing: one call naming a far step
        would otherwise cost this server and every other of the stage a state transfer
        (the others serialize theirs to share it), over and over."""
        uid = replica.backend.uid
        for _ in range(MAX_CATCH_UP_LOADS):
            worker = self.worker
            if worker is None:
                return
            listed = (await find_experts(self.dht, [uid]))[uid]
            ahead = await self._step_of_others(uid, listed)
            if ahead <= sync.step:
                logger.info(
                    "%s: a caller named step %d, the stage's other servers are at most at "
                    "%d: nothing to load",
                    uid,
                    sync.seen,
                    ahead,
                )
                sync.seen = sync.step
                return
            sync.seen = ahead
            await self._ask_to_share(uid, listed)
            loaded = await replica.load_from_peers(worker)
            if loaded is not None:
                await worker.exclusive(
                    functools.partial(sync.caught_up, loaded.metadata.get("step"))
                )
                logger.info("%s: loaded the stage at step %d", replica.backend.uid, sync.step)
            if sync.step >= sync.seen:
                return
            await asyncio.sleep(CATCH_UP_RETRY_SECONDS)

    async def _ask_others(
        self, listed: Sequence[Announcement], request: StepRequest, timeout: float
    ) -> list[tuple[ExpertLocation, StepResponse | Exception]]:
        """``request`` to the stage's other listed servers at once (a bounded number):
        each one's answer, or why there is none."""
        others = [a.location for a in listed if a.location.peer_id != self.peer.peer_id]
        others = others[:MAX_CONCURRENT_PROBES]
        answers = await asyncio.gather(
            *(call_step(self.peer, location, request, timeout) for location in others)
        )
        return list(zip(others, answers, strict=True))

    async def _step_of_others(self, uid: str, listed: Sequence[Announcement]) -> int:
        """The latest step the stage's other servers say they are at (-1: none answers)."""
        request = StepRequest(uid, -1, end=False)
        answers = await self._ask_others(listed, request, self.config.probe_timeout)
        return max((a.step for _, a in answers if isinstance(a, StepResponse)), default=-1)

    async def _ask_to_share(self, uid: str, listed: Sequence[Announcement]) -> None:
        """Ask the stage's other servers to share their state as of their step now (a
        synchronous server shares on request, not after every step); failures are
        theirs to have, the download picks among those that did."""
        request = StepRequest(uid, -1, end=False, share=True)
        timeout = self.config.probe_timeout + self.config.replicas.load_timeout / 4
        for location, answer in await self._ask_others(listed, request, timeout):
            if not isinstance(answer, StepResponse):
                logger.info("%s at %s did not share: %r", uid, location.peer_id, answer)

    async def rpc_step(self, request: StepRequest, context: CallContext) -> StepResponse:
        """End (or report) a synchronous stage's step: :meth:`SyncStage.end_step`."""
        sync, server, stage = self._sync, self._server, self.stage
        if sync is None or server is None or stage is None or request.uid != sync.backend.uid:
            raise StageStepError(
                f"this server does not serve {request.uid[:128]!r} synchronously now"
            )
        allowed = self.config.server.allowed_trainers
        if allowed is not None and context.remote_peer_id not in allowed:
            raise StageStepError(f"{context.remote_peer_id} is not an allowed trainer here")
        return await sync.end_step(
            server.workers[sync.backend.uid], request, context.remote_peer_id
        )

    async def _until_stop_or_move(
        self, stage: int, server: ExpertServer, replica: StageReplica, stop: asyncio.Event
    ) -> int | None:
        async with asyncio.TaskGroup() as group:
            rounds = group.create_task(replica.run(server.workers[replica.backend.uid]))
            stopping = group.create_task(stop.wait())
            watching = None
            if self.config.rebalance_interval_seconds is not None:
                watching = group.create_task(self._watch_balance(stage))
            waits = [t for t in (stopping, watching) if t is not None]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in (rounds, *waits):
                task.cancel()
        if watching is not None and watching.done() and not watching.cancelled():
            return watching.result()
        return None

    async def _watch_balance(self, stage: int) -> int:
        """Returns the stage to move to, once two readings a moment apart agree."""
        interval = self.config.rebalance_interval_seconds
        assert interval is not None
        while True:
            # jittered, so the servers of a stage do not all decide at once
            await asyncio.sleep(interval * (0.5 + self._rng.random()))
            hysteresis = self.config.rebalance_hysteresis
            target = stage_to_move(await self.stage_loads(), stage, hysteresis)
            if target is None:
                continue
            await asyncio.sleep(interval * 0.25 * self._rng.random())
            if stage_to_move(await self.stage_loads(), stage, hysteresis) == target:
                return target

    @property
    def worker(self) -> ModuleWorker | None:
        """The worker of the stage served now (``None`` between stages): its
        ``exclusive`` reads the stage's module safely."""
        if self._server is None or self.stage is None:
            return None
        return self._server.workers[self.config.uids[self.stage]]

    def statistics(self) -> StageServerStatistics:
        replica = self._replica
        return StageServerStatistics(
            stage=self.stage,
            num_moves=self._num_moves,
            loaded_version=None if replica is None else replica.statistics().loaded_version,
            replica=None if replica is None else replica.statistics(),
            server=None if self._server is None else self._server.statistics(),
        )
