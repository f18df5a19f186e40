"""One peer training a built-in task with the swarm: what ``swarm train``/``swarm join``,
``swarm demo`` and the tests run.

The peer trains until the swarm has taken ``num_samples / target_batch_size`` global
steps (global samples, whoever processed them), then evaluates and returns a summary.
Its data is its own shard of the task's sample stream (``rank`` of ``num_peers``), so
peers never train on the same examples within an epoch.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peers.config import PeerConfig
from peers.dht import BlockingDHT, DHTConfig
from swarm.checkpoint import read_state, write_state
from swarm.errors import CheckpointError, TaskError
from swarm.optim_spec import OptimizerSpec
from swarm.optimizer import CollaborativeOptimizer
from swarm.optimizer_config import CollaborativeConfig, DiLoCoConfig, OptimizerStatistics
from swarm.tasks import TASKS, get_task
from swarm.tasks.base import Recipe, check_seed
from swarm.training_state import pack_state, unpack_state

logger = logging.getLogger(__name__)

#: Seconds peers started together wait to see each other before their first step.
STARTUP_WAIT_SECONDS = 30.0


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """What one peer trains and how it joins."""

    task: str = "digits"
    """A built-in task (``swarm.tasks.TASKS``)."""
    run_id: str = "demo"
    """Peers with the same run id (and task) train one model together."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the swarm; empty: this peer starts the swarm."""
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    """Where this peer listens (empty: client mode, dials out only)."""
    announce: tuple[str, ...] = ()
    """Addresses to announce instead of the bound ones (a port-forwarded machine)."""
    reachability: str = "auto"
    """``auto`` (find out with AutoNAT), ``public`` or ``private``: see peers.PeerConfig."""
    relay: bool = True
    """Serve as a relay while public and use relays while private (``--no-relay``: no)."""
    rank: int = 0
    """Which shard of the sample stream this peer trains on (``0 <= rank < num_peers``)."""
    num_peers: int = 1
    """Shards the sample stream is dealt into (the swarm's expected size)."""
    local_batch_size: int = 0
    """Samples per local step; 0: the task's global batch divided by ``num_peers``."""
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
    checkpoint: Path | None = None
    """Resume from this file if it exists, and save to it after training."""
    collaborative: dict[str, Any] = field(default_factory=dict)
    """Overrides of :class:`CollaborativeConfig` fields (e.g. timeouts, in tests)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise TaskError(
                f"unknown task {self.task!r}; built-in tasks: {', '.join(sorted(TASKS))}"
            )
        if not isinstance(self.num_peers, int) or self.num_peers < 1:
            raise TaskError(f"num_peers must be >= 1, got {self.num_peers!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.num_peers:
            raise TaskError(f"rank must be in [0, {self.num_peers}), got {self.rank!r}")
        for name in ("local_batch_size", "target_batch_size", "num_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise TaskError(f"{name} must be >= 0 (0: the default), got {value!r}")
        check_seed(self.seed)
        # the run id, DiLoCo settings and overrides are checked where they are used
        CollaborativeConfig(
            run_id=self.run_id, target_batch_size=1, diloco=self.diloco, **self.collaborative
        )


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The sizes a :class:`TrainerConfig` resolves to (defaults filled in)."""

    target_batch_size: int
    local_batch_size: int
    num_samples: int
    total_epochs: int
    """Global steps (outer steps in DiLoCo mode) after which peers stop."""
    samples_per_epoch: int
    """Global samples one epoch stands for: the global batch, or in DiLoCo mode every
    peer's ``inner_steps`` local batches."""


def plan_run(config: TrainerConfig, recipe: Recipe) -> RunPlan:
    """Resolve ``config``'s defaults from its task's ``recipe``."""
    target = config.target_batch_size or recipe.batch_size
    local_batch = config.local_batch_size or max(1, target // config.num_peers)
    num_samples = config.num_samples or recipe.num_samples
    if config.diloco is None:
        per_epoch = target
    else:  # outer steps: every peer takes inner_steps local batches per outer step
        per_epoch = local_batch * config.num_peers * config.diloco.inner_steps
    return RunPlan(
        target_batch_size=target,
        local_batch_size=local_batch,
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


ProgressCallback = Callable[[OptimizerStatistics, float], None]


def train(
    config: TrainerConfig,
    on_step: ProgressCallback | None = None,
    on_network: Callable[[str], None] | None = None,
) -> TrainResult:
    """Join (or start) the swarm and train; see the module docstring. ``on_network``
    hears a line about how this peer is connected (behind NAT, relays, hole punching)
    whenever that changes, looked at most every :data:`NETWORK_REPORT_SECONDS`."""
    task = get_task(config.task)
    recipe = task.recipe
    plan = plan_run(config, recipe)
    target, local_batch, total_epochs = (
        plan.target_batch_size,
        plan.local_batch_size,
        plan.total_epochs,
    )
    num_samples = plan.num_samples
    model = task.make_model(config.seed)
    model.train()
    inner = (config.optimizer or recipe.optimizer).build(model.parameters())
    params: list[torch.Tensor] = list(model.parameters())
    start_epoch = _resume(config.checkpoint, params, inner)
    dht = BlockingDHT(
        config=DHTConfig(initial_peers=config.initial_peers),
        peer_config=PeerConfig(
            listen_addrs=config.listen,
            announce_addrs=config.announce,
            reachability=config.reachability,
            relay_service=config.relay,
            use_relays=config.relay,
        ),
    )
    collaborative = CollaborativeConfig(
        run_id=config.run_id,
        target_batch_size=target,
        diloco=config.diloco,
        **config.collaborative,
    )
    started = time.monotonic()
    try:
        _wait_for_reachability(dht)
        with CollaborativeOptimizer(inner, dht, collaborative) as opt:
            opt.epoch = start_epoch
            if not opt.load_state_from_peers() and config.num_peers > 1:
                opt.wait_for_peers(config.num_peers, timeout=STARTUP_WAIT_SECONDS)
                opt.load_state_from_peers()  # one may have stepped meanwhile
            batches = task.batches(
                config.rank, config.num_peers, local_batch, config.seed, start_step=opt.epoch
            )
            loss_value = math.nan
            network = _NetworkReport(dht, on_network)
            for batch in itertools.takewhile(lambda _: opt.epoch < total_epochs, batches):
                network.maybe_report()
                loss = task.loss(model, batch)
                loss.backward()  # type: ignore[no-untyped-call]
                loss_value = loss.item()
                opt.step(local_batch)
                if on_step is not None:
                    on_step(opt.statistics(), loss_value)
            stats = opt.statistics()
            _save(config.checkpoint, params, inner, opt.epoch)
    finally:
        dht.close()
    return TrainResult(
        metrics=task.evaluate(model),
        epochs=stats.epoch,
        global_samples=num_samples if stats.epoch >= total_epochs else stats.epoch * target,
        seconds=time.monotonic() - started,
        statistics=stats,
        final_loss=loss_value,
    )


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
