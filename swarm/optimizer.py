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

The training loop stays synchronous; the network runs on the DHT's background loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from averaging import (
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
from averaging.state_manifest import DTYPES, TensorSpec
from peers.dht import DHT, BlockingDHT, dht_time
from peers.dht.records import RecordError, owner_marker, owner_of
from peers.errors import PeersError
from peers.identity import PeerID
from peers.owned_tasks import CANCEL_TIMEOUT_SECONDS, OwnedTasks
from peers.traffic import LatencyHistogram
from swarm.device_buffers import AveragingBuffers
from swarm.errors import SwarmError
from swarm.optimizer_config import (
    CollaborativeConfig,
    OptimizerError,
    OptimizerStatistics,
)
from swarm.optimizer_face import SchedulerFactory, TorchOptimizerFace
from swarm.progress import PeerProgress, SwarmProgress, split_winner, summarize
from swarm.training_state import pack_state, state_problem, unpack_state

logger = logging.getLogger(__name__)

#: Distinct networks (peers.subnets.source_group) that must offer a state before a peer
#: loads it: one volunteer, however many identities it holds, is not enough. A swarm
#: whose donors all answer from fewer networks needs them all to agree.
STATE_QUORUM = 2

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
    (:mod:`swarm.optimizer_face`): ``zero_grad``, ``param_groups``, ``state_dict``, and
    ``scheduler``, a function that builds a learning-rate scheduler for ``optimizer``,
    stepped once per global step."""

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
        self.epoch = 0
        self._init_face(scheduler)
        #: What is averaged: host buffers, and accumulators on each parameter's device.
        self._averaged = AveragingBuffers(self.params)
        self.buffers = self._averaged.host
        self._samples = 0
        self._averaging = False
        self._fingerprint = b""
        self._local_steps = 0
        self._local_samples = 0
        self._inner_steps = 0
        self._rate = 0.0
        self._rate_since = time.monotonic()
        self._rate_samples = 0
        self._counts = {
            "rounds": 0,
            "alone": 0,
            "loads": 0,
            "bytes": 0,
            "splits": 0,
            "not_agreed": 0,
            "no_group": 0,
        }
        self._round_seconds = 0.0
        self._round_latency = LatencyHistogram()
        self._reducer_spread = 0.0
        self._records: dict[PeerID, PeerProgress] = {}
        self._expect = 1
        self._first_read = threading.Event()
        self._refused_branches: set[bytes] = set()
        self._view: SwarmProgress | None = None
        self._outer: torch.optim.Optimizer | None = None
        self._anchor: list[torch.Tensor] = []
        if config.diloco is not None:
            self._anchor = [p.detach().clone() for p in self.params]
            self._outer = torch.optim.SGD(
                self.params,
                lr=config.diloco.outer_lr,
                momentum=config.diloco.outer_momentum,
                nesterov=config.diloco.outer_momentum > 0,
            )
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
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # the tracker's: read now (or stop)
        self._hurry = False  # someone waits on the progress records: read them often
        self._published: tuple[PeerProgress, float] | None = None  # and when (monotonic)
        self._closed = False
        # The progress tracker and every publish in flight: close() ends them (the DHT
        # loop's thread only).
        self._tasks = OwnedTasks("CollaborativeOptimizer")
        dht.peer.run(self._averager.__aenter__())
        self._progress_task = dht.peer.submit(self._tasks.run(self._track_progress()))
        self._publish_now()

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

    def _step(self, batch_size: int) -> None:
        if self._closed:
            raise OptimizerError("the optimizer is closed")
        if batch_size:
            self._local_steps += 1
            self._local_samples += batch_size
            self._measure(batch_size)
        if self._behind():
            self._zero_grads()
            self._load_state()
            return
        branch = split_winner(
            self._records,
            self.dht.peer.peer_id,
            self._mine(),
            now=dht_time(),
            expiration_seconds=self.config.progress_expiration,
        )
        if branch is not None and branch[0] not in self._refused_branches:
            # we stepped in a group apart from most of the swarm
            logger.warning("epoch %d: the swarm split; following the majority", self.epoch)
            self._zero_grads()
            self._counts["splits"] += 1
            if not self._load_state(donors=branch[1], fingerprint=branch[0]):
                # Its peers cannot give us its state (a quorum of distinct networks, that
                # fits): identities claiming a branch are no majority. Stay on ours.
                self._refused_branches.add(branch[0])
            return
        if self.config.diloco is not None:
            if batch_size:
                self._diloco_step(batch_size)
        else:
            self._gradient_step(batch_size)

    def _gradient_step(self, batch_size: int) -> None:
        if batch_size:
            self._averaged.add_gradients(self.params, float(batch_size))
            self._zero_grads()
            self._samples += batch_size
        view = self._wait_for_swarm(always=not batch_size)
        if not view.ready:
            return
        self._averaging = True
        self._publish_now()
        self._averaged.to_host()
        self._averaged.divide_host(float(self._samples))
        if not self._average(self._samples, view.num_peers):
            self._load_state()
            return
        self._averaged.host_as_gradients(self.params)
        self.optimizer.step()
        self._zero_grads()
        self._finish_epoch()

    def _diloco_step(self, batch_size: int) -> None:
        assert self.config.diloco is not None and self._outer is not None
        self.optimizer.step()
        self._zero_grads()
        self._samples += batch_size
        self._inner_steps += 1
        if self._inner_steps % self.config.diloco.inner_steps:
            return
        self._averaging = True
        self._wait_for_outer_step()
        # the outer "gradient": anchor - current
        self._averaged.set_difference(self._anchor, self.params)
        self._averaged.to_host()
        if not self._average(self._samples, self._summary().num_peers):
            self._load_state()
            return
        with torch.no_grad():
            for p, a in zip(self.params, self._anchor, strict=True):
                p.copy_(a)
        self._averaged.host_as_gradients(self.params)
        self._outer.step()
        self._zero_grads()
        with torch.no_grad():
            for p, a in zip(self.params, self._anchor, strict=True):
                a.copy_(p)
        self._finish_epoch()

    def _average(self, samples: int, num_peers: int) -> bool:
        """Average the buffers with the swarm (in place). False if no group formed while
        other peers are live: they stepped without us, so our state is stale."""
        if not self._averaged.host_finite():
            # A diverged model or a bad batch: sending it would poison (or, the round
            # refusing it, stall) everyone. Drop it and take the swarm's state instead.
            logger.warning(
                "epoch %d: this peer's update holds NaN or infinity; dropped, resyncing",
                self.epoch,
            )
            self._samples = 0
            self._averaged.zero()
            return False
        if num_peers <= 1:  # nobody else is training: no group to look for
            self._stepped_alone()
            return True
        timeout = self.config.matchmaking.search_timeout
        try:
            step: AveragingStep = self.dht.peer.run(
                self._averager.step(
                    self.epoch,
                    weight=float(max(samples, 1)),
                    target_group_size=max(self._expected_group(), 2),
                ),
                timeout=timeout + self.config.allreduce.round_timeout + 5.0,
            )
        except MatchmakingError as e:
            if self._summary().num_peers > 1:
                logger.info("epoch %d: no group (%s); resyncing", self.epoch, e)
                self._counts["no_group"] += 1
                return False
            logger.info("epoch %d: no group (%s); stepping alone", self.epoch, e)
            self._stepped_alone()
            return True
        self._counts["rounds"] += 1
        self._counts["bytes"] += step.outcome.transfer.bytes_sent
        self._round_seconds += step.matchmaking_seconds + step.allreduce_seconds
        self._round_latency.record(step.matchmaking_seconds + step.allreduce_seconds)
        self._reducer_spread = step.spread
        self._fingerprint = step.outcome.result.fingerprint()[:16]
        report = step.outcome.result.report
        if not step.outcome.transfer.agreed or report.fraction_averaged < 1.0:
            # Withdrawn, or the round ended at its deadline: what we hold is not what
            # the others hold. Take their state rather than drift apart silently.
            logger.info("epoch %d: round not agreed (%s); resyncing", self.epoch, report)
            self._counts["not_agreed"] += 1
            return False
        return True

    def _expected_group(self) -> int:
        """Peers expected in this epoch's round, me included: the live ones in this epoch
        that added samples to it or started averaging. A member that delivered nothing
        has no part in the round (its slot was filled by others) and does not come:
        counting it would make every round wait out the gather window for it (mine says
        it is averaging by now)."""
        live = self._live().values()
        return max(1, sum(1 for r in live if r.epoch == self.epoch and (r.samples or r.averaging)))

    def _wait_for_swarm(self, *, always: bool = False) -> SwarmProgress:
        """Once this peer has its share of the global batch (or ``always``), wait (a
        bounded time) for the others to fill theirs rather than run ahead: the step then
        averages the global batch the config asks for, as one big machine would."""
        view = self._summary()
        share = self.config.target_batch_size // max(view.num_peers, 1)
        if view.ready or (self._samples < share and not always):
            return view
        self._publish_now()
        deadline = time.monotonic() + self.config.max_wait_seconds
        with self._hurrying():
            while not view.ready and time.monotonic() < deadline and not self._behind_view(view):
                time.sleep(self.config.progress_interval / 4)
                view = self._summary()
        return view

    def _wait_for_outer_step(self) -> None:
        """DiLoCo: wait (a bounded time) until every live peer in this epoch finished its
        inner steps too, so that all of them enter the same averaging round."""
        self._publish_now()
        deadline = time.monotonic() + self.config.max_wait_seconds
        me = self.dht.peer.peer_id
        with self._hurrying():
            while time.monotonic() < deadline:
                now = dht_time()
                waiting = [
                    r
                    for p, r in self._records.items()
                    if p != me
                    and now - r.time <= self.config.progress_expiration
                    and r.epoch == self.epoch
                    and not r.averaging
                ]
                if not waiting:
                    return
                time.sleep(self.config.progress_interval / 4)

    def _behind_view(self, view: SwarmProgress) -> bool:
        return view.epoch > self.epoch

    def _stepped_alone(self) -> None:
        # A fingerprint of our own: should another peer have stepped this epoch too
        # (we did not see it in time), the two branches differ and split detection
        # makes one follow the other instead of drifting apart unseen.
        self._counts["alone"] += 1
        digest = hashlib.sha256(b"alone\0" + self.dht.peer.peer_id.to_bytes())
        digest.update(self.epoch.to_bytes(8, "big"))
        self._fingerprint = digest.digest()[:16]

    def _finish_epoch(self) -> None:
        self.epoch += 1
        self._follow_epoch()  # the scheduler steps once per global step
        self._averaging = False
        self._samples = 0
        self._averaged.zero()
        self._publish_now()
        self._share_state()

    def _zero_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def _measure(self, batch_size: int) -> None:
        self._rate_samples += batch_size
        elapsed = time.monotonic() - self._rate_since
        if elapsed >= 1.0:
            self._rate = self._rate_samples / elapsed
            self._rate_since, self._rate_samples = time.monotonic(), 0

    # --- progress ---------------------------------------------------------------------

    def _mine(self) -> PeerProgress:
        return PeerProgress(
            self.epoch,
            self._samples,
            self._rate,
            dht_time(),
            self._averaging,
            self._fingerprint,
            self._expect,
        )

    def _live(self) -> dict[PeerID, PeerProgress]:
        now, me = dht_time(), self.dht.peer.peer_id
        live = {
            p: r
            for p, r in self._records.items()
            if p != me and now - r.time <= self.config.progress_expiration
        }
        live[me] = self._mine()
        return live

    def members(self) -> list[PeerID]:
        """The live peers of the run as this peer sees them, itself included (those whose
        progress record has not expired), except those claiming an epoch ahead of ours:
        who shares the next global batch. A peer truly ahead stepped without us (we
        resync), and one that only claims it would hold a slot it never fills."""
        return sorted(p for p, r in self._live().items() if r.epoch <= self.epoch)

    def delivered(self) -> set[PeerID]:
        """Members that added samples to this peer's epoch (or are past it)."""
        return {
            p
            for p, r in self._live().items()
            if r.epoch > self.epoch or (r.epoch == self.epoch and (r.samples or r.averaging))
        }

    def working(self, within: float) -> set[PeerID]:
        """Members whose progress record is at most ``within`` seconds old: alive and
        publishing, so busy with their part rather than gone (their record stops)."""
        now = dht_time()
        return {p for p, r in self._live().items() if now - r.time <= within}

    @property
    def accumulated(self) -> int:
        """Samples this peer added toward the step that ends its epoch."""
        return self._samples

    @property
    def inner_step(self) -> int:
        """DiLoCo: local steps taken since the last outer step (0 in gradient mode)."""
        if self.config.diloco is None:
            return 0
        return self._inner_steps % self.config.diloco.inner_steps

    def _summary(self) -> SwarmProgress:
        self._view = summarize(
            self._records,
            self.dht.peer.peer_id,
            self._mine(),
            self.config.target_batch_size,
            now=dht_time(),
            expiration_seconds=self.config.progress_expiration,
        )
        return self._view

    def _behind(self) -> bool:
        return self._summary().epoch > self.epoch

    @property
    def _progress_key(self) -> str:
        return f"{self.config.run_id}/progress"

    def _publish_now(self) -> None:
        """Publish my progress now, in the background (owned: ``close`` cancels it)."""
        if self._closed:
            return
        with contextlib.suppress(PeersError, RuntimeError):  # the DHT's peer is closed
            self.dht.peer.submit(self._tasks.run(self._publish(self._mine())))

    @contextlib.contextmanager
    def _hurrying(self) -> Iterator[None]:
        """While inside, the tracker reads everyone's progress every ``progress_interval``
        (the training thread is polling the records), not every ``refresh_interval``."""
        self._hurry = True
        with contextlib.suppress(PeersError, RuntimeError):  # the DHT's peer is closed
            self.dht.peer.submit(self._wake_tracker())
        try:
            yield
        finally:
            self._hurry = False

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
            self._first_read.set()
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

    def _optimizers(self) -> dict[str, torch.optim.Optimizer]:
        optimizers = {"inner": self.optimizer}
        if self._outer is not None:
            optimizers["outer"] = self._outer
        return optimizers

    def _share_state(self) -> None:
        tensors, metadata = pack_state(self.params, self._optimizers(), {"epoch": self.epoch})
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
        ahead = max(self._summary().epoch, self.epoch) + 1
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
                timeout=self.config.state_timeout + 5.0,
            )
        except (StateSyncError, TimeoutError) as e:
            logger.warning("could not load state from peers: %s", e)
            return False
        extra = {
            k.removeprefix("extra/"): v for k, v in loaded.tensors.items() if k.startswith("extra/")
        }
        try:
            counters = unpack_state(extra, loaded.metadata, self.params, self._optimizers())
        except SwarmError as e:  # checked on the manifest already: a bug if it happens
            logger.warning("could not load state from peers: %s", e)
            return False
        self.epoch = int(counters["epoch"])
        self._follow_epoch()
        self._fingerprint = (
            fingerprint if fingerprint is not None else bytes(counters.get("fingerprint", b""))
        )
        self._samples = 0
        self._inner_steps = 0
        self._averaged.zero()
        if self._anchor:
            with torch.no_grad():
                for p, a in zip(self.params, self._anchor, strict=True):
                    a.copy_(p)
        self._counts["loads"] += 1
        self._refused_branches.clear()
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
        problem = state_problem(tensors, metadata, self.params, self._optimizers())
        if problem is None and metadata.get("counters", {}).get("epoch") != version:
            return f"its epoch counter is not its version {version}"
        return problem

    def wait_for_peers(self, num_peers: int, timeout: float) -> int:
        """Wait until ``num_peers`` peers (this one included) publish progress, or
        ``timeout`` seconds; returns how many were seen. Peers that start together call
        it before their first step: two halves of a swarm that cannot see each other yet
        would otherwise take their first steps in two groups, and drift apart.

        The wait is for the largest number any peer of the run waits for (its progress
        record says so), so a volunteer who joins a run that has not started yet waits
        with the others without being told how many to expect."""
        deadline = time.monotonic() + timeout
        self._expect = max(1, num_peers)
        self._publish_now()
        self._first_read.wait(timeout)
        with self._hurrying():
            while time.monotonic() < deadline:
                live = self._live()
                wanted = max((r.expect for r in live.values() if r.epoch == 0), default=1)
                if len(live) >= wanted or any(r.epoch > 0 for r in live.values()):
                    break
                time.sleep(self.config.progress_interval)
        self._expect = 1
        return len(self._live())

    def load_state_from_peers(self) -> bool:
        """Join a running swarm: download its state now if it is ahead of us. True if
        state was loaded."""
        if not self._behind():
            return False
        return self._load_state()

    # --- state_dict (swarm.optimizer_face) ----------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        if self._outer is None:
            return {}
        return {
            "outer": self._outer.state_dict(),
            "anchor": [a.detach().clone() for a in self._anchor],
        }

    def _check_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        if self._outer is None:
            if "outer" in state_dict:
                raise OptimizerError("a DiLoCo optimizer's state_dict; this one averages gradients")
            return
        anchor = state_dict.get("anchor")
        if "outer" not in state_dict or not isinstance(anchor, list):
            raise OptimizerError("not a DiLoCo optimizer's state_dict (no outer optimizer)")
        if len(anchor) != len(self._anchor) or any(
            not isinstance(t, torch.Tensor) or t.shape != a.shape
            for t, a in zip(anchor, self._anchor, strict=False)
        ):
            raise OptimizerError("the state_dict's DiLoCo anchor does not fit these parameters")

    def _load_extra_state(self, state_dict: Mapping[str, Any]) -> None:
        if self._outer is None:
            return
        self._outer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for a, saved in zip(self._anchor, state_dict["anchor"], strict=True):
                a.copy_(saved)

    def _restarted(self) -> None:
        self._samples = 0
        self._inner_steps = 0
        self._averaging = False
        self._averaged.zero()
        self._publish_now()

    # --- lifecycle --------------------------------------------------------------------

    def statistics(self) -> OptimizerStatistics:
        view = self._view or self._summary()
        return OptimizerStatistics(
            epoch=self.epoch,
            local_steps=self._local_steps,
            local_samples=self._local_samples,
            num_rounds=self._counts["rounds"],
            num_rounds_alone=self._counts["alone"],
            num_state_loads=self._counts["loads"],
            num_splits=self._counts["splits"],
            bytes_sent=self._counts["bytes"],
            num_peers=view.num_peers,
            samples_per_second=self._rate,
            num_rounds_not_agreed=self._counts["not_agreed"],
            num_rounds_without_group=self._counts["no_group"],
            round_seconds=self._round_seconds,
            reducer_spread=self._reducer_spread,
            round_latency=self._round_latency.snapshot(),
        )

    def close(self) -> None:
        """Stop publishing progress and leave the swarm (the DHT stays open)."""
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            self._stop.set()
            self._wake.set()
            # A publish still in flight would outlive us, and maybe the DHT under it.
            await self._tasks.close(CANCEL_TIMEOUT_SECONDS)
            await self._averager.__aexit__(None, None, None)

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
