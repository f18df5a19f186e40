"""One peer training a built-in task with the swarm: what ``swarm train``/``swarm join``,
``swarm demo`` and the tests run.

The peer trains until the swarm has taken ``num_samples / target_batch_size`` global
steps (global samples, whoever processed them), then evaluates and returns a summary.
Its data is its slot of each global batch (:mod:`swarm.shares`): the batch of global
step ``t`` is what a single process takes at step ``t``, the live peers divide it by
their identities, and no peer needs a rank or the size of the swarm.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from averaging import REDUCERS_PER_PART, CenteredClipConfig
from peers.dht import BlockingDHT, DHTConfig
from peers.identity import KeyPair, PeerID
from swarm.checkpoint import read_state, write_state
from swarm.collaborative.config import CollaborativeConfig, DiLoCoConfig, OptimizerStatistics
from swarm.collaborative.optimizer import CollaborativeOptimizer
from swarm.collaborative.progress import MAX_EXPECTED_PEERS
from swarm.collaborative.state import pack_state, unpack_state
from swarm.errors import CheckpointError, TaskError
from swarm.join_config import JoinConfig
from swarm.metrics import (
    SCRAPE_TIMEOUT,
    MetricsServer,
    TrainingSnapshot,
    as_coroutine,
    dht_families,
    peer_families,
)
from swarm.optim_spec import OptimizerSpec
from swarm.shares import Slot, my_slot, share_order, takeover_slots
from swarm.status import (
    RunBoard,
    StatusSources,
    publish_status_forever,
)
from swarm.tasks import check_task_name, get_task
from swarm.tasks.base import Recipe, SampleStream, Task, check_seed

logger = logging.getLogger(__name__)

#: Seconds peers started together wait to see each other before their first step: a
#: laptop behind NAT needs its AutoNAT verdict (up to 20 s) and torch's import first.
STARTUP_WAIT_SECONDS = 60.0


@dataclass(frozen=True, kw_only=True)
class TrainerConfig(JoinConfig):
    """What one peer trains, and (the fields of :class:`JoinConfig`) how it joins."""

    task: str = "digits"
    """A built-in task (``digits``, ``charlm``) or your own as ``module:factory``, a
    :class:`swarm.tasks.Task` subclass or a function returning one; every peer of a run
    must be able to import it (:func:`swarm.tasks.get_task`)."""
    run_id: str = "demo"
    """Peers with the same run id (and task) train one model together."""
    run_key: Path | None = None
    """The run operator's key file, created if missing: this peer signs the states it
    serves with it and loads only states signed with it; for the operator's own peers
    (``CollaborativeConfig.run_key``)."""
    trusted_run_keys: frozenset[PeerID] = frozenset()
    """Load only states signed by these run keys (the operator's run key, by its
    PeerID), from any one peer. Empty: states a quorum of networks offers
    (``CollaborativeConfig.trusted_run_keys``)."""
    num_peers: int = 1
    """Before the run's first step, wait (up to :data:`STARTUP_WAIT_SECONDS` s) until
    this many peers are in the run, for peers started together; 1: start at once. Peers
    joining before the first step wait for as many as any peer of the run asks for."""
    local_batch_size: int = 0
    """At most this many samples per local step (a memory cap); 0: this peer's whole
    slot of each global batch at once."""
    target_batch_size: int = 0
    """Global batch; 0: the task's recipe."""
    num_samples: int = 0
    """Global samples to train for; 0: the task's recipe."""
    seed: int = 0
    """Model initialisation and data order (the same on every peer)."""
    optimizer: OptimizerSpec | None = None
    """The local optimizer; None: the task's recipe."""
    diloco: DiLoCoConfig | None = None
    """DiLoCo mode instead of gradient averaging."""
    centered_clip: bool = False
    """Average with CenteredClip instead of the mean, so that one peer's update moves a
    step by a bounded amount whatever it sends (every peer of the run must set it). The
    spread rule's CenteredClip (``CollaborativeConfig.aggregation``): robust to a
    minority of peers sending poisoned updates."""
    reducers_per_part: int = 1
    """Peers that reduce each coordinate of a round: 3 outvotes one that publishes a
    wrong average of its part, at 3x the traffic (every peer of the run must give the
    same; ``CollaborativeConfig.reducers_per_part``)."""
    checkpoint: Path | None = None
    """Resume from this file if it exists, and save to it after training, when
    interrupted (Ctrl-C, SIGTERM) and every ``checkpoint_every`` epochs."""
    checkpoint_every: int = 0
    """Also save the checkpoint after every this many epochs (0: only at the end and
    when interrupted)."""
    eval_every: int = 0
    """Evaluate the model on the task's test set after every this many epochs (global
    steps; outer steps in DiLoCo mode) and report it, a loss curve (0: only the final
    model). Evaluating pauses this peer's training (in gradient mode the swarm's step
    waits for it); ``TrainResult.train_seconds`` leaves that time out."""
    slow_peer_seconds: float = 30.0
    """Patience with a member that publishes progress but delivered nothing to an epoch
    (slow, or stuck in a state download): once this peer has done its slot, it fills
    such a member's slot only after this long. A member that used it up once gets none
    until it delivers again: a peer that holds a slot and never trains costs the swarm
    one wait, not one per step."""
    collaborative: dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`CollaborativeConfig` fields (e.g. timeouts, in tests)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_task_name(self.task)
        if not isinstance(self.num_peers, int) or self.num_peers < 1:
            raise TaskError(f"num_peers must be >= 1, got {self.num_peers!r}")
        if self.num_peers > MAX_EXPECTED_PEERS:
            raise TaskError(f"num_peers must be <= {MAX_EXPECTED_PEERS}, got {self.num_peers}")
        for name in ("local_batch_size", "target_batch_size", "num_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TaskError(f"{name} must be >= 0 (0: the default), got {value!r}")
        check_seed(self.seed)
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise TaskError(f"checkpoint_every must be >= 0, got {self.checkpoint_every!r}")
        if not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise TaskError(f"eval_every must be >= 0, got {self.eval_every!r}")
        if self.checkpoint_every and self.checkpoint is None:
            raise TaskError("checkpoint_every needs a checkpoint path")
        if self.checkpoint is not None:
            _check_checkpoint_path(self.checkpoint)
        if self.allowed_peers is not None and not self.initial_peers:
            raise TaskError(
                "a private swarm cannot start from a bootstrap peer hosted here (its PeerID "
                "is new each run, so no allow-list names it): start one with `swarm "
                "bootstrap --identity KEY --allow ...` and give its address as initial peers"
            )
        # the run id, DiLoCo settings and overrides are checked where they are used
        slow = self.slow_peer_seconds
        if isinstance(slow, bool) or not isinstance(slow, int | float) or not 0 <= slow < math.inf:
            raise TaskError(f"slow_peer_seconds must be >= 0 seconds, got {slow!r}")
        if not isinstance(self.centered_clip, bool):
            raise TaskError(f"centered_clip must be a bool, got {self.centered_clip!r}")
        if self.reducers_per_part not in REDUCERS_PER_PART:
            raise TaskError(
                f"reducers_per_part must be one of {REDUCERS_PER_PART}, "
                f"got {self.reducers_per_part!r}"
            )
        CollaborativeConfig(
            run_id=self.run_id,
            target_batch_size=1,
            diloco=self.diloco,
            **_aggregation(self),
            **self.collaborative,
        )


def _export_metrics(
    metrics: MetricsServer, dht: BlockingDHT, on_step: ProgressCallback | None
) -> ProgressCallback:
    """Give ``metrics`` this peer's host, DHT and training progress; the step callback
    that also publishes each step to it."""
    node = dht.node
    metrics.add_loop_source(
        lambda snapshot: dht.peer.run(as_coroutine(snapshot), timeout=SCRAPE_TIMEOUT),
        lambda: peer_families(node.peer.statistics()) + dht_families(node.statistics()),
    )
    snapshot = TrainingSnapshot()
    metrics.add_source(snapshot.families)

    def step(stats: OptimizerStatistics, loss: float) -> None:
        snapshot.publish(stats, loss)
        if on_step is not None:
            on_step(stats, loss)

    return step


def _publish_status(
    dht: BlockingDHT, config: TrainerConfig, on_step: ProgressCallback | None
) -> tuple[ProgressCallback, concurrent.futures.Future[None]]:
    """Start publishing this peer's status record (cancel the future to stop); the step
    callback that also records each step's progress in it."""
    board = RunBoard()
    publisher = dht.peer.submit(
        publish_status_forever(dht.node, StatusSources(runs=board.runs), config.status_interval)
    )

    def step(stats: OptimizerStatistics, loss: float) -> None:
        board.update(config.run_id, stats, loss)
        if on_step is not None:
            on_step(stats, loss)

    return step, publisher


def _aggregation(config: TrainerConfig) -> dict[str, Any]:
    """``centered_clip`` as the CollaborativeConfig field it stands for (unless the
    overrides set that field themselves)."""
    chosen: dict[str, Any] = {}
    if config.centered_clip and "aggregation" not in config.collaborative:
        chosen["aggregation"] = CenteredClipConfig()
    if config.reducers_per_part != 1 and "reducers_per_part" not in config.collaborative:
        chosen["reducers_per_part"] = config.reducers_per_part
    return chosen


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The sizes a :class:`TrainerConfig` resolves to (defaults filled in)."""

    target_batch_size: int
    local_batch_size: int
    """0: a peer's whole slot of each global batch at once."""
    num_samples: int
    total_epochs: int
    """Global steps (outer steps in DiLoCo mode) after which peers stop."""
    samples_per_epoch: int
    """Global samples one epoch stands for: the global batch, or in DiLoCo mode
    ``inner_steps`` global batches (every peer takes its slot of each)."""


def plan_run(config: TrainerConfig, recipe: Recipe) -> RunPlan:
    """Resolve ``config``'s defaults from its task's ``recipe``."""
    target = config.target_batch_size or recipe.batch_size
    num_samples = config.num_samples or recipe.num_samples
    inner_steps = 1 if config.diloco is None else config.diloco.inner_steps
    per_epoch = target * inner_steps
    return RunPlan(
        target_batch_size=target,
        local_batch_size=config.local_batch_size,
        num_samples=num_samples,
        total_epochs=max(1, num_samples // per_epoch),
        samples_per_epoch=per_epoch,
    )


@dataclass(frozen=True, slots=True)
class TrainResult:
    """How one peer's training ended."""

    metrics: dict[str, float]
    """The task's evaluation of the final model (loss, and accuracy or bits per char)."""
    epochs: int
    global_samples: int
    seconds: float
    statistics: OptimizerStatistics
    final_loss: float
    train_seconds: float = 0.0
    """Seconds from this peer's first training step to its last: ``seconds`` without
    joining, waiting for the run's peers and loading state, and without evaluations
    (``eval_seconds``)."""
    eval_curve: tuple[Evaluation, ...] = ()
    """With ``TrainerConfig.eval_every``: the model's test metrics every that many
    epochs, and at the end."""
    eval_seconds: float = 0.0
    """Spent evaluating during training (``eval_curve`` but its last point)."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One point of a loss curve: the model's test metrics after ``epoch`` epochs,
    ``train_seconds`` of this peer's training (evaluations left out) from its first step."""

    epoch: int
    train_seconds: float
    metrics: dict[str, float]


ProgressCallback = Callable[[OptimizerStatistics, float], None]
EvalCallback = Callable[[Evaluation], None]


def train(
    config: TrainerConfig,
    on_step: ProgressCallback | None = None,
    on_network: Callable[[str], None] | None = None,
    metrics: MetricsServer | None = None,
    on_eval: EvalCallback | None = None,
) -> TrainResult:
    """Join (or start) the swarm and train; see the module docstring. ``on_network``
    hears a line about how this peer is connected (behind NAT, relays, hole punching)
    whenever that changes, looked at most every :data:`NETWORK_REPORT_SECONDS`.
    ``metrics`` gets this peer's connections, DHT and training progress as sources.
    ``on_eval`` hears each evaluation of ``config.eval_every``, the final one included."""
    task = get_task(config.task)
    recipe = task.recipe
    plan = plan_run(config, recipe)
    target, total_epochs = plan.target_batch_size, plan.total_epochs
    num_samples = plan.num_samples
    model = task.make_model(config.seed)
    model.train()
    inner = (config.optimizer or recipe.optimizer).build(model.parameters())
    params: list[torch.Tensor] = list(model.parameters())
    start_epoch = _resume(config.checkpoint, params, inner)
    if start_epoch and on_network is not None:
        on_network(f"resumed from {config.checkpoint} at epoch {start_epoch}")
    dht = BlockingDHT(
        config=DHTConfig(initial_peers=config.initial_peers),
        peer_config=config.peer_config(),
    )
    started = time.monotonic()
    publisher: concurrent.futures.Future[None] | None = None
    try:  # (from here on, whatever fails leaves nothing running)
        collaborative = CollaborativeConfig(
            run_id=config.run_id,
            target_batch_size=target,
            diloco=config.diloco,
            run_key=KeyPair.load_or_create(config.run_key) if config.run_key else None,
            trusted_run_keys=config.trusted_run_keys,
            **_aggregation(config),
            **config.collaborative,
        )
        if metrics is not None:
            on_step = _export_metrics(metrics, dht, on_step)
        on_step, publisher = _publish_status(dht, config, on_step)
        _wait_for_reachability(dht)
        with CollaborativeOptimizer(inner, dht, collaborative) as opt:
            opt.epoch = start_epoch
            loaded = opt.load_state_from_peers()
            if not loaded and opt.epoch == 0:
                opt.wait_for_peers(config.num_peers, timeout=STARTUP_WAIT_SECONDS)
                loaded = opt.load_state_from_peers()  # one may have stepped meanwhile
            if loaded and on_network is not None:
                signed = " (signed by the run key)" if collaborative.run_keys() else ""
                on_network(f"loaded the swarm's state{signed} at epoch {opt.epoch}")
            stream = SampleStream(task.num_train, config.seed)
            dealer = _Dealer(opt, config.run_id, plan, config.slow_peer_seconds)
            loss_value = math.nan
            network = _NetworkReport(dht, on_network)
            saved = opt.epoch
            first_step = time.monotonic()
            curve = _Curve(task, model, config.eval_every, first_step, on_eval)
            curve.evaluated = opt.epoch
            with _Interrupts() as interrupts:
                try:
                    while opt.phase < total_epochs:
                        interrupts.check()
                        network.maybe_report()
                        curve.maybe_evaluate(opt.epoch)
                        slot = dealer.next_slot()
                        if slot is None:  # our part is done: the others are still on theirs
                            opt.wait()
                            if on_step is not None:  # the epoch may have moved on meanwhile
                                on_step(opt.statistics(), loss_value)
                            continue
                        loss = task.loss(
                            model, task.examples(stream.indices(slot.start, slot.stop))
                        )
                        loss.backward()  # type: ignore[no-untyped-call]
                        loss_value = loss.item()
                        opt.step(slot.size)
                        if on_step is not None:
                            on_step(opt.statistics(), loss_value)
                        every = config.checkpoint_every
                        if every and opt.epoch != saved and opt.epoch % every == 0:
                            _save(config.checkpoint, params, inner, opt.epoch)
                            saved = opt.epoch
                except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what was trained
                    _save(config.checkpoint, params, inner, opt.epoch)
                    if config.checkpoint is not None:
                        logger.warning(
                            "interrupted: saved %s at epoch %d", config.checkpoint, opt.epoch
                        )
                    raise
            if opt.epoch < total_epochs:  # (overlap: a round applied at the last step)
                curve.maybe_evaluate(opt.epoch)
            opt.finish_round()  # (overlap: the last outer step's round is part of training)
            train_seconds = time.monotonic() - first_step - curve.seconds
            if opt.epoch >= total_epochs:
                opt.finish()  # a peer whose last round failed can still load the end
            stats = opt.statistics()
            _save(config.checkpoint, params, inner, opt.epoch)
    finally:
        if publisher is not None:
            publisher.cancel()
        dht.close()
    final = task.evaluate(model)
    if config.eval_every:
        curve.add(Evaluation(stats.epoch, train_seconds, final))
    return TrainResult(
        metrics=final,
        epochs=stats.epoch,
        global_samples=num_samples if stats.epoch >= total_epochs else stats.epoch * target,
        seconds=time.monotonic() - started,
        statistics=stats,
        final_loss=loss_value,
        train_seconds=train_seconds,
        eval_curve=tuple(curve.points),
        eval_seconds=curve.seconds,
    )


class _Curve:
    """``TrainerConfig.eval_every``'s evaluations, timed apart from training."""

    def __init__(
        self,
        task: Task,
        model: torch.nn.Module,
        every: int,
        first_step: float,
        on_eval: EvalCallback | None,
    ) -> None:
        self._task, self._model, self._every = task, model, every
        self._first_step, self._on_eval = first_step, on_eval
        self.evaluated = 0
        """The last epoch evaluated (or started from)."""
        self.seconds = 0.0
        self.points: list[Evaluation] = []

    def maybe_evaluate(self, epoch: int) -> None:
        """Evaluate if ``epoch`` is new and a multiple of ``every``."""
        if not self._every or epoch == self.evaluated or epoch % self._every:
            return
        self.evaluated = epoch
        began = time.monotonic()
        metrics = self._task.evaluate(self._model)
        trained = began - self._first_step - self.seconds
        self.seconds += time.monotonic() - began
        self.add(Evaluation(epoch, trained, metrics))

    def add(self, point: Evaluation) -> None:
        self.points.append(point)
        if self._on_eval is not None:
            self._on_eval(point)


#: A member whose progress record is this fresh is alive and busy with its slot.
LIVE_RECORD_SECONDS = 2.0


class DealerView(Protocol):
    """What the dealer reads of the optimizer: :class:`CollaborativeOptimizer`, or its
    async driver (``swarm.collaborative.driver``) in in-memory tests."""

    @property
    def config(self) -> CollaborativeConfig: ...
    @property
    def dht(self) -> Any: ...
    @property
    def epoch(self) -> int: ...
    @property
    def phase(self) -> int: ...
    @property
    def inner_step(self) -> int: ...
    @property
    def accumulated(self) -> int: ...
    def members(self) -> list[PeerID]: ...
    def delivered(self) -> set[PeerID]: ...
    def working(self, within: float) -> set[PeerID]: ...


class _Dealer:
    """Which samples this peer trains on next (see :mod:`swarm.shares`).

    Gradient mode: at the start of each epoch, this peer's slot of the global batch
    among the members it sees (in pieces of at most ``local_batch_size``); once that is
    done and the swarm has not stepped within ``max_wait_seconds``, the slots it is to
    fill for members that delivered nothing and stopped publishing (a dead peer; after
    ``slow_peer_seconds``, any that delivered nothing; at once, one that used up that
    patience before and has delivered nothing since): each such slot is filled by one
    member, the nearest before it in the epoch's order that delivered; past twice the
    patience with the batch still short, by this peer; then nothing (``None``: wait).
    DiLoCo mode: its slot of global step ``phase * inner_steps + inner_step`` each local
    step (``phase``: the epoch, or the next while an overlapped round is in flight)."""

    def __init__(
        self,
        opt: DealerView,
        run_id: str,
        plan: RunPlan,
        patience: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._opt = opt
        self._clock = clock
        self._patience = patience
        self._slow: set[PeerID] = set()  # used up our patience; none until they deliver
        self._run_id = run_id
        self._plan = plan
        self._me = opt.dht.peer.peer_id
        self._epoch = -1
        self._order: list[PeerID] = []
        self._pending: list[Slot] = []
        self._taken: set[PeerID] = set()
        self._done_at = 0.0

    def next_slot(self) -> Slot | None:
        opt, target = self._opt, self._plan.target_batch_size
        if opt.config.diloco is not None:
            step = opt.phase * opt.config.diloco.inner_steps + opt.inner_step
            return my_slot(share_order(opt.members(), self._run_id, step), self._me, step, target)
        if opt.epoch != self._epoch or (not self._pending and not opt.accumulated):
            # a new epoch, or our samples were dropped (a resync): deal this epoch afresh
            self._epoch = opt.epoch
            self._order = share_order(opt.members(), self._run_id, opt.epoch)
            self._pending = self._pieces(my_slot(self._order, self._me, opt.epoch, target))
            self._taken = {self._me}
            self._done_at = 0.0
        elif not self._pending:
            now = self._clock()
            self._done_at = self._done_at or now
            waited = now - self._done_at
            delivered = opt.delivered()
            self._slow -= delivered  # it delivered (again): patience, as for anyone
            delivered |= self._taken
            if waited < self._patience:
                # a member still publishing is slow, not gone: its slot stays its own
                delivered |= opt.working(within=LIVE_RECORD_SECONDS) - self._slow
            else:
                self._slow |= set(self._order) - delivered
            # Peers deal an epoch among the members each of them sees, and views differ
            # (a record read late, or expired on a loaded machine): a member that dealt
            # among fewer never fills a slot our view left to it, and the batch would
            # stay short forever. Past twice the patience, every unfilled slot is ours.
            last_resort = waited >= 2 * self._patience
            taken = takeover_slots(
                self._order, self._me, delivered, opt.epoch, target, every_one=last_resort
            )
            for peer, slot in taken.items():
                self._pending += self._pieces(slot)
                self._taken.add(peer)
            if taken:
                logger.info(
                    "epoch %d: taking the slots of %d peers that delivered nothing in time%s",
                    opt.epoch,
                    len(taken),
                    f" (the batch still short {waited:.0f} s after ours)" if last_resort else "",
                )
        return self._pending.pop(0) if self._pending else None

    def _pieces(self, slot: Slot) -> list[Slot]:
        return slot.chunks(self._plan.local_batch_size)


#: Seconds between two looks at how we are connected (a cross-thread call each).
NETWORK_REPORT_SECONDS = 5.0
#: Longest wait for AutoNAT's verdict before the first round: a dial-back to an
#: address behind NAT takes its whole 5 s timeout, servers are asked at once, and a
#: loaded machine or a slow link may need a few rounds of that.
REACHABILITY_WAIT_SECONDS = 20.0


def _wait_for_reachability(dht: BlockingDHT) -> None:
    """Before training, learn whether others can dial us (if that is being found out):
    a peer behind NAT that joined a round before knowing it would offer the swarm an
    address nobody can dial, and its rounds would fail until the verdict came."""
    facade = dht.peer

    async def wait() -> None:
        nat = facade.peer.nat
        if nat.active:
            await nat.wait_for_verdict(REACHABILITY_WAIT_SECONDS)

    facade.run(wait(), timeout=REACHABILITY_WAIT_SECONDS + 5.0)


class _NetworkReport:
    """Tells ``callback`` how we are connected when that changes (see :func:`train`)."""

    def __init__(self, dht: BlockingDHT, callback: Callable[[str], None] | None) -> None:
        self._dht = dht
        self._callback = callback
        self._last = ""
        self._next = 0.0

    def maybe_report(self) -> None:
        now = time.monotonic()
        if self._callback is None or now < self._next:
            return
        self._next = now + NETWORK_REPORT_SECONDS
        facade = self._dht.peer

        async def describe() -> str:
            nat = facade.peer.nat
            return nat.describe() if nat.active else ""

        text = facade.run(describe(), timeout=NETWORK_REPORT_SECONDS)
        if text and text != self._last:
            self._last = text
            self._callback(text)


def _check_checkpoint_path(path: Path) -> None:
    """A checkpoint path that cannot be written is found at start, not after the run."""
    directory = path.absolute().parent
    if not directory.is_dir():
        raise TaskError(f"checkpoint {path}: directory {directory} does not exist; create it")
    if path.is_dir():
        raise TaskError(f"checkpoint {path} is a directory; give a file path")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise TaskError(f"checkpoint {path}: cannot write in {directory}; give another path")


def _resume(path: Path | None, params: list[torch.Tensor], inner: torch.optim.Optimizer) -> int:
    if path is None or not path.exists():
        return 0
    try:
        state = read_state(path)
        counters = unpack_state(state["tensors"], state["metadata"], params, {"inner": inner})
    except (CheckpointError, KeyError, TypeError) as e:
        raise CheckpointError(f"cannot resume from {path}: {e}") from e
    logger.info("resumed from %s at epoch %s", path, counters["epoch"])
    return int(counters["epoch"])


def _save(
    path: Path | None, params: list[torch.Tensor], inner: torch.optim.Optimizer, epoch: int
) -> None:
    if path is None:
        return
    tensors, metadata = pack_state(params, {"inner": inner}, {"epoch": epoch})
    write_state(path, {"tensors": tensors, "metadata": metadata})


class _Interrupts:
    """Ctrl-C and SIGTERM during the training loop (in the main thread): the first stops
    it at the next batch, so that a step is never cut in half and the checkpoint holds
    whole epochs (an interrupt between applying an update and counting its epoch saved
    one epoch's parameters under the epoch before); a second raises at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self) -> None:
        """Raise KeyboardInterrupt if an interrupt was asked for."""
        if self.requested:
            raise KeyboardInterrupt
