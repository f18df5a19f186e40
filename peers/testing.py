"""Local multi-process swarms for tests: real peers in real OS processes on 127.0.0.1.

``LocalSwarm`` starts N processes, each a :class:`peers.Peer` that runs a *target*
coroutine ``async def target(node: Node)`` after it starts listening. Each process
reports JSON lines on its stdout (``ready`` with its PeerID and addresses, then
whatever the target reports with ``node.report``) and reads JSON lines the test sends
(``node.receive()``); the test reads reports with bounded waits and kills, pauses,
resumes or terminates processes by PID. Leaving the ``with`` block stops every process
it started and waits for it, so nothing is left behind.

A target is ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``. Run a node by hand as
``python -m peers.testing --target TARGET --options JSON``; the option ``log_level``
(e.g. ``"INFO"``) sends the process's logs to its stderr, whose last lines
``PeerProcess.log_tail`` returns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from peers.closing import ClosesOnExit
from peers.processes import TERMINATE_GRACE_SECONDS, stop_processes

#: Seconds a process has to print its ``ready`` line; generous because a loaded 2-core
#: CI machine may start 30 interpreters at once.
DEFAULT_STARTUP_TIMEOUT = 60.0


@dataclass
class Node:
    """What a target gets: its peer, its options, and its channel to the test."""

    peer: Any  # peers.host.Peer, typed loosely so this module imports nothing heavy
    options: dict[str, Any]
    _inbox: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)

    def report(self, message: dict[str, Any]) -> None:
        """Send one JSON object to the test (it reads it with ``next_report``)."""
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    async def receive(self) -> dict[str, Any]:
        """The next JSON object the test sent with ``PeerProcess.send``."""
        return await self._inbox.get()


Target = Callable[[Node], Awaitable[None]]


def rss_bytes() -> int:
    """This process's resident memory now (Linux)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The most resident memory this process has held since it started (Linux).

    Not ``getrusage(RUSAGE_SELF).ru_maxrss``: that keeps the peak of the process image
    before ``exec``, and a child started from a large process (a pytest worker late in a
    run, a benchmark holding hivemind) reports its parent's size as its own peak.
    """
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name == field:
                return int(value.split()[0])  # "  1234 kB"
    raise OSError(f"/proc/self/status has no {field}")


class SwarmError(Exception):
    """A local swarm process failed to start, report, or behave."""


@dataclass
class PeerProcess:
    """One peer process: its PID, PeerID, addresses, and the reports it printed."""

    index: int
    popen: subprocess.Popen[str]
    peer_id: str = ""
    addrs: list[str] = field(default_factory=list)
    _lines: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    _stderr_tail: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def maddr(self) -> str:
        """The first full multiaddr (with /p2p/ID)."""
        return self.addrs[0]

    def next_report(self, timeout: float) -> dict[str, Any]:
        """The next JSON line the process printed; :class:`SwarmError` if none comes in
        ``timeout`` seconds or the process exits first."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise SwarmError(
                f"peer {self.index} (pid {self.pid}) reported nothing in {timeout} s"
            ) from None
        if line is None:
            raise SwarmError(
                f"peer {self.index} (pid {self.pid}) exited with {self.popen.poll()}: "
                + self.log_tail(20)
            )
        return line

    def log_tail(self, lines: int = 200) -> str:
        """The last ``lines`` lines the process wrote to its stderr (at most 400 kept)."""
        return "".join(self._stderr_tail[-lines:])

    def send(self, message: dict[str, Any]) -> None:
        """Send one JSON object to the node's ``receive()``."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(message) + "\n")
        self.popen.stdin.flush()

    def wait_report(self, event: str, timeout: float) -> dict[str, Any]:
        """The next report whose ``event`` field equals ``event`` (others are skipped);
        :class:`SwarmError` at once if the target failed instead (its ``error`` report)."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.next_report(max(0.0, deadline - time.monotonic()))
            if report.get("event") == event:
                return report
            if report.get("event") == "error":
                raise SwarmError(
                    f"peer {self.index} (pid {self.pid}) failed: {report.get('error')}; "
                    + self.log_tail(20)
                )

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class LocalSwarm(ClosesOnExit):
    """Start, kill, pause and tear down local peer processes. Use as a context manager."""

    def __init__(self, *, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT) -> None:
        self.startup_timeout = startup_timeout
        self.processes: list[PeerProcess] = []

    def start(
        self,
        num_peers: int,
        *,
        target: str = "peers.testing:serve_forever",
        options: dict[str, Any] | None = None,
        per_peer_options: list[dict[str, Any]] | None = None,
        namespaces: list[str | None] | None = None,
    ) -> list[PeerProcess]:
        """Start ``num_peers`` processes at once and wait until each is listening.

        ``options`` go to every target; ``per_peer_options[i]`` are merged in for the
        i-th. Options ``listen`` (multiaddrs) and ``peer_config`` (keyword arguments of
        :class:`peers.PeerConfig` with plain values, e.g. ``{"reachability": "private"}``)
        configure the peer itself. ``namespaces[i]`` runs the i-th inside that network
        namespace (``ip netns exec``; see :mod:`peers.netlab`). Raises
        :class:`SwarmError` if one does not start in time.
        """
        started: list[PeerProcess] = []
        for i in range(num_peers):
            merged = dict(options or {})
            if per_peer_options is not None:
                merged.update(per_peer_options[i])
            namespace = namespaces[i] if namespaces is not None else None
            started.append(self._spawn(target, merged, namespace))
        for proc in started:
            ready = proc.wait_report("ready", self.startup_timeout)
            proc.peer_id = ready["peer_id"]
            proc.addrs = list(ready["addrs"])
        return started

    def _spawn(
        self, target: str, options: dict[str, Any], namespace: str | None = None
    ) -> PeerProcess:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # ``ip netns exec`` enters the namespace and execs the command: the PID we hold
        # is the interpreter's own, so signals reach the peer itself.
        prefix = ["ip", "netns", "exec", namespace] if namespace is not None else []
        popen = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "peers.testing",
                "--target",
                target,
                "--options",
                json.dumps(options),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        proc = PeerProcess(index=len(self.processes), popen=popen)
        self.processes.append(proc)
        threading.Thread(target=_pump_stdout, args=(proc,), daemon=True).start()
        threading.Thread(target=_pump_stderr, args=(proc,), daemon=True).start()
        return proc

    def kill(self, proc: PeerProcess) -> None:
        """SIGKILL: the peer vanishes without a word, as a crashed laptop would."""
        if proc.alive:
            proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(TERMINATE_GRACE_SECONDS)

    def pause(self, proc: PeerProcess) -> None:
        """SIGSTOP: the peer stays connected but answers nothing."""
        proc.popen.send_signal(signal.SIGSTOP)

    def resume(self, proc: PeerProcess) -> None:
        proc.popen.send_signal(signal.SIGCONT)

    def terminate(self, proc: PeerProcess) -> int:
        """SIGTERM, then SIGKILL after a grace period; returns the exit code."""
        if proc.alive:
            proc.popen.send_signal(signal.SIGCONT)
            proc.popen.send_signal(signal.SIGTERM)
            try:
                return proc.popen.wait(TERMINATE_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
        return proc.popen.wait(TERMINATE_GRACE_SECONDS)

    def close(self) -> None:
        stop_processes(proc.popen for proc in self.processes)


def _pump_stdout(proc: PeerProcess) -> None:
    assert proc.popen.stdout is not None
    with contextlib.suppress(ValueError, OSError):
        for line in proc.popen.stdout:
            line = line.strip()
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    proc._lines.put(json.loads(line))
    proc._lines.put(None)


def _pump_stderr(proc: PeerProcess) -> None:
    assert proc.popen.stderr is not None
    with contextlib.suppress(ValueError, OSError):
        for line in proc.popen.stderr:
            proc._stderr_tail.append(line)
            del proc._stderr_tail[:-400]


# --- the child side ---------------------------------------------------------------


async def serve_forever(node: Node) -> None:
    """The default target: connect to ``options["bootstrap"]`` if given, then just serve."""
    for addr in node.options.get("bootstrap", []):
        await node.peer.connect(addr)
    node.report({"event": "connected"})


def _pump_stdin(loop: asyncio.AbstractEventLoop, inbox: asyncio.Queue[dict[str, Any]]) -> None:
    with contextlib.suppress(ValueError, OSError, RuntimeError):
        for line in sys.stdin:
            with contextlib.suppress(json.JSONDecodeError):
                loop.call_soon_threadsafe(inbox.put_nowait, json.loads(line))


async def _child_main(target: Target, options: dict[str, Any]) -> None:
    from peers.config import PeerConfig
    from peers.host import Peer
    from peers.identity import KeyPair

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    identity = KeyPair.from_seed(bytes.fromhex(options["seed"])) if "seed" in options else None
    config = PeerConfig(
        identity=identity,
        listen_addrs=tuple(options.get("listen", ["/ip4/127.0.0.1/tcp/0"])),
        **options.get("peer_config", {}),
    )
    async with Peer(config) as peer:
        node = Node(peer=peer, options=options)
        threading.Thread(target=_pump_stdin, args=(loop, node._inbox), daemon=True).start()
        node.report(
            {
                "event": "ready",
                "peer_id": str(peer.peer_id),
                "addrs": [str(a) for a in peer.listen_addrs],
                "pid": os.getpid(),
            }
        )
        task = asyncio.ensure_future(target(node))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            if task.exception() is not None:
                node.report({"event": "error", "error": repr(task.exception())})
            else:
                node.report({"event": "done"})
            if not options.get("exit_when_done"):
                await stopper
        task.cancel()
        stopper.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def load_target(spec: str) -> Target:
    """Resolve ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``."""
    location, _, function_name = spec.rpartition(":")
    if location.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(
            f"_swarm_target_{os.getpid()}", location
        )
        if module_spec is None or module_spec.loader is None:
            raise SwarmError(f"cannot load target file {location}")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(location)
    target: Target = getattr(module, function_name)
    return target


def _main() -> None:
    parser = argparse.ArgumentParser(prog="python -m peers.testing")
    parser.add_argument("--target", default="peers.testing:serve_forever")
    parser.add_argument("--options", default="{}")
    args = parser.parse_args()
    options = json.loads(args.options)
    if "log_level" in options:  # e.g. "INFO": the lines a failing test prints
        logging.basicConfig(
            level=options["log_level"],
            format="%(relativeCreated)d %(name)s %(levelname)s %(message)s",
        )
    target = load_target(args.target)
    from peers.runtime import run

    run(_child_main(target, options))


if __name__ == "__main__":
    _main()
