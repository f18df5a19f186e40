"""``swarm demo``: a whole local swarm trains a small model, then meets its baseline.

The demo process hosts the bootstrap peer (a DHT node in this process) and starts
``num_peers`` trainer processes, each ``swarm train --progress json`` on its slots of each
global batch of the bundled data (:mod:`swarm.train_display` describes the JSON lines). It shows
their combined progress as one bar and the command that joins the swarm from another
terminal, then trains the single-process baseline (:func:`swarm.baseline.run_baseline`:
the same global batch, examples, optimizer and seed) and prints both side by side.

Processes: the demo stops only the processes it started, by PID (SIGTERM, then SIGKILL
after a grace period), on success, on error and on Ctrl-C. Each child also stops by
itself when its stdin closes, so a demo that is killed outright leaves no trainer
behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from peers.config import LOOPBACK_LISTEN_ADDRS, PeerConfig
from peers.dht import BlockingDHT
from peers.processes import stop_processes
from swarm.baseline import BaselineConfig, BaselineResult, run_baseline
from swarm.errors import SwarmError, TaskError
from swarm.progress_bar import ProgressBar, human_bytes
from swarm.tasks import get_task
from swarm.train_command import join_command
from swarm.train_display import format_metrics, progress_fields
from swarm.trainer import TrainerConfig, plan_run

#: More trainer processes than this on one machine teaches nothing more and only
#: slows every one of them down.
MAX_DEMO_PEERS = 16
#: Lines of a failed trainer's stderr shown in the error.
STDERR_TAIL_LINES = 20


def speed_config(num_peers: int | None = None, seed: int = 0, timeout: float = 600.0) -> DemoConfig:
    """``swarm demo --speed``: the transformer (``charlm``) with a global batch of 1024,
    split over one trainer per core (one thread each) against one process of one thread:
    the same computation, so the same model, in less wall-clock time. A batch this large
    makes each step's compute (about a second on one core) outweigh a round on loopback
    (about 0.1 s); at the recipe's batch of 32 the rounds would dominate."""
    peers = num_peers if num_peers is not None else max(2, min(4, os.cpu_count() or 1))
    return DemoConfig(
        num_peers=peers,
        task="charlm",
        target_batch_size=SPEED_BATCH_SIZE,
        num_samples=SPEED_BATCH_SIZE * SPEED_STEPS,
        seed=seed,
        timeout=timeout,
    )


#: ``--speed``'s global batch and steps: about a second of one core's compute per step,
#: and 40 steps take the transformer from 7 to about 3.4 bits per character.
SPEED_BATCH_SIZE = 1024
SPEED_STEPS = 40


class DemoError(SwarmError):
    """The demo's swarm failed: a trainer died, or the run took too long."""


def default_num_peers() -> int:
    """What this machine can run side by side: two per core, between 2 and 4."""
    return max(2, min(4, (os.cpu_count() or 1) * 2))


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo run."""

    num_peers: int = field(default_factory=default_num_peers)
    """Trainer processes (each on its own shard of the data)."""
    task: str = "digits"
    """The task the swarm trains: built in (``digits``, ``charlm``) or your own as
    ``module:factory``."""
    num_samples: int = 0
    """Global samples to train for; 0: the task's recipe."""
    target_batch_size: int = 0
    """The swarm's global batch (and the single process's batch); 0: the task's recipe."""
    seed: int = 0
    """Model initialisation and data order, for the swarm and the baseline alike."""
    run_id: str = "demo"
    """The training run's name in the swarm."""
    timeout: float = 600.0
    """Seconds the swarm may train before the demo gives up (a demo never hangs)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_peers, int) or not 2 <= self.num_peers <= MAX_DEMO_PEERS:
            raise TaskError(f"num_peers must be in [2, {MAX_DEMO_PEERS}], got {self.num_peers!r}")
        if not self.timeout > 0:
            raise TaskError(f"timeout must be positive, got {self.timeout!r}")
        self.trainer_config()  # validates task, sizes, seed and run id

    def trainer_config(self, initial_peers: tuple[str, ...] = ()) -> TrainerConfig:
        """What each trainer runs (they wait for each other before the first step)."""
        return TrainerConfig(
            task=self.task,
            run_id=self.run_id,
            initial_peers=initial_peers,
            listen=LOOPBACK_LISTEN_ADDRS,  # the demo's swarm lives on this machine
            num_peers=self.num_peers,
            num_samples=self.num_samples,
            target_batch_size=self.target_batch_size,
            seed=self.seed,
        )


@dataclass
class _Child:
    rank: int
    popen: subprocess.Popen[str]
    stderr_tail: list[str] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None


def _child_command(config: TrainerConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "swarm.cli",
        "train",
        "--initial-peers",
        *config.initial_peers,
        "--task",
        config.task,
        "--run-id",
        config.run_id,
        "--num-peers",
        str(config.num_peers),
        "--num-samples",
        str(config.num_samples),
        "--target-batch-size",
        str(config.target_batch_size),
        "--seed",
        str(config.seed),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--num-threads",
        "1",  # N trainers share this machine's cores
        "--progress",
        "json",
        "--stop-when-stdin-closes",
    ]


class _Children:
    """The trainer processes: started together, read by threads, stopped by PID."""

    def __init__(self) -> None:
        self.children: list[_Child] = []
        self.events: queue.Queue[tuple[_Child, dict[str, Any] | None]] = queue.Queue()

    def start(self, index: int, config: TrainerConfig) -> None:
        popen = subprocess.Popen(
            _child_command(config),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,  # Ctrl-C reaches the demo, which stops them cleanly
        )
        child = _Child(index, popen)
        self.children.append(child)
        threading.Thread(target=self._pump_stdout, args=(child,), daemon=True).start()
        threading.Thread(target=self._pump_stderr, args=(child,), daemon=True).start()

    def _pump_stdout(self, child: _Child) -> None:
        assert child.popen.stdout is not None
        with contextlib.suppress(ValueError, OSError):
            for line in child.popen.stdout:
                if line.startswith("{"):
                    with contextlib.suppress(json.JSONDecodeError):
                        self.events.put((child, json.loads(line)))
        self.events.put((child, None))

    def _pump_stderr(self, child: _Child) -> None:
        assert child.popen.stderr is not None
        with contextlib.suppress(ValueError, OSError):
            for line in child.popen.stderr:
                child.stderr_tail.append(line)
                del child.stderr_tail[:-STDERR_TAIL_LINES]

    def stop(self) -> None:
        """SIGTERM every child still running, wait, SIGKILL those that linger."""
        stop_processes(child.popen for child in self.children)


@dataclass(frozen=True)
class _SwarmOutcome:
    results: list[dict[str, Any]]
    seconds: float


def run_demo(config: DemoConfig, out: TextIO | None = None) -> None:
    """Run the demo, printing to ``out`` (stdout by default).

    Raises :class:`DemoError` if a trainer fails or the swarm does not finish within
    ``config.timeout``; KeyboardInterrupt passes through. Every process started is
    stopped before this returns or raises.
    """
    out = out if out is not None else sys.stdout
    started = time.monotonic()
    torch.set_num_threads(1)  # the baseline must add up in the order the peers do
    task = get_task(config.task)
    plan = plan_run(config.trainer_config(), task.recipe)
    total = plan.total_epochs * plan.samples_per_epoch
    _say(
        out,
        f"swarm demo: {config.num_peers} peers train the {config.task!r} task together "
        f"({total:,} samples, global batch {plan.target_batch_size}, "
        f"about {plan.target_batch_size // config.num_peers} per peer per step), then the "
        "result meets one process "
        "trained on the same examples.",
    )
    bootstrap = BlockingDHT(peer_config=PeerConfig(listen_addrs=LOOPBACK_LISTEN_ADDRS))
    try:
        children = _Children()
        try:
            boot_addr = str(bootstrap.peer.listen_addrs[0])
            _say(out, f"bootstrap peer (this process): {boot_addr}")
            _say(out, "join this swarm from another terminal while it trains:")
            _say(out, f"  {join_command(config.trainer_config(), [boot_addr])}")
            _say(out, f"starting {config.num_peers} trainer processes ...")
            for rank in range(config.num_peers):
                children.start(rank, config.trainer_config((boot_addr,)))
            swarm = _follow(children, config, total, out)
        finally:
            children.stop()
        _say(out, "training the single-process baseline on the same examples ...")
        baseline = run_baseline(
            BaselineConfig(
                task=config.task,
                batch_size=plan.target_batch_size,
                num_samples=plan.total_epochs * plan.target_batch_size,
                optimizer=task.recipe.optimizer,
                seed=config.seed,
            ),
            task=task,
        )
    finally:
        bootstrap.close()
    _say(out, "")
    _say(out, _comparison(config, swarm, baseline))
    _say(out, "")
    _say(
        out,
        f"demo finished in {time.monotonic() - started:.1f} s "
        "(process start-up, training and the baseline).",
    )


def _follow(children: _Children, config: DemoConfig, total: int, out: TextIO) -> _SwarmOutcome:
    """Show the children's combined progress until each reports its result."""
    bar = ProgressBar(total, stream=out)
    started = time.monotonic()
    deadline = started + config.timeout
    running = set(range(len(children.children)))
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            bar.close(_done(children), _fields(children, total, started))
            raise DemoError(f"the swarm did not finish training in {config.timeout:.0f} s")
        try:
            child, event = children.events.get(timeout=min(remaining, 0.5))
        except queue.Empty:  # still starting, or between reports: the clock moves on
            bar.update(_done(children), _fields(children, total, started))
            continue
        if event is None:  # its stdout closed: it exited
            if child.result is None:
                bar.close(_done(children), _fields(children, total, started))
                code = child.popen.wait()
                raise DemoError(
                    f"trainer {child.rank} (pid {child.popen.pid}) exited with {code} "
                    "before it finished:\n" + "".join(child.stderr_tail).rstrip()
                )
            continue
        if event.get("event") == "progress":
            child.last = event
        elif event.get("event") == "result":
            child.result = event
            running.discard(children.children.index(child))
        bar.update(_done(children), _fields(children, total, started))
    bar.close(_done(children), _fields(children, total, started))
    results = [c.result for c in children.children if c.result is not None]
    return _SwarmOutcome(results, time.monotonic() - started)


def _done(children: _Children) -> int:
    done = [c.result["global_samples"] for c in children.children if c.result is not None]
    done += [int(c.last.get("samples", 0)) for c in children.children]
    return max(done, default=0)


def _fields(children: _Children, total: int, started: float) -> list[tuple[str, str]]:
    live = [c.last for c in children.children if c.last and c.result is None]
    losses = [float(e["loss"]) for e in live if e.get("loss") is not None]
    loss = sum(losses) / len(losses) if losses else float("nan")
    peers = max((int(e.get("peers", 0)) for e in live), default=0)
    rate = sum(float(e.get("samples_per_second", 0.0)) for e in live)
    fields = progress_fields(_done(children), total, loss, peers, rate)
    return [*fields, ("time", f"{time.monotonic() - started:.0f} s")]


def _comparison(config: DemoConfig, swarm: _SwarmOutcome, baseline: BaselineResult) -> str:
    first = swarm.results[0]
    names = list(baseline.metrics)
    rows: list[tuple[str, str, str]] = []
    for name in names:
        mine, theirs = first["metrics"].get(name), baseline.metrics[name]
        fmt = "{:.1%}" if name == "accuracy" else "{:.4f}"
        rows.append((f"test {name}", "-" if mine is None else fmt.format(mine), fmt.format(theirs)))
    steps = int(first["epochs"])
    swarm_seconds = max(float(r.get("train_seconds") or r["seconds"]) for r in swarm.results)
    rows += [
        ("global batch", str(baseline.num_samples // max(baseline.num_steps, 1)), "same"),
        ("optimizer steps", f"{steps:,}", f"{baseline.num_steps:,}"),
        ("training samples", f"{int(first['global_samples']):,}", f"{baseline.num_samples:,}"),
        ("training time", _seconds(swarm_seconds), _seconds(baseline.train_seconds)),
        (
            "bytes sent",
            human_bytes(sum(int(r["statistics"]["bytes_sent"]) for r in swarm.results)),
            "-",
        ),
        (
            "averaging rounds",
            str(min(int(r["statistics"]["num_rounds"]) for r in swarm.results)),
            "-",
        ),
    ]
    head = (f"swarm ({config.num_peers} peers)", "one process")
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {head[0]:>16}  {head[1]:>12}"]
    lines += [f"{a:{width}}  {b:>16}  {c:>12}" for a, b, c in rows]
    losses = {round(float(r["metrics"]["loss"]), 6) for r in swarm.results}
    agree = (
        f"all {len(swarm.results)} peers hold the same model"
        if len(losses) == 1
        else f"the peers' models differ slightly (test losses {sorted(losses)})"
    )
    lines += [
        "",
        f"{agree}; swarm: {format_metrics(first['metrics'])}; "
        f"one process: {format_metrics(baseline.metrics)}.",
    ]
    speedup = baseline.train_seconds / max(swarm_seconds, 1e-9)
    if speedup > 1:
        lines.append(
            f"the swarm trained {speedup:.2f}x faster than one process: {config.num_peers} "
            "processes of one thread each split every batch, one process of one thread "
            "trained it whole (training time: from the first step to the last)."
        )
    else:
        lines.append(
            f"training time: the swarm took {1 / speedup:.1f}x as long as one process; its "
            f"{config.num_peers} peers share this machine's cores and average over loopback "
            "after every step, which small batches cannot repay (`swarm demo --speed` "
            "shows a batch large enough). The point here: they reach the same model."
        )
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def _say(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


__all__ = ["DemoConfig", "DemoError", "default_num_peers", "run_demo", "speed_config"]
