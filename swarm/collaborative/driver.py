"""The collaborative optimizer's driver: :class:`CollaborativeDriver` carries out what
:class:`~swarm.collaborative.machine.StepMachine` decides, on one event loop.

It runs where the DHT runs: a real peer's loop (behind the blocking
:class:`~swarm.collaborative.optimizer.CollaborativeOptimizer`), or the in-memory
network's virtual loop in tests, where a whole training run among a dozen peers at
internet round trips takes seconds and replays the same. Two things are injected for
that: ``clock``, the wall clock that progress records are stamped and judged with (the
DHT's), and ``executor``, where tensor work runs (building an update, applying it,
packing a state): the training thread behind the blocking optimizer, so the network
loop keeps serving meanwhile; inline on the virtual loop.

Thread use: coroutines run on the loop only; :meth:`batch`, :meth:`round_due` and the
views (:meth:`swarm_progress`, :attr:`epoch`, ...) are plain calls the training thread
makes while no coroutine of the driver runs (the progress tracker on the loop reads the
machine's own record meanwhile, as it always may).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Generic, TypeVar

import torch

from averaging import (
    AllReduceError,
    Averager,
    AveragerConfig,
    AveragingStep,
    Codec,
    Float16Codec,
    MatchmakingError,
    NoneCodec,
    StateSyncConfig,
    StateSyncError,
    Uniform8BitCodec,
)
from averaging.state.manifest import DTYPES, TensorSpec
from peers.dht import DHT
from peers.dht.records import RecordError, owner_marker, owner_of
from peers.identity import PeerID
from peers.owned_tasks import CANCEL_TIMEOUT_SECONDS, OwnedTasks
from peers.stream_api import ReachableHostT
from peers.traffic import LatencyHistogram
from swarm.collaborative.buffers import AveragingBuffers
from swarm.collaborative.config import CollaborativeConfig, OptimizerError, OptimizerStatistics
from swarm.collaborative.machine import (
    Average,
    Decision,
    DiLoCoPolicy,
    GradientPolicy,
    Resync,
    Round,
    RoundOutcome,
    Step,
    StepMachine,
    Train,
    Wait,
)
from swarm.collaborative.progress import MAX_FINGERPRINT_BYTES, PeerProgress, SwarmProgress
from swarm.collaborative.state import pack_state, state_problem, unpack_state
from swarm.collaborative.updates import DiLoCoUpdates, GradientUpdates, Updates, zero_grads
from swarm.errors import SwarmError

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Distinct networks (peers.subnets.source_group) that must offer a state before a peer
#: loads it: one volunteer, however many identities it holds, is not enough. A swarm
#: whose donors all answer from fewer networks needs them all to agree.
STATE_QUORUM = 2
#: The averager ends each step within its own bounds (matchmaking's ``search_timeout``,
#: then the round's timeout, stretched on slow links up to ``max_round_timeout``; a
#: state download its ``state_timeout``). The driver waits this much longer before it
#: calls the call hung: it fires on a bug or a stalled event loop, never on a slow
#: round, which ends by its own deadline.
HUNG_CALL_SLACK_SECONDS = 5.0

_CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "float16": Float16Codec,
    "uint8": Uniform8BitCodec,
}


class CollaborativeDriver(Generic[ReachableHostT]):
    """Steps ``optimizer`` together with the swarm of ``config.run_id`` found through
    ``dht``, on ``dht``'s loop. Use ``async with``; after each local backward, ``await
    step(batch_size)``; after the run's last step, ``await finish()``.

    ``on_epoch`` is called whenever :attr:`epoch` moves (a global step, a loaded
    state): the blocking optimizer steps its learning-rate scheduler there."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: DHT[ReachableHostT],
        config: CollaborativeConfig,
        *,
        clock: Callable[[], float] | None = None,
        executor: concurrent.futures.Executor | None = None,
        on_epoch: Callable[[], None] | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        self.optimizer = optimizer
        self.dht = dht
        self.config = config
        self.clock = clock if clock is not None else dht.clock
        self._executor = executor
        self._on_epoch = on_epoch
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise OptimizerError("the optimizer holds no parameters")
        self.machine = StepMachine(
            me=dht.peer.peer_id,
            policy=DiLoCoPolicy(config.diloco.inner_steps) if config.diloco else GradientPolicy(),
            target_batch_size=config.target_batch_size,
            progress_expiration=config.progress_expiration,
            max_wait_seconds=config.max_wait_seconds,
            overlap=config.diloco is not None and config.diloco.overlap,
        )
        #: What is averaged: host buffers, and accumulators on each parameter's device.
        self.averaged = AveragingBuffers(self.params)
        self.updates: Updates
        if config.diloco is not None:
            self.diloco = DiLoCoUpdates(optimizer, self.params, self.averaged, config.diloco)
            self.updates = self.diloco
        else:
            self.updates = GradientUpdates(optimizer, self.params, self.averaged)
        self.round_latency = LatencyHistogram()
        #: Overlap: the round in flight (what it averages, its task, when it started on
        #: the loop's clock).
        self._in_flight: tuple[Average, asyncio.Task[AveragingStep], float] | None = None
        self._warned_late = False
        # DiLoCo's parameter changes travel with its own codec; gradients with the one
        # config.allreduce names (CollaborativeConfig refuses a choice of both).
        codec = _CODECS[config.diloco.codec]() if config.diloco else config.allreduce.codec
        averager_config = AveragerConfig(
            prefix=config.run_id,
            matchmaking=config.matchmaking,
            allreduce=replace(config.allreduce, codec=codec),
            aggregation=config.aggregation,
            reducers_per_part=config.reducers_per_part,
            error_feedback=config.error_feedback,
            state_sync=StateSyncConfig(trusted_signers=config.run_keys()),
            state_signer=config.run_key,
        )
        named = {str(i): b for i, b in enumerate(self.averaged.host)}
        self.averager: Averager[ReachableHostT] = Averager(dht, named, averager_config)
        self.closed = False
        # The tracker's: everyone's records as last read, how many reads so far (a wait
        # for records waits for the next one), whether a wait is on.
        self.records: dict[PeerID, PeerProgress] = {}
        self._reads = 0
        self._read = asyncio.Condition()
        self._hurry = False  # a wait is on: read the records often
        self._published: tuple[PeerProgress, float] | None = None  # and when (loop time)
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # the tracker's: read now (or stop)
        # The progress tracker and every publish in flight; aclose() ends them.
        self._tasks = OwnedTasks("CollaborativeDriver")
        self._exit = contextlib.AsyncExitStack()

    async def __aenter__(self) -> CollaborativeDriver[ReachableHostT]:
        await self._exit.enter_async_context(self.averager)
        self._exit.push_async_callback(self._tasks.close, CANCEL_TIMEOUT_SECONDS)
        self._spawn(self._track_progress())
        self.publish_now()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop publishing progress and leave the swarm (the DHT stays open)."""
        if self.closed:
            return
        self.closed = True
        if self._in_flight is not None:
            self._in_flight[1].cancel()
            self._in_flight = None
        self._stop.set()
        self._wake.set()
        async with self._read:
            self._read.notify_all()  # a wait for records ends now
        await self._exit.aclose()

    # --- the counters the training loop reads -----------------------------------------

    @property
    def epoch(self) -> int:
        """Global steps (DiLoCo: outer steps) this peer has taken part in."""
        return self.machine.epoch

    @property
    def phase(self) -> int:
        """The epoch this peer's samples count toward now: :attr:`epoch`, or with
        ``DiLoCoConfig.overlap`` the next one while the round that ends ``epoch`` is in
        flight."""
        return self.machine.phase

    @property
    def accumulated(self) -> int:
        """Samples this peer added toward the step that ends its epoch."""
        return self.machine.samples

    @property
    def inner_step(self) -> int:
        """DiLoCo: local steps taken since the last outer step (0 in gradient mode)."""
        if self.config.diloco is None:
            return 0
        return self.machine.inner_steps % self.config.diloco.inner_steps

    @property
    def in_flight(self) -> bool:
        """Overlap: a round is in flight."""
        return self._in_flight is not None

    # --- a batch --------------------------------------------------------------------

    async def step(self, batch_size: int) -> None:
        """Account for a local batch of ``batch_size`` samples (0: nothing new, wait for
        the swarm's step) whose gradients are in the parameters' ``.grad``, and take a
        swarm step when the swarm is ready."""
        if self.round_due(batch_size):
            await self.take_in_round(training=True)
        decision = self.batch(batch_size)
        if not isinstance(decision, Train):
            await self.carry_out(decision)

    def round_due(self, batch_size: int) -> bool:
        """Overlap: the round in flight is to be taken in before this batch counts."""
        self._check_open()
        if self._in_flight is None:
            return False
        self.machine.records = self.records
        return self.machine.round_due(self._in_flight[1].done(), batch_size, self.clock())

    def batch(self, batch_size: int) -> Decision:
        """The machine's decision for a batch of ``batch_size`` samples, whose gradients
        are taken in (tensor work in the caller's thread). Train: nothing else to do."""
        self._check_open()
        self.machine.records = self.records
        decision = self.machine.batch(batch_size, self.clock())
        if batch_size and not isinstance(decision, Resync):
            self.updates.take_batch(batch_size)
        return decision

    async def carry_out(self, decision: Decision) -> None:
        """Carry out the machine's decisions, from ``decision``, until it says train on."""
        try:
            await self._carry_out(decision)
        finally:
            self._hurry = False

    async def _carry_out(self, decision: Decision) -> None:
        while True:
            if isinstance(decision, Wait):
                if not self._hurry:  # a wait begins: my share is done, the others should
                    self._hurry_tracker()  # know, and I should hear of theirs soon
                    self.publish_now()
                await self._await_records(decision.deadline)
                self.machine.records = self.records
                decision = self.machine.poll(decision, self.clock())
                continue
            self._hurry = False
            if isinstance(decision, Train):
                return
            if isinstance(decision, Resync):
                await self._resync(decision)
                return
            if isinstance(decision, Step):
                await self._compute(self.updates.apply)
                await self._finish_epoch()
                return
            self.publish_now()  # I am averaging: peers of my epoch should join now
            outcome = await self._compute(self._build, decision)
            if outcome is None and self.machine.overlap:
                self._launch(decision)
                return  # train on; the round's outcome is taken in later
            if outcome is None:
                outcome = await self._round_outcome(decision, self._start_round(decision))
            decision = self.machine.round_ended(outcome, self.clock())

    def _build(self, average: Average) -> RoundOutcome | None:
        """Build the update ``average`` asks for; its outcome if no round is to be tried
        (it is not finite, or this peer is alone), else None."""
        self.updates.build(self.machine.samples)
        if not self.averaged.host_finite():
            return RoundOutcome(Round.NON_FINITE)
        if average.alone:
            return RoundOutcome(Round.ALONE)
        return None

    def _start_round(self, average: Average) -> asyncio.Task[AveragingStep]:
        return asyncio.create_task(
            self.averager.step(
                average.epoch,
                weight=average.weight,
                target_group_size=average.group_size,
                expected=dict(average.expected),
            )
        )

    async def _round_outcome(
        self,
        average: Average,
        round_task: asyncio.Task[AveragingStep],
        started: float | None = None,
    ) -> RoundOutcome:
        """Wait for ``round_task`` (started at ``started``, loop time; now if None) until
        its bounds pass, and say how it ended."""
        loop = asyncio.get_running_loop()
        timeout = self.config.matchmaking.search_timeout + self.config.allreduce.max_round_timeout
        limit = timeout + HUNG_CALL_SLACK_SECONDS
        if started is not None:
            limit = max(0.0, started + limit - loop.time())
        try:
            try:
                async with asyncio.timeout(limit):
                    step = await asyncio.shield(round_task)
            except TimeoutError:
                round_task.cancel()
                raise
            except asyncio.CancelledError:
                round_task.cancel()  # we are cancelled: the round goes with us
                raise
        except MatchmakingError as e:
            logger.info("epoch %d: no group (%s)", average.epoch, e)
            return RoundOutcome(Round.NO_GROUP)
        except AllReduceError as e:  # our link cannot finish a round: said, not fatal
            logger.warning("epoch %d: not averaged: %s", average.epoch, e)
            return RoundOutcome(Round.NO_GROUP)
        except TimeoutError:
            logger.warning("epoch %d: the averaging step hung; abandoned", average.epoch)
            return RoundOutcome(Round.NOT_AGREED)
        seconds = step.matchmaking_seconds + step.allreduce_seconds
        self.round_latency.record(seconds)
        transfer, report = step.outcome.transfer, step.outcome.result.report
        agreed = transfer.agreed and report.fraction_averaged >= 1.0
        if not agreed:
            logger.info("epoch %d: round not agreed (%s)", average.epoch, report)
        return RoundOutcome(
            Round.AGREED if agreed else Round.NOT_AGREED,
            fingerprint=step.outcome.result.fingerprint()[:16],
            bytes_sent=transfer.bytes_sent,
            matchmaking_seconds=step.matchmaking_seconds,
            allreduce_seconds=step.allreduce_seconds,
            spread=step.spread,
        )

    # --- overlapped DiLoCo ----------------------------------------------------------

    def _launch(self, average: Average) -> None:
        """Overlap: start the round ``average`` asks for and let training go on."""
        self.diloco.launched()
        self.machine.launched()
        loop = asyncio.get_running_loop()
        self._in_flight = (average, self._start_round(average), loop.time())
        logger.debug(
            "epoch %d: round started for %d peers; training on meanwhile",
            average.epoch,
            average.group_size,
        )

    async def take_in_round(self, *, training: bool = False) -> None:
        """Overlap: wait (if need be) for the round in flight, if any, and carry out its
        outcome: the late outer step, or a resync. ``training``: the training loop is at
        its next batch (not at the run's end or a checkpoint)."""
        self._check_open()
        if self._in_flight is None:
            return
        loop = asyncio.get_running_loop()
        average, round_task, started = self._in_flight
        began = loop.time()
        outcome = await self._round_outcome(average, round_task, started)
        self._in_flight = None
        waited = loop.time() - began
        self.machine.counts.late_round_seconds += waited
        logger.debug(
            "epoch %d: round taken in %.3f s after it started (%s; waited %.3f s)",
            average.epoch,
            loop.time() - started,
            outcome.kind.value,
            waited,
        )
        if training and waited > began - started and not self._warned_late:
            self._warned_late = True  # (once a run: it says what to change)
            logger.warning(
                "epoch %d: the round took %.2f s while the %d inner steps took %.2f s:"
                " its outer step lands a whole outer step late, which costs loss; more"
                " inner steps per outer step (--diloco H) would hide the round",
                average.epoch,
                loop.time() - started,
                self.config.diloco.inner_steps if self.config.diloco else 0,
                began - started,
            )
        decision = self.machine.round_ended(outcome, self.clock())
        if isinstance(decision, Resync):
            self.diloco.launch_point = None
            await self._resync(decision)
            return
        await self._compute(self.diloco.apply_late)
        await self._finish_epoch()

    def abandon_round(self) -> None:
        """Overlap: give up the round in flight (this peer resyncs or restarts)."""
        if self._in_flight is None:
            return
        self._in_flight[1].cancel()
        self._in_flight = None
        self.diloco.launch_point = None
        self.machine.abandoned()

    # --- the run's end, its start, a restart -----------------------------------------

    async def finish(self, timeout: float | None = None) -> bool:
        """After the run's last step: until every live peer of the run reached this epoch
        on one branch, keep publishing progress and serving this peer's state, so that a
        peer whose last round failed loads the final state instead of stepping alone,
        and follow the majority if the last epoch split. At most ``timeout`` seconds
        (default: a search, a round and a state download). True when the swarm settled
        on this peer's state, False at the timeout."""
        self._check_open()
        if timeout is None:
            timeout = (
                self.config.matchmaking.search_timeout
                + self.config.allreduce.round_timeout
                + self.config.state_timeout
            )
        await self.take_in_round()  # (overlap: the last outer step may still be averaged)
        deadline = self.clock() + timeout
        self.publish_now()
        self._hurry_tracker()  # (once: it then reads every progress_interval)
        try:
            while True:
                await self._await_records(deadline)
                self.machine.records = self.records
                decision = self.machine.settled(self.clock())
                if decision is None:
                    return True
                if self.clock() >= deadline:
                    logger.warning(
                        "epoch %d: the run ended unsettled (%s)", self.epoch, decision.reason
                    )
                    return False
                if isinstance(decision, Resync):
                    await self._resync(decision)
        finally:
            self._hurry = False

    async def wait_for_peers(self, num_peers: int, timeout: float) -> int:
        """Wait until ``num_peers`` peers (this one included) publish progress, or
        ``timeout`` seconds; returns how many were seen. Peers that start together call
        it before their first step: two halves of a swarm that cannot see each other yet
        would otherwise take their first steps in two groups, and drift apart.

        The wait is for the largest number any peer of the run waits for (its progress
        record says so), so a volunteer who joins a run that has not started yet waits
        with the others without being told how many to expect."""
        self._check_open()
        deadline = self.clock() + timeout
        self.machine.expect = max(1, num_peers)
        self.publish_now()
        self._hurry_tracker()
        try:
            while self.clock() < deadline:
                self.machine.records = self.records
                if self._reads and self.machine.everyone_present(self.clock()):
                    break
                await self._await_records(deadline)
        finally:
            self._hurry = False
            self.machine.expect = 1
        self.machine.records = self.records
        return len(self.machine.live(self.clock()))

    async def load_state_from_peers(self) -> bool:
        """Join a running swarm: download its state now if it is ahead of us. True if
        state was loaded."""
        self._check_open()
        if self.swarm_progress().epoch <= self.epoch:
            return False
        return await self._load_state()

    async def restarted(self, epoch: int) -> None:
        """The training loop restored a saved state of ``epoch``: start from there."""
        self._check_open()
        self.abandon_round()
        self.machine.restarted(epoch)
        await self._compute(self.averaged.zero)
        self.publish_now()

    # --- epochs and states ------------------------------------------------------------

    async def _finish_epoch(self) -> None:
        self.machine.finish_epoch()
        if self._on_epoch is not None:
            self._on_epoch()  # the scheduler steps once per global step
        await self._compute(self.averaged.zero)
        self.publish_now()
        await self._share_state()

    async def _resync(self, resync: Resync) -> None:
        self.abandon_round()
        log = logger.warning if resync.unusual else logger.info
        log("epoch %d: %s; resyncing", self.epoch, resync.reason)
        await self._compute(zero_grads, self.params)
        if resync.drop_update:
            await self._compute(self.averaged.zero)
        donors = list(resync.donors) if resync.donors is not None else None
        if not await self._load_state(donors=donors, fingerprint=resync.fingerprint):
            # A branch whose peers cannot give its state (a quorum of distinct networks,
            # that fits) is no majority: this peer stays on its own.
            self.machine.load_failed(resync, self.clock())
            self.publish_now()

    async def share_state(self) -> None:
        """Publish progress and serve this peer's state of its epoch now (done after
        every global step; a peer restored from a checkpoint may do it before its
        first)."""
        self._check_open()
        self.publish_now()
        await self._share_state()

    async def _share_state(self) -> None:
        # The fingerprint of the round that ended the epoch goes with the state: a peer
        # that loads it is on that round's branch, and split detection sees it so.
        counters = {"epoch": self.epoch, "fingerprint": self.machine.fingerprint}
        # DiLoCo serves its anchor: the swarm's parameters as of this epoch (with overlap,
        # the parameters hold local steps on top of it already).
        params = self.diloco.anchor if self.config.diloco is not None else self.params
        tensors, metadata = await self._compute(
            pack_state, params, self.updates.optimizers(), counters
        )
        try:
            async with asyncio.timeout(self.config.state_timeout):
                await self.averager.share_state(
                    self.epoch, metadata, extra=tensors, include_averaged=False
                )
        except (StateSyncError, TimeoutError, ValueError) as e:
            logger.warning("could not share state of epoch %d: %s", self.epoch, e)

    async def _load_state(
        self, donors: list[PeerID] | None = None, fingerprint: bytes | None = None
    ) -> bool:
        """Download parameters and optimizer state from peers (``donors`` if given) and
        continue from there; False (and nothing changed) if no state could be had.

        A state is a stranger's claim: it is taken only when :data:`STATE_QUORUM`
        distinct networks offer it (all that answered, if fewer did), or, with run keys
        (``CollaborativeConfig.run_keys``), only when one of them signed it; without run
        keys, when it is no more than one epoch ahead of the epoch half the live peers
        reached; and when it fits our parameters and optimizers; our hyperparameters
        stay ours."""
        ahead = max(self.swarm_progress().epoch, self.epoch) + 1
        try:
            async with asyncio.timeout(self.config.state_timeout + HUNG_CALL_SLACK_SECONDS):
                loaded = await self.averager.load_state_from_peers(
                    timeout=self.config.state_timeout,
                    apply=False,
                    donors=donors,
                    # A run key's signature vouches for the epoch as well.
                    max_version=None if self.config.run_keys() else ahead,
                    quorum=STATE_QUORUM,
                    check=self._state_problem,
                )
        except (StateSyncError, TimeoutError) as e:
            logger.warning("could not load state from peers: %s", e)
            return False
        extra = {
            k.removeprefix("extra/"): v for k, v in loaded.tensors.items() if k.startswith("extra/")
        }
        try:
            counters = await self._compute(
                unpack_state, extra, loaded.metadata, self.params, self.updates.optimizers()
            )
        except SwarmError as e:  # checked on the manifest already: a bug if it happens
            logger.warning("could not load state from peers: %s", e)
            return False
        # The state's own branch: donors that stepped on since we chose them hand over a
        # newer state, of the next round's branch, not the one we asked for.
        own = counters.get("fingerprint", b"")
        self.machine.loaded(int(counters["epoch"]), own or fingerprint or b"")
        if self._on_epoch is not None:
            self._on_epoch()
        await self._compute(self.updates.restart)
        self.publish_now()
        return True

    def _state_problem(
        self, version: int, specs: Sequence[TensorSpec], metadata: dict[str, Any]
    ) -> str | None:
        """Why a donor's manifest does not fit this trainer (see :func:`state_problem`)."""
        tensors = {}
        for spec in specs:
            if not spec.name.startswith("extra/"):
                return f"it has an unexpected tensor {spec.name!r}"
            tensors[spec.name.removeprefix("extra/")] = (DTYPES[spec.dtype], tuple(spec.shape))
        problem = state_problem(tensors, metadata, self.params, self.updates.optimizers())
        if problem is not None:
            return problem
        counters = metadata["counters"]
        if counters.get("epoch") != version:
            return f"its epoch counter is not its version {version}"
        fingerprint = counters.get("fingerprint", b"")
        if not isinstance(fingerprint, bytes) or len(fingerprint) > MAX_FINGERPRINT_BYTES:
            return "its round fingerprint is not a short byte string"
        return None

    async def _compute(self, work: Callable[..., T], *args: Any) -> T:
        """Tensor work, in ``executor`` (the training thread behind the blocking
        optimizer; inline on a virtual loop)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, work, *args)

    # --- the swarm as this peer sees it ---------------------------------------------

    def swarm_progress(self) -> SwarmProgress:
        """The run's progress as this peer sees it now: the swarm's epoch, its live peers,
        the samples toward the next step (each claim capped), throughput and ETA."""
        self.machine.records = self.records
        return self.machine.view(self.clock())

    def members(self) -> list[PeerID]:
        """Who shares the next global batch (:meth:`StepMachine.members`)."""
        self.machine.records = self.records
        return self.machine.members(self.clock())

    def delivered(self) -> set[PeerID]:
        """Members whose records show them adding samples to this peer's epoch or a
        later one (:meth:`StepMachine.delivered`)."""
        self.machine.records = self.records
        return self.machine.delivered(self.clock())

    def working(self, within: float) -> set[PeerID]:
        """Members publishing within ``within`` seconds (:meth:`StepMachine.working`)."""
        self.machine.records = self.records
        return self.machine.working(self.clock(), within)

    def statistics(self) -> OptimizerStatistics:
        counts = self.machine.counts
        return OptimizerStatistics(
            epoch=self.epoch,
            local_steps=counts.local_steps,
            local_samples=counts.local_samples,
            num_rounds=counts.rounds,
            num_rounds_alone=counts.alone,
            num_state_loads=counts.loads,
            num_splits=counts.splits,
            bytes_sent=counts.bytes_sent,
            num_peers=self.machine.last_view(self.clock()).num_peers,
            samples_per_second=self.machine.samples_per_second,
            num_rounds_not_agreed=counts.not_agreed,
            num_rounds_without_group=counts.no_group,
            late_round_seconds=counts.late_round_seconds,
            round_seconds=counts.round_seconds,
            matchmaking_seconds=counts.matchmaking_seconds,
            allreduce_seconds=counts.allreduce_seconds,
            wait_seconds=counts.wait_seconds,
            reducer_spread=counts.reducer_spread,
            round_latency=self.round_latency.snapshot(),
        )

    # --- progress records -------------------------------------------------------------

    @property
    def _progress_key(self) -> str:
        return f"{self.config.run_id}/progress"

    def publish_now(self) -> None:
        """Publish my progress now, in the background (owned: closing cancels it)."""
        if not self.closed:
            self._spawn(self._publish(self._mine()))

    def _mine(self) -> PeerProgress:
        """My record as of now, with where my group searches are reached as of now (a
        peer behind NAT learns late whether hole punching gets through to it)."""
        self.machine.contact = self.averager.contact()
        return self.machine.mine(self.clock())

    def wake_tracker(self) -> None:
        """Read everyone's records now (the tracker's next read starts at once)."""
        self._wake.set()

    def _spawn(self, work: Any) -> None:
        asyncio.get_running_loop().create_task(self._tasks.run(work))

    def _hurry_tracker(self) -> None:
        """A wait for records begins: the tracker reads them now, then every
        ``progress_interval`` (not ``refresh_interval``) until ``_hurry`` drops."""
        self._hurry = True
        self._wake.set()

    async def _await_records(self, deadline: float) -> None:
        """Until the tracker read everyone's records again or ``deadline`` (clock time)."""
        seen = self._reads
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, deadline - self.clock())), self._read:
                await self._read.wait_for(lambda: self._reads != seen or self.closed)
        self._check_open()

    async def _publish(self, progress: PeerProgress) -> None:
        self._published = (progress, asyncio.get_running_loop().time())
        expiration = self.clock() + self.config.progress_expiration
        with contextlib.suppress(Exception):  # progress is best effort; the next one wins
            await self.dht.store(
                self._progress_key,
                progress.to_wire(),
                expiration,
                subkey=owner_marker(self.dht.peer.peer_id),
            )

    async def _track_progress(self) -> None:
        """Read everyone's progress every ``refresh_interval``, or ``progress_interval``
        while a wait is on; publish mine when it changed (at most every
        ``progress_interval``) and every ``refresh_interval`` regardless."""
        while not self._stop.is_set():
            mine = self._mine()
            if self._stale(mine):
                await self._publish(mine)
            with contextlib.suppress(Exception):
                found = await self.dht.get(self._progress_key)
                if isinstance(found, dict):
                    self.records = _parse_records(found)
            async with self._read:
                self._reads += 1
                self._read.notify_all()
            self._wake.clear()
            interval = self.config.progress_interval
            if not self._hurry:
                interval = self.config.refresh_interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()  # aclose() sets it too

    def _stale(self, mine: PeerProgress) -> bool:
        """Whether the record others see of me should be republished now."""
        if self._published is None:
            return True
        last, at = self._published
        age = asyncio.get_running_loop().time() - at
        if age >= self.config.refresh_interval:
            return True
        fields = ("epoch", "samples", "averaging", "fingerprint", "expect", "contact")
        changed = any(getattr(mine, f) != getattr(last, f) for f in fields)
        return changed and age >= self.config.progress_interval

    def _check_open(self) -> None:
        if self.closed:
            raise OptimizerError("the optimizer is closed")


def _parse_records(found: dict[bytes, Any]) -> dict[PeerID, PeerProgress]:
    records: dict[PeerID, PeerProgress] = {}
    for subkey, item in found.items():
        try:
            owner = owner_of(b"", subkey)
        except RecordError:
            continue
        progress = PeerProgress.from_wire(getattr(item, "value", None))
        if owner is not None and progress is not None:
            records[owner] = progress
    return records
