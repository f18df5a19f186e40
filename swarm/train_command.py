"""``swarm train`` / ``swarm join``: one peer that trains a built-in task with the swarm.

With initial peers it joins their swarm. Without, it starts one: a bootstrap DHT node
in this process (on the ``listen`` addresses) that the trainer and everyone after it
join through, and it prints the command that joins it. Either way it trains with
:func:`swarm.trainer.train`, shows progress (:class:`swarm.train_display.TrainDisplay`)
and ends with a summary.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TextIO

import torch

from peers.addresses import parse_multiaddr, tcp_target
from peers.config import PeerConfig
from peers.dht import BlockingDHT
from peers.identity import KeyPair
from peers.pnet import load_swarm_key
from swarm.collaborative.config import DiLoCoConfig
from swarm.errors import TaskError
from swarm.metrics import MetricsServer
from swarm.status import STATUS_INTERVAL_SECONDS, StatusSources, publish_status_forever
from swarm.tasks import get_task
from swarm.train_display import ProgressMode, TrainDisplay
from swarm.trainer import TrainerConfig, TrainResult, plan_run, train


def swarm_command() -> str:
    """How this process was started, for the commands we print: ``swarm`` (or the path
    of that script) when run as the console script, else ``python -m swarm.cli``."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith("swarm") or argv0.endswith("swarm.exe"):
        return argv0
    return f"{sys.executable} -m swarm.cli"


def join_command(config: TrainerConfig, initial_peers: Sequence[str]) -> str:
    """The command that joins ``config``'s run through ``initial_peers``."""
    parts = [
        swarm_command(),
        "join",
        "--initial-peers",
        *initial_peers,
        "--task",
        config.task,
        "--run-id",
        config.run_id,
    ]
    if config.num_samples:
        parts += ["--num-samples", str(config.num_samples)]
    if config.target_batch_size:
        parts += ["--target-batch-size", str(config.target_batch_size)]
    if config.diloco is not None:  # (every peer of a run must use the same)
        parts += ["--diloco", str(config.diloco.inner_steps)]
        default = DiLoCoConfig()
        if config.diloco.outer_lr != default.outer_lr:
            parts += ["--outer-lr", str(config.diloco.outer_lr)]
        if config.diloco.outer_momentum != default.outer_momentum:
            parts += ["--outer-momentum", str(config.diloco.outer_momentum)]
        if config.diloco.overlap:
            parts.append("--diloco-overlap")
    if config.centered_clip:
        parts.append("--centered-clip")
    if config.reducers_per_part != 1:
        parts += ["--reducers-per-part", str(config.reducers_per_part)]
    if config.swarm_key is not None:
        parts += ["--swarm-key", str(config.swarm_key)]
    run_keys = set(config.trusted_run_keys)
    if config.run_key is not None:  # joiners trust the operator's key, not hold it
        run_keys.add(KeyPair.load_or_create(config.run_key).peer_id)
    for key in sorted(str(k) for k in run_keys):
        parts += ["--trust-run-key", key]
    return " ".join(parts)


@contextlib.contextmanager
def hosted_bootstrap(
    listen: Sequence[str],
    announce: Sequence[str] = (),
    swarm_key: bytes | None = None,
    status_interval: float = STATUS_INTERVAL_SECONDS,
) -> Iterator[list[str]]:
    """A bootstrap DHT node in this process for the duration, publishing its status
    record every ``status_interval`` seconds; yields its multiaddrs (``announce``
    instead of the bound ones, if given); in ``swarm_key``'s private network if given.

    Raises :class:`TaskError` if ``listen`` is empty (a peer nobody can dial cannot
    start a swarm) and the ``peers`` errors of a bad or busy address.
    """
    if not listen:
        raise TaskError("a swarm's first peer must listen: give --listen, or --initial-peers")
    config = PeerConfig(
        listen_addrs=tuple(listen), announce_addrs=tuple(announce), swarm_key=swarm_key
    )
    boot = BlockingDHT(peer_config=config)
    try:
        # It shows in `swarm status` like a `swarm bootstrap` peer (its own record).
        publisher = boot.peer.submit(
            publish_status_forever(boot.node, StatusSources(), status_interval)
        )
        try:
            yield [str(a) for a in boot.peer.listen_addrs]
        finally:
            publisher.cancel()
    finally:
        boot.close()


def next_ports(addrs: Sequence[str]) -> tuple[str, ...]:
    """``addrs`` with each fixed TCP port one higher (port 0 stays 0): where the trainer
    of ``swarm train`` listens while its hosted bootstrap peer has the ports given."""
    shifted = []
    for addr in addrs:
        target = tcp_target(parse_multiaddr(addr))
        port = target.port + 1 if target.port else 0
        if port > 65535:
            raise TaskError(f"{addr}: the trainer takes the next port, and there is none")
        shifted.append(addr.replace(f"/tcp/{target.port}", f"/tcp/{port}", 1))
    return tuple(shifted)


def run_train(
    config: TrainerConfig,
    *,
    progress: ProgressMode = "auto",
    num_threads: int = 0,
    stream: TextIO | None = None,
    metrics: MetricsServer | None = None,
) -> TrainResult:
    """Train one peer as ``swarm train`` does; returns its result (the summary is
    printed). ``metrics``: where to export this peer's metrics. Raises what
    :func:`swarm.trainer.train` raises."""
    if num_threads:
        torch.set_num_threads(num_threads)
    display = TrainDisplay(plan_run(config, get_task(config.task).recipe), progress, stream)
    with contextlib.ExitStack() as stack:
        if not config.initial_peers:
            key = load_swarm_key(config.swarm_key) if config.swarm_key else None
            addrs = stack.enter_context(
                hosted_bootstrap(config.listen, config.announce, key, config.status_interval)
            )
            # The bootstrap peer keeps the ports given; this trainer takes the next ones.
            config = dataclasses.replace(
                config,
                initial_peers=tuple(addrs),
                listen=next_ports(config.listen),
                announce=next_ports(config.announce),
            )
            display.message("started a new swarm; its bootstrap peer listens on")
            for addr in addrs:
                display.message(f"  {addr}")
            if all(_is_loopback(a) for a in addrs):
                display.message(
                    "  (loopback only: other machines cannot join; listen on this machine's "
                    "address, e.g. --listen /ip4/0.0.0.0/tcp/31337)"
                )
            display.message("others join it with")
            display.message(f"  {join_command(config, [_dialable(addrs)])}")
        display.message(f"training {config.task} (run {config.run_id!r}) ...")
        result = train(config, display.on_step, display.message, metrics, display.on_eval)
    display.finish(result)
    return result


def _is_loopback(addr: str) -> bool:
    return addr.startswith(("/ip4/127.", "/ip6/::1/"))


def _dialable(addrs: Sequence[str]) -> str:
    """The address to show first: one other machines can dial, if there is one."""
    remote = [a for a in addrs if not _is_loopback(a)]
    return (remote or list(addrs))[0]


def stop_when_stdin_closes() -> None:
    """Interrupt the main thread (as Ctrl-C would) once stdin reaches end of file: a
    parent that started us with a pipe and died takes us with it."""

    def watch() -> None:
        with contextlib.suppress(ValueError, OSError):
            while sys.stdin.readline():
                pass
        _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True, name="swarmtrain-stdin-watch").start()


def sigterm_as_interrupt() -> None:
    """Let SIGTERM stop training the way Ctrl-C does (leave the swarm, close sockets)."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
