"""The peer side of ``bench_dht.py``: one DHT node per process, timing its own operations.

Ours runs as a :mod:`peers.testing` target (``LocalSwarm`` loads ``this_file.py:ours_node``);
hivemind's runs as ``python this_file.py hivemind OPTIONS_JSON`` (one ``hivemind.DHT`` per
process, which forks its DHT process, which starts a Go ``p2pd``). Both print JSON lines
on stdout and read JSON commands on stdin, with the same meaning:

- start-up: ``{"event": "joined", "join_s": ..., "addrs": [...]}`` once the node has joined
  (``join_s``: seconds from creating the DHT object to joined, imports excluded; ours
  starts from a listening ``Peer``, hivemind's includes forking and starting ``p2pd``);
- ``{"op": "ops", "kind": "store"|"get"|"get_latest", "items": [[key, value], ...],
  "concurrency": c, "warmup": w, "op_timeout": s, "deadline_s": s, "ttl": s}`` ->
  ``{"event": "ops",
  "latencies": [...], "outcomes": {...}, "started": t, "ended": t}``: the first ``w`` items
  are done untimed; the rest by ``c`` workers, each op timed on its own (``latencies`` holds
  the successful ones, in seconds); a get succeeds when it returns the item's value.
  ``get`` is the first live value found (hivemind's default ``get(key)``, ours
  ``get(key, latest=False)``); ``get_latest`` is ``get(key, latest=True)`` on both (the
  freshest among the closest replicas).
  ``started``/``ended`` are ``time.monotonic()`` (one clock for every process on the host).
  No op starts after ``deadline_s``; those not started count as ``not_started``.
- ``{"op": "stop"}`` (or, for hivemind, the end of stdin): leave the DHT. The parent
  ends every process with SIGTERM in any case.

Only the standard library is imported at module level: ours must not pay for imports
it does not use, and the parent never imports hivemind (or torch).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

LOOPBACK = "127.0.0.1"
#: Most commands a node answers before it leaves by itself (the parent sends a dozen).
MAX_COMMANDS = 1000
#: Seconds hivemind's DHT process has to join; the parent's own deadline is shorter.
HIVEMIND_JOIN_TIMEOUT = 300.0


class _Batch:
    """Outcomes and latencies of one ``ops`` command; workers share its item iterator."""

    def __init__(self, command: dict[str, Any]) -> None:
        self.kind: str = command["kind"]
        self.items: list[list[Any]] = command["items"]
        self.op_timeout = float(command.get("op_timeout", 10.0))
        self.concurrency = max(1, int(command.get("concurrency", 1)))
        self.warmup = int(command.get("warmup", 0))
        self.deadline = time.monotonic() + float(command.get("deadline_s", 120.0))
        self.ttl = float(command.get("ttl", 600.0))
        self.latencies: list[float] = []
        self.outcomes: Counter[str] = Counter()
        self.first_error = ""
        self._lock = threading.Lock()

    def queue(self, items: list[list[Any]]) -> Iterator[list[Any]]:
        """Items for workers to take in turn; stops at the deadline (the rest counted)."""
        for n, item in enumerate(items):
            if time.monotonic() >= self.deadline:
                self.outcomes["not_started"] += len(items) - n
                return
            yield item

    def record(self, outcome: str, seconds: float, timed: bool, error: str = "") -> None:
        with self._lock:
            if not timed:
                return
            self.outcomes[outcome] += 1
            if outcome == "ok":
                self.latencies.append(seconds)
            if error and not self.first_error:
                self.first_error = error

    def report(self, started: float, ended: float) -> dict[str, Any]:
        return {
            "event": "ops",
            "kind": self.kind,
            "latencies": self.latencies,
            "outcomes": dict(self.outcomes),
            "first_error": self.first_error,
            "started": started,
            "ended": ended,
        }


# --- ours -----------------------------------------------------------------------------


async def _ours_batch(batch: _Batch, op: Callable[[Any, Any], Awaitable[str]]) -> dict[str, Any]:
    async def run(items: list[list[Any]], timed: bool, concurrency: int) -> None:
        queue = batch.queue(items)  # one iterator shared by the workers (one thread)

        async def worker() -> None:
            for key, value in queue:
                start = time.perf_counter()
                try:
                    async with asyncio.timeout(batch.op_timeout):
                        outcome = await op(key, value)
                except TimeoutError:
                    batch.record("timeout", 0.0, timed)
                except Exception as e:
                    batch.record("error", 0.0, timed, repr(e))
                else:
                    batch.record(outcome, time.perf_counter() - start, timed)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    await run(batch.items[: batch.warmup], False, batch.concurrency)
    started = time.monotonic()
    await run(batch.items[batch.warmup :], True, batch.concurrency)
    return batch.report(started, time.monotonic())


async def ours_node(node: Any) -> None:
    """The :mod:`peers.testing` target: join (``initial_peers`` option), then serve commands."""
    from peers.dht.node import DHT, DHTConfig, ValueWithExpiration, dht_time

    began = time.monotonic()
    config = DHTConfig(
        initial_peers=tuple(node.options.get("initial_peers", ())),
        disjoint_paths=int(node.options.get("disjoint_paths", 1)),
    )
    if "alpha" in node.options:
        config = replace(config, alpha=int(node.options["alpha"]))
    async with DHT(node.peer, config) as dht:
        addrs = [str(a) for a in node.peer.listen_addrs]
        node.report({"event": "joined", "join_s": time.monotonic() - began, "addrs": addrs})
        for _ in range(MAX_COMMANDS):
            command = await node.receive()
            if command.get("op") != "ops":
                return
            batch = _Batch(command)

            async def store(key: str, value: Any, batch: _Batch = batch) -> str:
                ok = await dht.store(key, value, dht_time() + batch.ttl)
                return "ok" if ok else "refused"

            async def get(key: str, value: Any, batch: _Batch = batch) -> str:
                # "get" is the first live value (as hivemind's default get), "get_latest"
                # the freshest among the replicas (as hivemind's latest=True).
                found = await dht.get(key, latest=batch.kind == "get_latest")
                if not isinstance(found, ValueWithExpiration):
                    return "missing"
                return "ok" if found.value == value else "wrong_value"

            node.report(await _ours_batch(batch, store if batch.kind == "store" else get))


# --- hivemind -------------------------------------------------------------------------


def _emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _hivemind_batch(dht: Any, batch: _Batch) -> dict[str, Any]:
    from hivemind.utils import get_dht_time

    # Calls go to the DHT process through one pipe: issue them one at a time, wait
    # for their futures concurrently (the pipe's writes must not interleave).
    issue = threading.Lock()

    def one(key: str, value: Any, timed: bool) -> None:
        start = time.perf_counter()
        future = None
        try:
            with issue:
                if batch.kind == "store":
                    future = dht.store(key, value, get_dht_time() + batch.ttl, return_future=True)
                else:
                    latest = batch.kind == "get_latest"
                    future = dht.get(key, latest=latest, return_future=True)
            result = future.result(timeout=batch.op_timeout)
        except TimeoutError:
            if future is not None:
                future.cancel()
            batch.record("timeout", 0.0, timed)
            return
        except Exception as e:
            batch.record("error", 0.0, timed, repr(e))
            return
        seconds = time.perf_counter() - start
        if batch.kind == "store":
            batch.record("ok" if result else "refused", seconds, timed)
        elif result is None:
            batch.record("missing", seconds, timed)
        else:
            batch.record("ok" if result.value == value else "wrong_value", seconds, timed)

    def run(items: list[list[Any]], timed: bool) -> None:
        queue = batch.queue(items)
        take = threading.Lock()

        def worker() -> None:
            while True:
                with take:
                    item = next(queue, None)
                if item is None:
                    return
                one(item[0], item[1], timed)

        if batch.concurrency == 1:
            worker()
            return
        with ThreadPoolExecutor(batch.concurrency) as pool:
            for future in [pool.submit(worker) for _ in range(batch.concurrency)]:
                future.result()

    run(batch.items[: batch.warmup], False)
    started = time.monotonic()
    run(batch.items[batch.warmup :], True)
    return batch.report(started, time.monotonic())


def hivemind_node(options: dict[str, Any]) -> None:
    """One hivemind peer: join, print ``joined`` with its visible maddrs, serve commands."""
    import hivemind

    began = time.monotonic()
    dht = hivemind.DHT(
        initial_peers=options.get("initial_peers") or None,
        host_maddrs=[f"/ip4/{options.get('host', LOOPBACK)}/tcp/0"],
        start=False,
    )
    try:
        dht.run_in_background(await_ready=True, timeout=HIVEMIND_JOIN_TIMEOUT)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        _emit({"event": "joined", "join_s": time.monotonic() - began, "addrs": maddrs})
        for _, line in zip(range(MAX_COMMANDS), sys.stdin, strict=False):
            command = json.loads(line)
            if command.get("op") != "ops":
                break
            _emit(_hivemind_batch(dht, _Batch(command)))
    finally:
        dht.shutdown()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # so ``finally`` shuts the DHT process (and its daemon) down


if __name__ == "__main__":
    if sys.argv[1:2] != ["hivemind"] or len(sys.argv) != 3:
        sys.exit("usage: python _dht_peers.py hivemind OPTIONS_JSON")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    hivemind_node(json.loads(sys.argv[2]))
