"""The hivemind side of the collaborative-training benchmark: one training peer per process.

``python _hivemind_train.py OPTIONS_JSON`` starts a ``hivemind.DHT`` (which forks its DHT
process and a Go ``p2pd``), builds one of our built-in tasks (``digits``, ``charlm``) and
trains it with ``hivemind.Optimizer`` (hivemind 1.1.12), next to the same task trained
by our ``swarm train`` peers. It prints JSON lines on stdout and reads JSON commands on
stdin; times are ``time.monotonic()`` (one clock for every process on the host,
network namespaces included), as in ``_allreduce_peers.py``.

What it trains, and on what
---------------------------

The task's own model, initialised from ``seed`` (:meth:`swarm.tasks.Task.make_model`:
every peer starts from the same parameters), and the task recipe's optimizer
(:class:`swarm.optim_spec.OptimizerSpec`, built by its own ``build`` inside hivemind's
optimizer factory). The data: the ``k``-th micro-batch this peer computes is its
``rank``-th slice of global step ``k`` of the baseline's stream
(:meth:`swarm.tasks.Task.batches` with ``num_peers`` peers of ``batch_size_per_step``),
so the peers' batches never overlap, and ``num_peers`` peers that have each computed
``k`` micro-batches have together computed the first ``k`` batches of a single process
with ``num_peers * batch_size_per_step``. Unlike our peers, hivemind peers do not divide
a fixed global batch: each keeps computing micro-batches until its progress tracker
says the swarm has ``target_batch_size`` samples (see "How hivemind counts").

Modes (``mode``)
----------------

- ``gradient``: ``hivemind.Optimizer(use_local_updates=False)``, hivemind's default and
  the counterpart of our gradient-averaging mode: each peer accumulates gradients over
  its micro-batches until the swarm has ``target_batch_size`` samples, all-reduces them
  (weighted by samples), and every peer takes the same optimizer step (its optimizer
  offloaded to a shared-memory copy of the parameters, hivemind's default here). On top
  of that, hivemind averages the parameters every ``average_state_every`` epochs (1, its
  default) in a background round, which our gradient mode does not do: it costs a second
  round per epoch, and as it overlaps the next optimizer step, peers have been seen to
  end a run with different models. ``delayed_updates`` turns on hivemind's delayed
  parameter updates (``delay_optimizer_step`` and ``delay_grad_averaging``: the round
  and the step overlap the next epoch's compute, one step stale).
- ``local``: ``hivemind.Optimizer(use_local_updates=True)``, the closest hivemind has to
  our DiLoCo mode. Each peer steps its own optimizer on every micro-batch, and each
  time the swarm has processed ``target_batch_size * inner_steps`` samples (a hivemind
  epoch) the peers average their parameters in a background round (delta rule: the
  round's change is added to parameters that kept training meanwhile; in hivemind 1.1.12
  the next local step already waits for that round, so only one micro-batch overlaps
  it). What it is not: there is no outer optimizer (it is DiLoCo with outer SGD at
  learning rate 1 and no momentum, where ours uses Nesterov momentum on the averaged
  change), the period is counted in the swarm's samples, not in local steps (a fast peer
  takes more local steps per period than a slow one), the inner optimizers' statistics
  are not averaged (hivemind's ``average_opt_statistics`` is left empty, as ours keeps
  them local), and parameters travel as ``compression`` says (``none`` by default; ours
  sends the change as float16 by default).

Each mode runs until hivemind's ``local_epoch`` reaches the run's epochs,
``max(1, num_samples // (target_batch_size * inner_steps))`` (``inner_steps`` is 1 in
gradient mode), as our trainer's ``plan_run`` counts them. Other differences from
ours: hivemind initialises the optimizer's state with a step on zero gradients (Adam's
step count starts at 1, so its first updates are about 0.74 of the usual size), and
``matchmaking`` settings reach its gradient averager only through a factory (1.1.12
gives ``averager_opts`` to its state averager alone).

How hivemind counts
-------------------

A hivemind epoch ends when a peer's view of the swarm's samples reaches
``target_batch_size``: the total it last fetched from the DHT (at most every
``min_refresh_period``, 0.5 s, up to 10 s when the epoch seems far; reset to nothing at
each epoch's start) plus its own samples since, or when its estimate of when the swarm
gets there (from each peer's reported samples per second) has passed. So when a peer
computes ``target_batch_size`` samples faster than its tracker refreshes, every peer
computes a whole ``target_batch_size`` per epoch by itself: the swarm's epochs hold
``num_peers`` times the global batch (measured on loopback with 4 peers: 4.0x for
digits and charlm at the recipe's batch in gradient mode, 1.4x in local mode with 4
global batches per epoch). ``trained`` reports the samples this peer computed
(``local_samples``): their sum over peers divided by the epochs is the effective global
batch. In gradient mode with equal peers and 4x, the run is the baseline's with a 4x
batch (digits, 20 epochs: the same test loss to 7 digits).

hivemind publishes a peer's progress only once it has samples, so peers started together
would each see no one at first and race through epochs alone. With ``wait_for_peers``
(the default) each peer reports one phantom sample, waits until its tracker sees
``num_peers`` peers (``peers_timeout``) and takes it back, before ``ready``.

Options (``OPTIONS_JSON``, every key optional)
-----------------------------------------------

``task`` ("digits"), ``mode`` ("gradient" | "local"), ``initial_peers`` (multiaddrs;
[] for the first peer), ``host`` (the address to listen on, "127.0.0.1"), ``rank`` (0),
``num_peers`` (1), ``target_batch_size`` (0: the recipe's), ``batch_size_per_step`` (0:
``target_batch_size // num_peers``), ``num_samples`` (0: the recipe's), ``inner_steps``
(local mode: hivemind epochs of that many global batches; 1), ``seed`` (0), ``run_id``
(the DHT prefix every peer of a run shares; "bench_<task>_<mode>"), ``matchmaking_time``
(5.0 s: hivemind advises 3-5 s on a LAN, 10-15 s over the internet), ``averaging_timeout``
(60.0 s), ``load_state_timeout`` (60.0 s), ``target_group_size`` (0: ``num_peers``, so
a group forms as soon as every peer joined it, as our matchmaking's ``form_when_full``;
-1: hivemind's default, no limit: a group forms when matchmaking time is up, at least
``matchmaking_time`` per round), ``average_state_every`` (1), ``compression`` ("none" |
"float16", for gradients and parameters), ``delayed_updates`` (false), ``tracker_opts``
(numbers for hivemind's ``ProgressTracker``, e.g. ``{"min_refresh_period": 0.5}``; {}),
``eval_every`` (also evaluate every this many epochs, into ``eval_curve``; 0),
``threads`` (torch threads, 1), ``wait_for_peers`` (true), ``join_timeout`` (300 s),
``peers_timeout`` (300 s), ``command_timeout`` (seconds to wait for each command, 3600),
``train_timeout`` (seconds from ``start_at`` until the run's last epoch, 3600). An
unknown key or a bad value: a message on stderr and exit status 2.

Events (stdout) and commands (stdin)
------------------------------------

1. ``{"event": "joined", "join_s": s, "addrs": [...]}`` once its DHT is up: the parent
   starts the next peer with these addresses among its ``initial_peers`` (p2pd's DHT
   ignores 198.18.0.0/15 addresses, so in the namespace lab each peer must be given
   every earlier peer's, as ``bench_allreduce.measure_hivemind`` does).
2. ``{"event": "ready", "setup_s": s, "peers_wait_s": s, "epochs": n,
   "target_batch_size": hivemind's, "batch_size_per_step": b, "num_parameters": p,
   ...}`` once the task, model and ``hivemind.Optimizer`` (its averager processes) are up
   and, with ``wait_for_peers``, every peer is seen: start every peer before waiting for
   any ``ready``. Or ``{"event": "ready", "error": ...}``, and the process exits.
3. ``{"op": "train", "start_at": t}`` (``time.monotonic()``) -> wait until ``start_at``,
   train, then ``{"event": "trained", "epochs": n, "local_samples": s, "micro_steps": m,
   "train_seconds": s, "samples_per_second": r, "started_late_s": s, "final_sync_s": s,
   "metrics": {...}, "loss_curve": [[seconds, epoch, train_loss], ...], "eval_curve":
   [[seconds, epoch, {...}], ...], "eval_seconds": s, "params_digest": hex,
   "params_norm": x, "state_loads": n, "hivemind": {...}}``; or the same event with
   ``"error"`` (and what was done). ``metrics`` are the task's evaluation of the final
   model (the baseline's names: loss and accuracy, or loss, bits_per_char and accuracy);
   each ``loss_curve`` row is written when an epoch ends: seconds since ``start_at``, the
   epochs done, and the mean training loss of this peer's micro-batches since the
   previous row (before their updates). ``train_seconds`` runs from ``start_at`` until
   the run's last epoch is done and its last background round applied (``final_sync_s``
   of it), evaluations (``eval_seconds``) included; an ``eval_curve`` row's seconds are
   of training, the evaluations before it left out. ``params_digest`` is bitwise
   (hivemind's all-reduce leaves peers a rounding error apart); ``params_norm`` compares
   peers' models to that. ``hivemind`` counts what hivemind's optimizer logged: rounds
   and their group sizes, rounds that failed, falls back to local gradients, state
   downloads (a round with parts missing only shows as a warning on stderr).
4. After ``trained`` the peer stays up (its DHT and averagers serve peers still
   finishing, or downloading its state) until ``{"op": "exit"}`` or stdin closes. The
   parent closes every peer's stdin once all reported ``trained``. A second ``train``
   gets a ``trained`` with an error; any other command an ``{"event": "error"}``, and
   the peer exits.

Stdin closing at any time stops the peer: training is abandoned (no ``trained``). On
exit (stdin closed, ``exit``, SIGTERM, an error, a wait past its bound) it shuts
hivemind's optimizer and DHT down, then stops by PID whatever it started that is still
running (the DHT process, ``p2pd``, averager processes), removes ``p2pd``'s socket and
unlinks the shared-memory files hivemind's processes leave in ``/dev/shm``. A training
loop stuck inside hivemind past ``train_timeout + averaging_timeout + 60`` s is reported
(``trained`` with an error) and the process exits after the same clean-up.

Only the standard library (and ``_common``, which needs nothing else) is imported at
module level: the parent does not pay for torch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from _common import (
    P2PD_SOCKET,
    SHARED_MEMORY_DIR,
    descendants,
    pid_command,
    remove_shared_memory_of,
    stop_pids,
)

LOOPBACK = "127.0.0.1"
MODES = ("gradient", "local")
COMPRESSIONS = ("none", "float16")
#: Seconds hivemind's optimizer and DHT get to shut down before their processes are killed.
SHUTDOWN_SECONDS = 20.0
#: Seconds past ``train_timeout`` (and a round's own timeout) after which a training
#: loop stuck inside hivemind (its state download retries forever) is abandoned.
WATCHDOG_GRACE_SECONDS = 60.0
#: Commands a peer answers at most.
MAX_COMMANDS = 1000
STDIN_FD = 0


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# --- options ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Options:
    """What one peer trains and how (the module docstring's "Options")."""

    task: str = "digits"
    mode: str = "gradient"
    initial_peers: tuple[str, ...] = ()
    host: str = LOOPBACK
    rank: int = 0
    num_peers: int = 1
    target_batch_size: int = 0
    batch_size_per_step: int = 0
    num_samples: int = 0
    inner_steps: int = 1
    seed: int = 0
    run_id: str = ""
    matchmaking_time: float = 5.0
    averaging_timeout: float = 60.0
    load_state_timeout: float = 60.0
    target_group_size: int = 0
    average_state_every: int = 1
    compression: str = "none"
    delayed_updates: bool = False
    tracker_opts: tuple[tuple[str, float], ...] = ()
    eval_every: int = 0
    threads: int = 1
    wait_for_peers: bool = True
    join_timeout: float = 300.0
    peers_timeout: float = 300.0
    command_timeout: float = 3600.0
    train_timeout: float = 3600.0

    def __post_init__(self) -> None:
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {MODES}")
        if self.compression not in COMPRESSIONS:
            problems.append(f"compression must be one of {COMPRESSIONS}")
        if not 0 <= self.rank < self.num_peers:
            problems.append(f"need 0 <= rank < num_peers, got {self.rank}, {self.num_peers}")
        for name in ("target_batch_size", "batch_size_per_step", "num_samples", "eval_every"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0 (0: the default)")
        if self.inner_steps < 1 or (self.mode == "gradient" and self.inner_steps != 1):
            problems.append("inner_steps must be >= 1, and 1 in gradient mode")
        if self.target_group_size < -1 or self.target_group_size == 1:
            problems.append("target_group_size must be >= 2, 0 (num_peers) or -1 (no limit)")
        if self.average_state_every < 1 or self.threads < 1:
            problems.append("average_state_every and threads must be >= 1")
        if self.delayed_updates and self.mode != "gradient":
            problems.append("delayed_updates needs gradient mode")
        for name in (
            "matchmaking_time",
            "averaging_timeout",
            "load_state_timeout",
            "join_timeout",
            "peers_timeout",
            "command_timeout",
            "train_timeout",
        ):
            value = getattr(self, name)
            if not 0 < value < math.inf:
                problems.append(f"{name} must be a positive number of seconds")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_json(cls, text: str) -> Options:
        """Options from a JSON object; ``ValueError`` for unknown keys or bad values."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("OPTIONS_JSON must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown options {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            default = known[name].default
            if name == "initial_peers":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ValueError("initial_peers must be a list of multiaddr strings")
                values[name] = tuple(value)
            elif name == "tracker_opts":
                if not isinstance(value, dict) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
                ):
                    raise ValueError("tracker_opts must be an object of numbers")
                values[name] = tuple((str(k), float(v)) for k, v in sorted(value.items()))
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
                values[name] = value
            elif isinstance(default, int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{name} must be an integer, got {value!r}")
                values[name] = value
            elif isinstance(default, float):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{name} must be a number, got {value!r}")
                values[name] = float(value)
            else:
                if not isinstance(value, str):
                    raise ValueError(f"{name} must be a string, got {value!r}")
                values[name] = value
        return cls(**values)


def listen_maddr(host: str) -> str:
    """The multiaddr p2pd listens on: ``host`` (IPv4 or IPv6), any free TCP port."""
    return f"/ip6/{host}/tcp/0" if ":" in host else f"/ip4/{host}/tcp/0"


# --- commands --------------------------------------------------------------------------


def parse_command(line: bytes) -> dict[str, Any]:
    """A command line as a dict (``{"op": "invalid"}`` if it is not a JSON object)."""
    try:
        command = json.loads(line)
    except ValueError:
        return {"op": "invalid", "line": line[:200].decode(errors="replace")}
    return command if isinstance(command, dict) else {"op": "invalid"}


class StdinClosed(Exception):
    """The parent closed our stdin: stop."""


class Commands:
    """JSON commands from stdin, read by a thread so that every wait has a bound and a
    closed stdin is noticed during training."""

    def __init__(self) -> None:
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.closed = threading.Event()
        threading.Thread(target=self._read, name="stdin", daemon=True).start()

    def _read(self) -> None:
        # Straight from the file descriptor: hivemind forks its processes while this
        # thread waits, and a forked child closes ``sys.stdin``, which would wait forever
        # for the buffer's lock that this thread held at the fork.
        pending = b""
        with contextlib.suppress(OSError):
            while True:
                chunk = os.read(STDIN_FD, 1 << 16)
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._queue.put(parse_command(line))
        if pending.strip():
            self._queue.put(parse_command(pending))
        self.closed.set()
        self._queue.put(None)

    def next(self, timeout: float, waiting_for: str) -> dict[str, Any]:
        """The next command; :class:`StdinClosed` at EOF, ``TimeoutError`` (naming
        ``waiting_for``) if none comes within ``timeout`` seconds."""
        try:
            command = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no {waiting_for} command within {timeout:.0f} s") from None
        if command is None:
            self._queue.put(None)
            raise StdinClosed
        return command


# --- hivemind's log, counted ----------------------------------------------------------

#: hivemind loggers whose status lines (INFO with ``verbose=True``) are counted.
COUNTED_LOGGERS = ("hivemind.optim.optimizer", "hivemind.optim.state_averager")
#: (counter, pattern): a line matching the pattern counts once; a group counts sizes.
COUNTED_LINES = (
    ("gradient_rounds", re.compile(r"^Averaged gradients with (\d+) peers")),
    ("gradient_round_failed", re.compile(r"^Averaging gradients failed")),
    ("local_gradients", re.compile(r"^Proceeding with local gradients")),
    ("no_peers", re.compile(r"^Skipped averaging: there are no other peers")),
    ("parameter_rounds", re.compile(r"^Averaged parameters with (\d+) peers")),
    ("parameter_round_failed", re.compile(r"^Averaging failed with")),
    ("background_update_failed", re.compile(r"^Background update failed")),
    ("out_of_sync", re.compile(r"^Peer is out of sync")),
    ("caught_up", re.compile(r"^Catching up with collaboration step")),
)


class HivemindCounter(logging.Handler):
    """Counts hivemind optimizer's status lines; passes on to hivemind's own handler the
    records its ``HIVEMIND_LOGLEVEL`` lets through (warnings by default)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: dict[str, int] = {}
        self.group_sizes: dict[str, dict[str, int]] = {}
        self._lock_counts = threading.Lock()
        parent = logging.getLogger("hivemind")
        self._forward_level = parent.getEffectiveLevel()
        self._forward = list(parent.handlers)

    def install(self) -> None:
        for name in COUNTED_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(min(logging.INFO, self._forward_level))
            logger.propagate = False
            logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            message = record.getMessage()
            for counter, pattern in COUNTED_LINES:
                found = pattern.match(message)
                if found:
                    with self._lock_counts:
                        self.counts[counter] = self.counts.get(counter, 0) + 1
                        if found.groups():
                            sizes = self.group_sizes.setdefault(counter, {})
                            sizes[found.group(1)] = sizes.get(found.group(1), 0) + 1
                    break
        if record.levelno >= self._forward_level:
            for handler in self._forward:
                handler.handle(record)

    def summary(self) -> dict[str, Any]:
        with self._lock_counts:
            return {**self.counts, "group_sizes": json.loads(json.dumps(self.group_sizes))}


# --- the peer --------------------------------------------------------------------------


@dataclass
class Progress:
    """What the training loop has done so far (read by the watchdog too)."""

    micro_steps: int = 0
    local_samples: int = 0
    epoch: int = 0


class TrainingPeer:
    """The task, its model and the ``hivemind.Optimizer`` training it."""

    def __init__(self, options: Options, dht: Any, counter: HivemindCounter) -> None:
        import hivemind
        from hivemind.compression import Float16Compression, NoCompression
        from hivemind.optim.grad_averager import GradientAverager

        from swarm.tasks import get_task

        self.options = options
        self.counter = counter
        self.task = get_task(options.task)
        recipe = self.task.recipe
        self.target = options.target_batch_size or recipe.batch_size
        self.hivemind_target = self.target * options.inner_steps
        self.num_samples = options.num_samples or recipe.num_samples
        self.epochs = max(1, self.num_samples // self.hivemind_target)
        self.batch_size = options.batch_size_per_step or max(1, self.target // options.num_peers)
        self.model = self.task.make_model(options.seed)
        self.model.train()
        spec = recipe.optimizer
        compression = Float16Compression() if options.compression == "float16" else NoCompression()
        group_size = {0: options.num_peers, -1: None}.get(
            options.target_group_size, options.target_group_size
        )

        matchmaking = {
            "target_group_size": group_size,
            # hivemind asks for a request timeout below its matchmaking time
            "request_timeout": min(3.0, options.matchmaking_time / 2),
        }

        def build_optimizer(groups: Any) -> Any:
            """The recipe's optimizer over hivemind's parameter groups: one plain group
            goes as a list of tensors, so that Adam gets torch's fused kernels as ours."""
            groups = list(groups)
            if len(groups) == 1 and isinstance(groups[0], dict) and set(groups[0]) == {"params"}:
                return spec.build(list(groups[0]["params"]))
            return spec.build(groups)

        self.optimizer = hivemind.Optimizer(
            dht=dht,
            run_id=options.run_id or f"bench_{options.task}_{options.mode}",
            target_batch_size=self.hivemind_target,
            batch_size_per_step=self.batch_size,
            optimizer=build_optimizer,
            params=self.model.parameters(),
            matchmaking_time=options.matchmaking_time,
            averaging_timeout=options.averaging_timeout,
            load_state_timeout=options.load_state_timeout,
            use_local_updates=options.mode == "local",
            delay_optimizer_step=options.delayed_updates,
            delay_grad_averaging=options.delayed_updates,
            average_state_every=options.average_state_every,
            grad_compression=compression,
            state_averaging_compression=compression,
            # hivemind 1.1.12 passes ``averager_opts`` to the state averager only (its
            # docstring says both): the gradient averager gets them through its factory.
            averager_opts=matchmaking,
            grad_averager_factory=(
                None
                if options.mode == "local"
                else functools.partial(GradientAverager, **matchmaking)
            ),
            tracker_opts=dict(options.tracker_opts),
            verbose=True,  # status lines at INFO: counted by ``counter``
        )
        self.state_loads = 0
        stock_load = self.optimizer.load_state_from_peers

        def counted_load(**kwargs: Any) -> Any:
            self.state_loads += 1
            return stock_load(**kwargs)

        self.optimizer.load_state_from_peers = counted_load
        self.progress = Progress()
        self.trained = False

    def wait_for_peers(self, stop: threading.Event) -> float:
        """Until this peer's progress tracker sees the run's ``num_peers`` peers: the
        seconds it took. hivemind publishes a peer's progress only once it has
        accumulated samples, so each peer reports one phantom sample, waits, and takes it
        back. Without this, peers started together each see no one at first and race
        through epochs alone (a millisecond micro-batch each), until their trackers'
        next look at the DHT (3 s with no peers seen)."""
        from hivemind.utils.performance_ema import PerformanceEMA

        tracker = self.optimizer.tracker
        began = time.monotonic()
        deadline = began + self.options.peers_timeout
        tracker.report_local_progress(0, 1)
        while tracker.global_progress.num_peers < self.options.num_peers:
            if stop.is_set():
                raise StdinClosed
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"saw {tracker.global_progress.num_peers} of {self.options.num_peers} "
                    f"peers in the run's progress within {self.options.peers_timeout:.0f} s"
                )
            time.sleep(0.1)
        tracker.report_local_progress(0, 0)
        # Forget the phantom sample's rate: it would slow this peer's estimate down.
        with tracker.pause_updates():
            tracker.performance_ema = PerformanceEMA(alpha=tracker.performance_ema.alpha)
        return time.monotonic() - began

    def describe(self) -> dict[str, Any]:
        return {
            "task": self.task.name,
            "mode": self.options.mode,
            "epochs": self.epochs,
            "target_batch_size": self.hivemind_target,
            "batch_size_per_step": self.batch_size,
            "num_samples": self.num_samples,
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
        }

    def _batches(self) -> Iterator[Any]:
        """Micro-batch ``k``: this rank's slice of global step ``k`` (module docstring)."""
        return self.task.batches(
            self.options.rank, self.options.num_peers, self.batch_size, self.options.seed
        )

    def train(self, start_at: float, stop: threading.Event) -> dict[str, Any]:
        """From ``start_at``, train until ``local_epoch`` reaches the run's epochs (or
        ``stop`` is set: :class:`StdinClosed`); the ``trained`` report."""
        opt, task, model, progress = self.optimizer, self.task, self.model, self.progress
        delay = start_at - time.monotonic()
        if delay > self.options.command_timeout:
            raise ValueError(f"start_at is {delay:.0f} s away, past command_timeout")
        if delay > 0:
            time.sleep(delay)
        started = time.monotonic()
        opt.tracker.performance_ema.reset_timer()  # idle until now is not compute time
        deadline = started + self.options.train_timeout
        batches = self._batches()
        loss_curve: list[list[float]] = []
        eval_curve: list[list[Any]] = []
        eval_seconds = 0.0
        loss_sum, loss_count = 0.0, 0
        progress.epoch = opt.local_epoch
        while opt.local_epoch < self.epochs:
            if stop.is_set():
                raise StdinClosed
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"local_epoch {opt.local_epoch} of {self.epochs} after train_timeout "
                    f"{self.options.train_timeout:.0f} s"
                )
            opt.zero_grad()
            loss = task.loss(model, next(batches))
            loss.backward()  # type: ignore[no-untyped-call]
            value = loss.item()
            if not math.isfinite(value):
                raise ValueError(f"training diverged at epoch {opt.local_epoch}: loss {value}")
            opt.step(batch_size=self.batch_size)
            progress.micro_steps += 1
            progress.local_samples += self.batch_size
            loss_sum, loss_count = loss_sum + value, loss_count + 1
            if opt.local_epoch != progress.epoch:
                progress.epoch = opt.local_epoch
                now = time.monotonic()
                loss_curve.append([now - started, progress.epoch, loss_sum / loss_count])
                loss_sum, loss_count = 0.0, 0
                every = self.options.eval_every
                if every and progress.epoch % every == 0 and progress.epoch < self.epochs:
                    metrics = task.evaluate(model)
                    # (seconds of training: the evaluations so far left out)
                    eval_curve.append([now - started - eval_seconds, progress.epoch, metrics])
                    eval_seconds += time.monotonic() - now
        synced = time.monotonic()
        # The last epoch's background round (parameters, or a delayed step): apply it.
        opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        ended = time.monotonic()
        metrics = task.evaluate(model)
        if self.options.eval_every:
            eval_curve.append([ended - started - eval_seconds, opt.local_epoch, metrics])
        train_seconds = ended - started
        digest, squares = hashlib.sha256(), 0.0
        for parameter in model.parameters():
            values = parameter.detach().cpu().contiguous()
            digest.update(values.numpy().tobytes())
            squares += float((values.double() ** 2).sum())
        return {
            "event": "trained",
            "epochs": opt.local_epoch,
            "local_samples": progress.local_samples,
            "micro_steps": progress.micro_steps,
            "train_seconds": train_seconds,
            "samples_per_second": progress.local_samples / train_seconds,
            "started_late_s": max(0.0, started - start_at),
            "final_sync_s": ended - synced,
            "metrics": metrics,
            "loss_curve": loss_curve,
            "eval_curve": eval_curve,
            "eval_seconds": eval_seconds,
            "params_digest": digest.hexdigest()[:16],
            "params_norm": math.sqrt(squares),
            "state_loads": self.state_loads,
            "hivemind": self.counter.summary(),
        }

    def shutdown(self) -> None:
        self.optimizer.shutdown()


# --- process hygiene -------------------------------------------------------------------


def _in_thread(work: Callable[[], object], seconds: float) -> None:
    """Run ``work()`` in a daemon thread for at most ``seconds`` (a shutdown that hangs
    must not keep the process: what it started is killed after)."""
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(seconds)


#: Every process hivemind started that we have seen (:func:`note_children`): one that
#: exits by itself before the end still leaves torch's shared memory behind.
SEEN_CHILDREN: set[int] = set()


def note_children() -> None:
    SEEN_CHILDREN.update(descendants(os.getpid()))


def stop_children() -> None:
    """Stop by PID every process we started that still runs (hivemind's DHT process,
    ``p2pd``, averagers), remove the unix sockets its ``p2pd`` leaves behind, and
    unlink the shared memory (``/dev/shm/torch_<pid>_*``: hivemind shares tensors
    through files) of those processes and of this one, which no one uses any more (a
    mapping outlives its file's name), and which outlive a process that exits while
    hivemind still holds tensors."""
    tree = descendants(os.getpid())
    SEEN_CHILDREN.update(tree)
    sockets = []
    for pid in tree:
        command = pid_command(pid)
        found = P2PD_SOCKET.search(command)
        if found and "p2pd" in command:
            sockets.append(Path(found.group(1)))
    stop_pids(tree)
    remove_shared_memory_of(sorted(SEEN_CHILDREN))
    for path in [*sockets, *SHARED_MEMORY_DIR.glob(f"torch_{os.getpid()}_*")]:
        with contextlib.suppress(OSError):
            if path.is_socket() or path.name.startswith("torch_"):
                path.unlink()


class Watchdog:
    """Abandons a training loop stuck inside hivemind past its bound: reports
    ``trained`` with an error, stops what we started and exits the process."""

    def __init__(self, progress: Progress, epochs: int, seconds: float) -> None:
        self._done = threading.Event()
        self._progress, self._epochs, self._seconds = progress, epochs, seconds
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def _watch(self) -> None:
        if self._done.wait(self._seconds):
            return
        emit(
            {
                "event": "trained",
                "error": f"stuck inside hivemind at epoch {self._progress.epoch} of "
                f"{self._epochs} after {self._seconds:.0f} s (micro-step "
                f"{self._progress.micro_steps})",
            }
        )
        stop_children()
        os._exit(3)

    def cancel(self) -> None:
        self._done.set()


# --- main ------------------------------------------------------------------------------


def serve(peer: TrainingPeer, commands: Commands, options: Options) -> None:
    """Answer ``train`` (once) and ``exit`` until stdin closes."""
    for _ in range(MAX_COMMANDS):
        waiting_for = "exit" if peer.trained else "train"
        command = commands.next(options.command_timeout, waiting_for)
        op = command.get("op")
        if op == "exit":
            return
        if op != "train":
            emit({"event": "error", "error": f"unknown command {command!r:.200}"})
            return
        if peer.trained:
            emit({"event": "trained", "error": "this peer has already trained"})
            continue
        start_at = command.get("start_at", time.monotonic())
        if isinstance(start_at, bool) or not isinstance(start_at, int | float):
            emit({"event": "trained", "error": f"start_at must be a number, got {start_at!r}"})
            continue
        peer.trained = True
        bound = options.train_timeout + options.averaging_timeout + WATCHDOG_GRACE_SECONDS
        watchdog = Watchdog(
            peer.progress, peer.epochs, bound + max(0.0, start_at - time.monotonic())
        )
        try:
            report = peer.train(float(start_at), commands.closed)
        except StdinClosed:
            raise
        except Exception as e:
            report = {
                "event": "trained",
                "error": repr(e)[:500],
                "epochs": peer.optimizer.local_epoch,
                "local_samples": peer.progress.local_samples,
                "hivemind": peer.counter.summary(),
            }
        finally:
            watchdog.cancel()
        emit(report)


def run(options: Options) -> None:
    """Join, build, serve; whatever happens, leave nothing running."""
    import torch

    torch.set_num_threads(options.threads)  # inherited by the processes hivemind forks
    import hivemind

    counter = HivemindCounter()
    counter.install()
    commands = Commands()
    began = time.monotonic()
    dht = hivemind.DHT(
        initial_peers=list(options.initial_peers) or None,
        host_maddrs=[listen_maddr(options.host)],
        start=False,
    )
    peer: TrainingPeer | None = None
    try:
        dht.run_in_background(await_ready=True, timeout=options.join_timeout)
        emit(
            {
                "event": "joined",
                "join_s": time.monotonic() - began,
                "addrs": [str(m) for m in dht.get_visible_maddrs()],
            }
        )
        began = time.monotonic()
        try:
            peer = TrainingPeer(options, dht, counter)
            note_children()  # the DHT process, p2pd and the averagers
            setup = time.monotonic() - began
            waited = peer.wait_for_peers(commands.closed) if options.wait_for_peers else 0.0
        except StdinClosed:
            raise
        except Exception as e:
            emit({"event": "ready", "error": repr(e)[:500]})
            raise
        emit({"event": "ready", "setup_s": setup, "peers_wait_s": waited, **peer.describe()})
        serve(peer, commands, options)
    except StdinClosed:
        pass
    finally:
        # A second SIGTERM must not cut the clean-up short (the parent kills us after
        # its grace period anyway): what we started would be left running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if peer is not None:
            _in_thread(peer.shutdown, SHUTDOWN_SECONDS)
        _in_thread(dht.shutdown, SHUTDOWN_SECONDS)
        stop_children()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # so ``finally`` shuts hivemind down and stops its processes


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python _hivemind_train.py OPTIONS_JSON", file=sys.stderr)
        return 2
    try:
        options = Options.from_json(argv[1])
    except ValueError as e:  # json.JSONDecodeError included
        print(f"_hivemind_train.py: bad options: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    run(options)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
