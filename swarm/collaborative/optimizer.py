"""Collaborative training: a wrapper around any torch optimizer that steps with the swarm.

Gradient mode (hivemind.Optimizer's model): every peer accumulates gradients of the
samples it processes; when the swarm's published progress reaches
``target_batch_size`` samples, peers average their accumulated gradients (weighted by
samples) and all apply the same optimizer step. An epoch is one such global step, so
it counts global samples, and schedulers keyed on it stay right as peers come and go.

DiLoCo mode: the wrapped optimizer steps locally every batch; every ``inner_steps``
local steps peers average their parameter change (compressed) and apply an outer
Nesterov step to it.

Joining late or falling behind: a peer whose epoch is older than the swarm's downloads
parameters and optimizer state from its peers (several donors at once, verified) and
continues from there. Every peer serves its state after each step.

This module is the driver: the decisions are :mod:`swarm.collaborative.machine`'s (a
pure state machine), the tensor work :mod:`swarm.collaborative.updates`'. The training
loop stays synchronous and does the tensor work in its own thread; the network runs on
the DHT's background loop, and the training thread waits for it only in the calls that
need an answer (a round, a state download).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

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
from peers.dht import DHT, BlockingDHT, dht_time
from peers.dht.records import RecordError, owner_marker, owner_of
from peers.errors import PeersError
from peers.identity import PeerID
from peers.owned_tasks import CANCEL_TIMEOUT_SECONDS, OwnedTasks
from peers.traffic import LatencyHistogram
from swarm.collaborative.buffers import AveragingBuffers
from swarm.collaborative.config import CollaborativeConfig, OptimizerError, OptimizerStatistics
from swarm.collaborative.face import SchedulerFactory, TorchOptimizerFace
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

#: Distinct networks (peers.subnets.source_group) that must offer a state before a peer
#: loads it: one volunteer, however many identities it holds, is not enough. A swarm
#: whose donors all answer from fewer networks needs them all to agree.
STATE_QUORUM = 2
#: The averager ends each step within its own bounds (matchmaking's ``search_timeout``,
#: then the round's timeout, stretched on slow links up to ``max_round_timeout``; a
#: state download its ``state_timeout``). The
#: training thread waits this much longer before it calls the call hung: it fires on a
#: bug or a stalled event loop, never on a slow round, which ends by its own deadline.
HUNG_CALL_SLACK_SECONDS = 5.0

#: A round in flight: what it averages, its result to come, when it started (monotonic).
InFlight = tuple[Average, concurrent.futures.Future[AveragingStep], float]

_CODECS: dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "float16": Float16Codec,
    "uint8": Uniform8BitCodec,
}


class CollaborativeOptimizer(TorchOptimizerFace):
    """Steps ``optimizer`` together with the swarm of ``config.run_id`` found through
    ``dht``. Call :meth:`step` after each local ``loss.backward()`` (with the batch
    size, or set ``config.batch_size_per_step``); call :meth:`close` (or use ``with``)
    when done. It is a ``torch.optim.Optimizer`` to the training loop
    (:mod:`swarm.collaborative.face`): ``zero_grad``, ``param_groups``, ``state_dict``,
    and ``scheduler``, a function that builds a learning-rate scheduler for
    ``optimizer``, stepped once per global step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dht: BlockingDHT,
        config: CollaborativeConfig,
        *,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise OptimizerError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        self.optimizer = optimizer
        self.dht = dht
        self.config = config
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        if not self.params:
            raise OptimizerError("the optimizer holds no parameters")
        self._machine = StepMachine(
            me=dht.peer.peer_id,
            policy=DiLoCoPolicy(config.diloco.inner_steps) if config.diloco else GradientPolicy(),
            target_batch_size=config.target_batch_size,
            progress_expiration=config.progress_expiration,
            max_wait_seconds=config.max_wait_seconds,
            overlap=config.diloco is not None and config.diloco.overlap,
        )
        self._init_face(scheduler)
        #: What is averaged: host buffers, and accumulators on each parameter's device.
        self._averaged = AveragingBuffers(self.params)
        self.buffers = self._averaged.host
        self._updates: Updates
        if config.diloco is not None:
            self._diloco = DiLoCoUpdates(optimizer, self.params, self._averaged, config.diloco)
            self._updates = self._diloco
        else:
            self._updates = GradientUpdates(optimizer, self.params, self._averaged)
        self._round_latency = LatencyHistogram()
        #: Overlap: the round in flight (what it averages, its future, when it started).
        self._in_flight: InFlight | None = None
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
        named = {str(i): b for i, b in enumerate(self.buffers)}
        self._averager = Averager(dht.node, named, averager_config)
        self._closed = False
        # The tracker's (the DHT loop's): everyone's records as last read, how many reads
        # so far (the training thread waits for the next one), whether it waits.
        self._records: dict[PeerID, PeerProgress] = {}
        self._reads = 0
        self._read = threading.Condition()
        self._hurry = False  # the training thread waits on the records: read them often
        self._published: tuple[PeerProgress, float] | None = None  # and when (monotonic)
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # the tracker's: read now (or stop)
        # The progress tracker and every publish in flight: close() ends them (the DHT
        # loop's thread only); the averager's context is left by close() too.
        self._tasks = OwnedTasks("CollaborativeOptimizer")
        self._exit = contextlib.AsyncExitStack()
        dht.peer.run(self._exit.enter_async_context(self._averager))
        self._progress_task = dht.peer.submit(self._tasks.run(self._track_progress()))
        self._publish_now()

    @property
    def epoch(self) -> int:
        """Global steps (DiLoCo: outer steps) this peer has taken part in."""
        return self._machine.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._machine.epoch = value

    # --- the training loop's side ------------------------------------------------------

    def step(  # type: ignore[override]
        self, batch_size: int | None = None, closure: Callable[[], Any] | None = None
    ) -> Any:
        """Account for a local batch of ``batch_size`` samples (default
        ``config.batch_size_per_step``) whose gradients are in the parameters' ``.grad``;
        take a swarm step when the swarm is ready. Gradients are consumed (zeroed).
        Blocks during averaging and state downloads. ``closure``, as a torch optimizer
        takes it (also as the only argument, ``step(closure)``), is called first, with
        gradients on, and its value returned."""
        if callable(batch_size) and closure is None:
            batch_size, closure = None, batch_size
        if batch_size is None:
            batch_size = self.config.batch_size_per_step
            if not batch_size:
                raise OptimizerError(
                    "step needs the local batch size: step(batch_size), or set "
                    "CollaborativeConfig.batch_size_per_step"
                )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise OptimizerError(f"batch_size must be a positive int, got {batch_size!r}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(batch_size)
        return loss

    def wait(self) -> None:
        """Nothing new to add (this peer did its part of the global batch): wait, at most
        ``max_wait_seconds``, for the swarm's step and take it if it comes. Gradient mode;
        in DiLoCo mode it returns at once."""
        self._step(0)

    def finish(self, timeout: float | None = None) -> bool:
        """Call after the run's last step: until every live peer of the run reached this
        epoch on one branch, keep publishing progress and serving this peer's state, so
        that a peer whose last round failed loads the final state instead of stepping
        alone, and follow the majority if the last epoch split. At most ``timeout``
        seconds (default: a search, a round and a state download). True when the
        swarm settled on this peer's state, False at the timeout."""
        if self._closed:
            raise OptimizerError("the optimizer is closed")
        if timeout is None:
            timeout = (
                self.config.matchmaking.search_timeout
                + self.config.allreduce.round_timeout
                + self.config.state_timeout
            )
        self.finish_round()  # (overlap: the last outer step may still be averaged)
        deadline = dht_time() + timeout
        self._publish_now()
        self._hurry_tracker()  # (once: it then reads every progress_interval)
        try:
            while True:
                self._await_records(deadline)
                self._machine.records = self._records
                decision = self._machine.settled(dht_time())
                if decision is None:
                    return True
                if dht_time() >= deadline:
                    logger.warning(
                        "epoch %d: the run ended unsettled (%s)", self.epoch, decision.reason
                    )
                    return False
                if isinstance(decision, Resync):
                    self._resync(decision)
        finally:
            self._hurry = False

    def finish_round(self) -> None:
        """``DiLoCoConfig.overlap``: wait for the round in flight, if any, and apply its
        outer step (or resync); :meth:`finish` and ``state_dict`` do this first. Nothing
        to do otherwise."""
        if self._closed:
            raise OptimizerError("the optimizer is closed")
        if self._in_flight is not None:
            self._take_in_round()

    def _step(self, batch_size: int) -> None:
        """Carry out the machine's decisions for one batch until it says train on."""
        if self._closed:
            raise OptimizerError("the optimizer is closed")
        self._machine.records = self._records
        if self._in_flight is not None and self._machine.round_due(
            self._in_flight[1].done(), batch_size, dht_time()
        ):
            self._take_in_round(training=True)
        decision: Decision = self._machine.batch(batch_size, dht_time())
        if batch_size and not isinstance(decision, Resync):
            self._updates.take_batch(batch_size)
        try:
            self._carry_out(decision)
        finally:
            self._hurry = False

    def _carry_out(self, decision: Decision) -> None:
        while True:
            if isinstance(decision, Wait):
                if not self._hurry:  # a wait begins: my share is done, the others should
                    self._hurry_tracker()  # know, and I should hear of theirs soon
                    self._publish_now()
                self._await_records(decision.deadline)
                self._machine.records = self._records
                decision = self._machine.poll(decision, dht_time())
                continue
            self._hurry = False
            if isinstance(decision, Train):
                return
            if isinstance(decision, Resync):
                self._resync(decision)
                return
            if isinstance(decision, Step):
                self._updates.apply()
                self._finish_epoch()
                return
            self._publish_now()  # I am averaging: peers of my epoch should join now
            outcome = self._build(decision)
            if outcome is None and self._machine.overlap:
                self._launch(decision)
                return  # train on; the round's outcome is taken in later
            if outcome is None:
                outcome = self._round_outcome(decision, self._start_round(decision))
            decision = self._machine.round_ended(outcome, dht_time())

    def _build(self, average: Average) -> RoundOutcome | None:
        """Build the update ``average`` asks for; its outcome if no round is to be tried
        (it is not finite, or this peer is alone), else None."""
        self._updates.build(self._machine.samples)
        if not self._averaged.host_finite():
            return RoundOutcome(Round.NON_FINITE)
        if average.alone:
            return RoundOutcome(Round.ALONE)
        return None

    def _start_round(self, average: Average) -> concurrent.futures.Future[AveragingStep]:
        """The round ``average`` asks for, started on the DHT's loop."""
        return self.dht.peer.submit(
            self._averager.step(
                average.epoch, weight=average.weight, target_group_size=average.group_size
            )
        )

    def _round_outcome(
        self,
        average: Average,
        future: concurrent.futures.Future[AveragingStep],
        started: float | None = None,
    ) -> RoundOutcome:
        """Wait for the round ``future`` (started at ``started``, monotonic; now if
        None) until its bounds pass, and say how it ended."""
        timeout = self.config.matchmaking.search_timeout + self.config.allreduce.max_round_timeout
        limit = timeout + HUNG_CALL_SLACK_SECONDS
        if started is not None:
            limit = max(0.0, started + limit - time.monotonic())
        try:
            try:
                step = future.result(limit)
            except concurrent.futures.TimeoutError as e:
                future.cancel()
                raise TimeoutError from e
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
        self._round_latency.record(seconds)
        transfer, report = step.outcome.transfer, step.outcome.result.report
        if not transfer.agreed or report.fraction_averaged < 1.0:
            logger.info("epoch %d: round not agreed (%s)", average.epoch, report)
        return RoundOutcome(
            Round.AGREED
            if transfer.agreed and report.fraction_averaged >= 1.0
            else Round.NOT_AGREED,
            fingerprint=step.outcome.result.fingerprint()[:16],
            bytes_sent=transfer.bytes_sent,
            matchmaking_seconds=step.matchmaking_seconds,
            allreduce_seconds=step.allreduce_seconds,
            spread=step.spread,
        )

    # --- overlapped DiLoCo --------------------------------------------------------------

    def _launch(self, average: Average) -> None:
        """Overlap: start the round ``average`` asks for and let training go on."""
        self._diloco.launched()
        self._machine.launched()
        self._in_flight = (average, self._start_round(average), time.monotonic())
        logger.debug(
            "epoch %d: round started for %d peers; training on meanwhile",
            average.epoch,
            average.group_size,
        )

    def _take_in_round(self, *, training: bool = False) -> None:
        """Overlap: wait (if need be) for the round in flight and carry out its outcome:
        the late outer step, or a resync. ``training``: the training loop is at its
        next batch (not at the run's end or a checkpoint)."""
        assert self._in_flight is not None
        average, future, started = self._in_flight
        began = time.monotonic()
        outcome = self._round_outcome(average, future, started)
        self._in_flight = None
        waited = time.monotonic() - began
        self._machine.counts.late_round_seconds += waited
        logger.debug(
            "epoch %d: round taken in %.3f s after it started (%s; waited %.3f s)",
            average.epoch,
            time.monotonic() - started,
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
                time.monotonic() - started,
                self.config.diloco.inner_steps if self.config.diloco else 0,
                began - started,
            )
        decision = self._machine.round_ended(outcome, dht_time())
        if isinstance(decision, Resync):
            self._diloco.launch_point = None
            self._resync(decision)
            return
        self._diloco.apply_late()
        self._finish_epoch()

    def _abandon_round(self) -> None:
        """Overlap: give up the round in flight (this peer resyncs or restarts)."""
        if self._in_flight is None:
            return
        self._in_flight[1].cancel()
        self._in_flight = None
        self._diloco.launch_point = None
        self._machine.abandoned()

    def _resync(self, resync: Resync) -> None:
        self._abandon_round()
        log = logger.warning if resync.unusual else logger.info
        log("epoch %d: %s; resyncing", self.epoch, resync.reason)
        zero_grads(self.params)
        if resync.drop_update:
            self._averaged.zero()
        donors = list(resync.donors) if resync.donors is not None else None
        if not self._load_state(donors=donors, fingerprint=resync.fingerprint):
            # A branch whose peers cannot give its state (a quorum of distinct networks,
            # that fits) is no majority: this peer stays on its own.
            self._machine.load_failed(resync, dht_time())
            self._publish_now()

    def _finish_epoch(self) -> None:
        self._machine.finish_epoch()
        self._follow_epoch()  # the scheduler steps once per global step
        self._averaged.zero()
        self._publish_now()
        self._share_state()

    def _hurry_tracker(self) -> None:
        """The training thread waits on the records: the tracker reads them now, then
        every ``progress_interval`` (not ``refresh_interval``) until ``_hurry`` drops."""
        self._hurry = True
        with contextlib.suppress(PeersError, RuntimeError):  # the DHT's peer is closed
            self.dht.peer.submit(self._wake_tracker())

    def _await_records(self, deadline: float) -> None:
        """Until the tracker read everyone's records again or ``deadline`` (DHT time)."""
        with self._read:
            seen = self._reads
            self._read.wait_for(
                lambda: self._reads != seen or self._closed,
                timeout=max(0.0, deadline - dht_time()),
            )

    # --- the swarm as this peer sees it -------------------------------------------------

    def _mine(self) -> PeerProgress:
        return self._machine.mine(dht_time())

    def swarm_progress(self) -> SwarmProgress:
        """The run's progress as this peer sees it now: the swarm's epoch, its live peers,
        the samples toward the next step (each claim capped), throughput and ETA."""
        self._machine.records = self._records
        return self._machine.view(dht_time())

    def members(self) -> list[PeerID]:
        """Who shares the next global batch (:meth:`StepMachine.members`)."""
        self._machine.records = self._records
        return self._machine.members(dht_time())

    def delivered(self) -> set[PeerID]:
        """Members whose records show them adding samples to this peer's epoch or a
        later one (:meth:`StepMachine.delivered`)."""
        self._machine.records = self._records
        return self._machine.delivered(dht_time())

    def working(self, within: float) -> set[PeerID]:
        """Members publishing within ``within`` seconds (:meth:`StepMachine.working`)."""
        self._machine.records = self._records
        return self._machine.working(dht_time(), within)

    @property
    def accumulated(self) -> int:
        """Samples this peer added toward the step that ends its epoch."""
        return self._machine.samples

    @property
    def phase(self) -> int:
        """The epoch this peer's samples count toward now: :attr:`epoch`, or with
        ``DiLoCoConfig.overlap`` the next one while the round that ends ``epoch`` is in
        flight. A training loop that runs a fixed number of outer steps stops when this
        reaches it, and :meth:`finish` takes the last round in."""
        return self._machine.phase

    @property
    def inner_step(self) -> int:
        """DiLoCo: local steps taken since the last outer step (0 in gradient mode)."""
        if self.config.diloco is None:
            return 0
        return self._machine.inner_steps % self.config.diloco.inner_steps

    # --- progress records ---------------------------------------------------------------

    @property
    def _progress_key(self) -> str:
        return f"{self.config.run_id}/progress"

    def _publish_now(self) -> None:
        """Publish my progress now, in the background (owned: ``close`` cancels it)."""
        if self._closed:
            return
        with contextlib.suppress(PeersError, RuntimeError):  # the DHT's peer is closed
            self.dht.peer.submit(self._tasks.run(self._publish(self._mine())))

    async def _wake_tracker(self) -> None:
        self._wake.set()

    async def _publish(self, progress: PeerProgress) -> None:
        node: DHT = self.dht.node
        self._published = (progress, time.monotonic())
        expiration = dht_time() + self.config.progress_expiration
        with contextlib.suppress(Exception):  # progress is best effort; the next one wins
            await node.store(
                self._progress_key,
                progress.to_wire(),
                expiration,
                subkey=owner_marker(node.peer.peer_id),
            )

    async def _track_progress(self) -> None:
        """Read everyone's progress every ``refresh_interval``, or ``progress_interval``
        while the training thread waits on it; publish mine when it changed (at most
        every ``progress_interval``) and every ``refresh_interval`` regardless."""
        node: DHT = self.dht.node
        while not self._stop.is_set():
            mine = self._mine()
            if self._stale(mine):
                await self._publish(mine)
            with contextlib.suppress(Exception):
                found = await node.get(self._progress_key)
                if isinstance(found, dict):
                    self._records = _parse_records(found)
            with self._read:
                self._reads += 1
                self._read.notify_all()
            self._wake.clear()
            interval = self.config.progress_interval
            if not self._hurry:
                interval = self.config.refresh_interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()  # close() sets it too

    def _stale(self, mine: PeerProgress) -> bool:
        """Whether the record others see of me should be republished now."""
        if self._published is None:
            return True
        last, at = self._published
        age = time.monotonic() - at
        if age >= self.config.refresh_interval:
            return True
        changed = (mine.epoch, mine.samples, mine.averaging, mine.fingerprint, mine.expect) != (
            last.epoch,
            last.samples,
            last.averaging,
            last.fingerprint,
            last.expect,
        )
        return changed and age >= self.config.progress_interval

    # --- state ------------------------------------------------------------------------

    def _share_state(self) -> None:
        # The fingerprint of the round that ended the epoch goes with the state: a peer
        # that loads it is on that round's branch, and split detection sees it so.
        counters = {"epoch": self.epoch, "fingerprint": self._machine.fingerprint}
        # DiLoCo serves its anchor: the swarm's parameters as of this epoch (with overlap,
        # the parameters hold local steps on top of it already).
        params = self._diloco.anchor if self.config.diloco is not None else self.params
        tensors, metadata = pack_state(params, self._updates.optimizers(), counters)
        try:
            self.dht.peer.run(
                self._averager.share_state(
                    self.epoch, metadata, extra=tensors, include_averaged=False
                ),
                timeout=self.config.state_timeout,
            )
        except (StateSyncError, TimeoutError, ValueError) as e:
            logger.warning("could not share state of epoch %d: %s", self.epoch, e)

    def _load_state(
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
            loaded = self.dht.peer.run(
                self._averager.load_state_from_peers(
                    timeout=self.config.state_timeout,
                    apply=False,
                    donors=donors,
                    # A run key's signature vouches for the epoch as well.
                    max_version=None if self.config.run_keys() else ahead,
                    quorum=STATE_QUORUM,
                    check=self._state_problem,
                ),
                timeout=self.config.state_timeout + HUNG_CALL_SLACK_SECONDS,
            )
        except (StateSyncError, TimeoutError) as e:
            logger.warning("could not load state from peers: %s", e)
            return False
        extra = {
            k.removeprefix("extra/"): v for k, v in loaded.tensors.items() if k.startswith("extra/")
        }
        try:
            counters = unpack_state(extra, loaded.metadata, self.params, self._updates.optimizers())
        except SwarmError as e:  # checked on the manifest already: a bug if it happens
            logger.warning("could not load state from peers: %s", e)
            return False
        # The state's own branch: donors that stepped on since we chose them hand over a
        # newer state, of the next round's branch, not the one we asked for.
        own = counters.get("fingerprint", b"")
        self._machine.loaded(int(counters["epoch"]), own or fingerprint or b"")
        self._follow_epoch()
        self._updates.restart()
        self._publish_now()
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
        problem = state_problem(tensors, metadata, self.params, self._updates.optimizers())
        if problem is not None:
            return problem
        counters = metadata["counters"]
        if counters.get("epoch") != version:
            return f"its epoch counter is not its version {version}"
        fingerprint = counters.get("fingerprint", b"")
        if not isinstance(fingerprint, bytes) or len(fingerprint) > MAX_FINGERPRINT_BYTES:
            return "its round fingerprint is not a short byte string"
        return None

    def wait_for_peers(self, num_peers: int, timeout: float) -> int:
        """Wait until ``num_peers`` peers (this one included) publish progress, or
        ``timeout`` seconds; returns how many were seen. Peers that start together call
        it before their first step: two halves of a swarm that cannot see each other yet
        would otherwise take their first steps in two groups, and drift apart.

        The wait is for the largest number any peer of the run waits for (its progress
        record says so), so a volunteer who joins a run that has not started yet waits
        with the others without being told how many to expect."""
        deadline = dht_time() + timeout
        self._machine.expect = max(1, num_peers)
        self._publish_now()
        self._hurry_tracker()
        try:
            while dht_time() < deadline:
                self._machine.records = self._records
                if self._reads and self._machine.everyone_present(dht_time()):
                    break
                self._await_records(deadline)
        finally:
            self._hurry = False
            self._machine.expect = 1
        self._machine.records = self._records
        return len(self._machine.live(dht_time()))

    def load_state_from_peers(self) -> bool:
        """Join a running swarm: download its state now if it is ahead of us. True if
        state was loaded."""
        if self.swarm_progress().epoch <= self.epoch:
            return False
        return self._load_state()

    # --- state_dict (swarm.collaborative.face) -----------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        if self.config.diloco is None:
            return {}
        if self._in_flight is not None:  # the anchor is to be saved with its round in
            self._take_in_round()
        return {
            "outer": self._diloco.outer.state_dict(),
            "anchor": [a.detach().clone() for a in self._diloco.anchor],
        }

    def _check_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        if self.config.diloco is None:
            if "outer" in state_dict:
                raise OptimizerError("a DiLoCo optimizer's state_dict; this one averages gradients")
            return
        anchor = state_dict.get("anchor")
        if "outer" not in state_dict or not isinstance(anchor, list):
            raise OptimizerError("not a DiLoCo optimizer's state_dict (no outer optimizer)")
        if len(anchor) != len(self._diloco.anchor) or any(
            not isinstance(t, torch.Tensor) or t.shape != a.shape
            for t, a in zip(anchor, self._diloco.anchor, strict=False)
        ):
            raise OptimizerError("the state_dict's DiLoCo anchor does not fit these parameters")

    def _load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        if self.config.diloco is None:
            return
        self._diloco.outer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for a, saved in zip(self._diloco.anchor, state_dict["anchor"], strict=True):
                a.copy_(saved)

    def _restarted(self) -> None:
        self._abandon_round()
        self._machine.restarted(self.epoch)
        self._averaged.zero()
        self._publish_now()

    # --- lifecycle --------------------------------------------------------------------

    def statistics(self) -> OptimizerStatistics:
        counts = self._machine.counts
        return OptimizerStatistics(
            epoch=self.epoch,
            local_steps=counts.local_steps,
            local_samples=counts.local_samples,
            num_rounds=counts.rounds,
            num_rounds_alone=counts.alone,
            num_state_loads=counts.loads,
            num_splits=counts.splits,
            bytes_sent=counts.bytes_sent,
            num_peers=self._machine.last_view(dht_time()).num_peers,
            samples_per_second=self._machine.samples_per_second,
            num_rounds_not_agreed=counts.not_agreed,
            num_rounds_without_group=counts.no_group,
            late_round_seconds=counts.late_round_seconds,
            round_seconds=counts.round_seconds,
            matchmaking_seconds=counts.matchmaking_seconds,
            allreduce_seconds=counts.allreduce_seconds,
            wait_seconds=counts.wait_seconds,
            reducer_spread=counts.reducer_spread,
            round_latency=self._round_latency.snapshot(),
        )

    def close(self) -> None:
        """Stop publishing progress and leave the swarm (the DHT stays open)."""
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None:
            self._in_flight[1].cancel()
            self._in_flight = None
        with self._read:
            self._read.notify_all()  # a wait in another thread ends now

        async def stop() -> None:
            self._stop.set()
            self._wake.set()
            # A publish still in flight would outlive us, and maybe the DHT under it.
            await self._tasks.close(CANCEL_TIMEOUT_SECONDS)
            await self._exit.aclose()

        with contextlib.suppress(Exception):
            self.dht.peer.run(stop(), timeout=10.0)
        with contextlib.suppress(Exception):  # ended (cancelled) by stop(), unless it timed out
            self._progress_task.result(timeout=5.0)

    def __enter__(self) -> CollaborativeOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
