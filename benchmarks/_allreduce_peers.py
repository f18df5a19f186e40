"""The peer side of ``bench_allreduce.py``: one averaging peer (or raw TCP peer) per process.

Three kinds of process, each printing JSON lines on stdout and reading JSON commands
on stdin (times are ``time.monotonic()``: one clock for every process on the host):

- ours: a :mod:`peers.testing` target (``LocalSwarm`` loads ``this_file.py:ours_node``);
- hivemind: ``python this_file.py hivemind OPTIONS_JSON`` (a ``hivemind.DHT``, which forks
  its DHT process and a Go ``p2pd``, and one ``DecentralizedAverager`` per codec, which
  forks its own process);
- raw: ``python this_file.py raw [HOST]`` (plain TCP sockets, the physical limit).

Every kind listens on 127.0.0.1 unless told a ``host`` (hivemind's option, raw's
argument): ``bench_wan.py`` runs the same processes on the namespace lab's hosts.

Commands shared by ours and hivemind:

- ``{"op": "prepare", "elements": n, "seed": s, "rank": r, "codecs": [...]}`` ->
  ``prepared``: build this member's vector (untimed), ``elements`` float32 values that
  every process can rebuild block by block (:func:`member_block`), and, for ours, each
  codec's declared error bound on it (``bounds``).
- ours ``{"op": "round", "round_id": hex, "members": [[peer_id, maddr], ...], "codec": c,
  "start_at": t, "num_members": n}`` -> ``round``: wait until ``start_at``, run one
  butterfly round with the group given (no matchmaking), check the result.
- ours ``{"op": "dht", "initial_peers": [...]}`` -> ``joined``; then ``{"op": "step",
  "codec": c, "key": k, "gather_seconds": m, ...}`` -> ``step``: one full
  ``Averager.step`` (matchmaking through the DHT, then the round), checked.
- hivemind ``{"op": "averager", "codec": c, "prefix": p, "matchmaking_seconds": m,
  "patch_8bit": bool}`` -> ``averager``: a fresh ``DecentralizedAverager`` for that codec;
  then ``{"op": "step", ...}`` -> ``step``: reset the tensor, ``averager.step()``, check.
  The averager times its own all-reduce (``_aggregate_with_group``) in its process.

Raw: ``{"op": "connect", "rank": r, "ports": [...], "hosts": [...]}`` -> ``connected``
(one TCP connection per pair of peers); ``{"op": "transfer", "bytes_per_link": b,
"start_at": t}`` -> ``transferred``: from ``start_at``, send ``b`` bytes to every other
peer while receiving ``b`` from each, all links at once.

A result is checked against the true mean on sampled blocks (first, last and evenly
spread ones, at least one in every part of a 4-member round): largest and RMS error, the
RMS of the mean itself, and a digest of the sampled values so the parent can see every
member holds the same result.

Only the standard library is imported at module level: the raw peers and the parent do
not pay for torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

#: Where processes listen unless told otherwise (``host``: the namespace lab's hosts).
LOOPBACK = "127.0.0.1"
#: Elements per independently seeded block of a member's vector: the checker rebuilds
#: any block of any member without building the whole vector.
BLOCK_ELEMENTS = 1 << 18
#: Blocks checked per result (first, last, and evenly spread between).
NUM_CHECKED_BLOCKS = 8
#: Most commands a process answers before it leaves by itself (the parent sends ~100).
MAX_COMMANDS = 10_000
#: Seconds hivemind's DHT process has to start.
HIVEMIND_JOIN_TIMEOUT = 300.0
#: Bytes per raw ``recv_into``.
RAW_RECV_BYTES = 1 << 20
#: Seconds a raw peer waits for the others to connect.
RAW_CONNECT_TIMEOUT = 60.0


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def sleep_until(when: float) -> None:
    delay = when - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _proc_table() -> dict[int, tuple[int, float]]:
    """PID -> (PPID, user + system CPU seconds) for every process in /proc."""
    table: dict[int, tuple[int, float]] = {}
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                # After the command name: state, ppid, ..., utime (14th), stime (15th).
                table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    return table


def _tree(pid: int, table: dict[int, tuple[int, float]]) -> list[int]:
    """``pid`` and its live descendants."""
    found, todo = [], [pid]
    while todo and len(found) < 10_000:
        current = todo.pop()
        if current in table and current not in found:
            found.append(current)
            todo += [child for child, (parent, _) in table.items() if parent == current]
    return found


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant, from /proc (0.0
    where there is no /proc)."""
    table = _proc_table()
    return sum(table[p][1] for p in _tree(pid, table))


def tree_memory_mb(pid: int) -> dict[str, float]:
    """Resident set of ``pid`` and its descendants now and at each one's peak (VmRSS,
    VmHWM, summed), in 10^6 bytes; empty where there is no /proc."""
    out = {"rss_MB": 0.0, "peak_rss_MB": 0.0}
    for member in _tree(pid, _proc_table()):
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{member}/status") as f:
                for line in f:
                    name, _, value = line.partition(":")
                    if name in ("VmRSS", "VmHWM"):
                        key = "rss_MB" if name == "VmRSS" else "peak_rss_MB"
                        out[key] += int(value.split()[0]) * 1024 / 1e6
    return out if out["rss_MB"] else {}


# --- data and checks (torch) -----------------------------------------------------------


def _block_range(block: int, elements: int) -> tuple[int, int]:
    start = block * BLOCK_ELEMENTS
    return start, min(start + BLOCK_ELEMENTS, elements)


def _fill(view: Any, seed: int, rank: int, block: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(((seed * 1009 + rank) << 24) + block)
    view.normal_(generator=generator)


def member_block(seed: int, rank: int, block: int, elements: int) -> Any:
    import torch

    start, end = _block_range(block, elements)
    out = torch.empty(end - start, dtype=torch.float32)
    _fill(out, seed, rank, block)
    return out


def member_tensor(seed: int, rank: int, elements: int) -> Any:
    """Member ``rank``'s vector: standard normal values, seeded block by block."""
    import torch

    out = torch.empty(elements, dtype=torch.float32)
    for block in range(-(-elements // BLOCK_ELEMENTS)):
        start, end = _block_range(block, elements)
        _fill(out[start:end], seed, rank, block)
    return out


def checked_blocks(elements: int) -> list[int]:
    num_blocks = -(-elements // BLOCK_ELEMENTS)
    if num_blocks <= NUM_CHECKED_BLOCKS:
        return list(range(num_blocks))
    step = (num_blocks - 1) / (NUM_CHECKED_BLOCKS - 1)
    return sorted({round(i * step) for i in range(NUM_CHECKED_BLOCKS)})


def check_result(result: Any, seed: int, num_members: int, elements: int) -> dict[str, Any]:
    """Errors of ``result`` against the equal-weight mean of every member's vector, on
    the sampled blocks; and a digest of those blocks of ``result``."""
    import torch

    worst = squared_error = squared_mean = 0.0
    count = 0
    digest = hashlib.sha256()
    for block in checked_blocks(elements):
        start, end = _block_range(block, elements)
        mean = torch.zeros(end - start, dtype=torch.float64)
        for rank in range(num_members):
            mean += member_block(seed, rank, block, elements).double()
        mean /= num_members
        got = result[start:end]
        error = got.double() - mean
        worst = max(worst, float(error.abs().max()))
        squared_error += float((error * error).sum())
        squared_mean += float((mean * mean).sum())
        count += end - start
        digest.update(got.contiguous().numpy().tobytes())
    return {
        "max_error": worst,
        "rms_error": math.sqrt(squared_error / count),
        "rms_mean": math.sqrt(squared_mean / count),
        "digest": digest.hexdigest()[:16],
    }


def make_codec(name: str) -> Any:
    from averaging.compression import Blockwise8BitCodec, Float16Codec, NoneCodec, Uniform8BitCodec

    codecs = {
        "none": NoneCodec,
        "float16": Float16Codec,
        "uint8": Uniform8BitCodec,
        "blockwise8": Blockwise8BitCodec,
    }
    return codecs[name]()


# --- ours ------------------------------------------------------------------------------


class _Member:
    """This process's vector and what the parent told it about it."""

    def __init__(self) -> None:
        self.local: Any = None
        self.seed = 0
        self.rank = 0
        self.elements = 0

    def prepare(self, command: dict[str, Any]) -> None:
        self.local = None  # free the previous size's vector first
        self.seed, self.rank = int(command["seed"]), int(command["rank"])
        self.elements = int(command["elements"])
        self.local = member_tensor(self.seed, self.rank, self.elements)

    def check(self, result: Any, num_members: int) -> dict[str, Any]:
        return check_result(result, self.seed, num_members, self.elements)


def _shares(members: Any, weights: Any, elements: int) -> dict[str, float]:
    """Each member's share of the vector to reduce, by PeerID: what the weights buy."""
    from averaging import RoundSpec

    spec = RoundSpec(
        round_id=bytes(16),
        members=tuple(members),
        weights=tuple(weights),
        total_elements=elements,
        chunk_elements=1,
        me=members[0],
    )
    return {
        str(m): (end - start) / elements
        for m, (start, end) in zip(members, spec.parts(), strict=True)
    }


def _allreduce_config(command: dict[str, Any]) -> Any:
    """A round's ``AllReduceConfig``: the codec named, links on as many connections as
    named, and the reverse lane on or off (the config's defaults where none is named)."""
    from averaging import AllReduceConfig

    changes: dict[str, Any] = {}
    if command.get("connections_per_member") is not None:
        changes["connections_per_member"] = int(command["connections_per_member"])
    if command.get("reverse_lane") is not None:
        changes["reverse_lane"] = bool(command["reverse_lane"])
    return AllReduceConfig(codec=make_codec(command["codec"]), **changes)


async def ours_node(node: Any) -> None:
    """The :mod:`peers.testing` target: serve commands until the parent stops us."""
    import asyncio

    import torch

    from averaging import (
        AllReduceService,
        Averager,
        AveragerConfig,
        MatchmakingConfig,
        RoundSpec,
        fold,
        replicate,
    )
    from averaging.allreduce.pace import paced
    from peers.dht import DHT, DHTConfig
    from peers.identity import PeerID

    torch.set_num_threads(1)  # 4 processes share the cores: no intra-op thread pools
    member = _Member()
    async with contextlib.AsyncExitStack() as stack:
        averager_scope = await stack.enter_async_context(contextlib.AsyncExitStack())
        # What serves the protocol now: the rounds' service or the steps' averager.
        round_service: AllReduceService | None = None
        averager: Averager | None = None
        averager_key: tuple[str, str] | None = None
        work: Any = None
        dht: Any = None
        node.report({"event": "serving"})
        for _ in range(MAX_COMMANDS):
            command = await node.receive()
            op = command.get("op")
            if op == "prepare":
                await averager_scope.aclose()  # the last size's averager and its vector
                averager, averager_key, round_service = None, None, None
                member.prepare(command)
                bounds = {c: make_codec(c).error_bound(member.local) for c in command["codecs"]}
                node.report({"event": "prepared", "bounds": bounds})
            elif op == "round":
                members = [(PeerID.from_base58(p), maddr) for p, maddr in command["members"]]
                for peer_id, maddr in members:
                    if peer_id != node.peer.peer_id:
                        node.peer.add_addresses(peer_id, [maddr])
                config = _allreduce_config(command)
                copies = int(command.get("reducers_per_part", 1))
                rates = command.get("rates")  # the links' rates: pace the round as for them
                spec = RoundSpec(
                    round_id=bytes.fromhex(command["round_id"]),
                    members=tuple(peer_id for peer_id, _ in members),
                    weights=tuple(1.0 for _ in members),
                    total_elements=member.elements * copies,
                    chunk_elements=config.chunk_elements,
                    me=node.peer.peer_id,
                    reducers_per_part=copies,
                )
                if rates:
                    config = paced(config, spec, [float(r) for r in rates])
                local = replicate(member.local, copies)
                # One service across rounds, as an Averager keeps its own (which it
                # registers in the service's place for the "step" command).
                if round_service is None:
                    await averager_scope.aclose()
                    averager, averager_key = None, None
                    round_service = await averager_scope.enter_async_context(
                        AllReduceService(node.peer)
                    )
                await asyncio.sleep(max(0.0, float(command["start_at"]) - time.monotonic()))
                started, cpu = time.monotonic(), time.process_time()
                outcome = await round_service.run_round(spec, local, 1.0, config)
                averaged = fold(outcome.result.averaged, copies).values
                ended, cpu = time.monotonic(), time.process_time() - cpu
                report = outcome.result.report
                node.report(
                    {
                        "event": "round",
                        "started": started,
                        "ended": ended,
                        "seconds": outcome.transfer.seconds,
                        "cpu_seconds": cpu,
                        **tree_memory_mb(os.getpid()),
                        "bytes_sent": outcome.transfer.bytes_sent,
                        "agreed": outcome.transfer.agreed,
                        "fraction": report.fraction_averaged,
                        "failed": sorted(str(m) for m in report.failed),
                        **member.check(averaged, len(members)),
                    }
                )
            elif op == "dht":
                config = DHTConfig(initial_peers=tuple(command.get("initial_peers", ())))
                dht = await stack.enter_async_context(DHT(node.peer, config))
                node.report({"event": "joined"})
            elif op == "step":
                gather = float(command["gather_seconds"])
                config = AveragerConfig(
                    prefix=str(command["prefix"]),
                    matchmaking=MatchmakingConfig(
                        target_group_size=int(command["num_members"]),
                        min_group_size=int(command["num_members"]),
                        gather_timeout=gather,
                        search_timeout=float(command["timeout"]),
                        form_when_full=True,  # as hivemind's leader does
                    ),
                    allreduce=_allreduce_config(command),
                )
                if averager is None or averager_key != (command["prefix"], command["codec"]):
                    # One averager per codec, kept across steps: it carries the rate it
                    # measured into the next step's matchmaking (the parts follow it).
                    await averager_scope.aclose()
                    round_service = None
                    work = member.local.clone()  # the Averager writes the result in place
                    averager = await averager_scope.enter_async_context(
                        Averager(dht, {"x": work}, config)
                    )
                    averager_key = (command["prefix"], command["codec"])
                work.copy_(member.local)  # every step averages the same inputs
                await asyncio.sleep(max(0.0, float(command["start_at"]) - time.monotonic()))
                started, cpu = time.monotonic(), time.process_time()
                try:
                    step = await averager.step(command["key"])
                except Exception as e:
                    node.report({"event": "step", "error": repr(e)[:500]})
                    continue
                ended, cpu = time.monotonic(), time.process_time() - cpu
                shares = _shares(step.group.members, step.group.weights, work.numel())
                node.report(
                    {
                        "event": "step",
                        "started": started,
                        "ended": ended,
                        "matchmaking_seconds": step.matchmaking_seconds,
                        "allreduce_seconds": step.allreduce_seconds,
                        "group_size": step.num_peers,
                        "cpu_seconds": cpu,
                        **tree_memory_mb(os.getpid()),
                        "agreed": step.outcome.transfer.agreed,
                        "shares": shares,
                        "measured": averager.bandwidth,  # what it announces next
                        **member.check(work, int(command["num_members"])),
                    }
                )
            else:
                return


# --- hivemind --------------------------------------------------------------------------


def _patched_extract(self: Any, serialized_tensor: Any) -> Any:
    """hivemind 1.1.12's ``Quantization.extract`` with its one numpy-2 failure fixed:
    ``int()`` of a 1-element array (an error since numpy 2.x) becomes ``int(array[0])``."""
    import numpy as np
    import torch

    buffer = serialized_tensor.buffer
    codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
    codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
    quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
    quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
    codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
    return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


def _hivemind_compression(name: str) -> Any:
    from hivemind.compression import (
        Float16Compression,
        NoCompression,
        Uniform8BitQuantization,
    )

    return {
        "none": NoCompression,
        "float16": Float16Compression,
        "uint8": Uniform8BitQuantization,
    }[name]()


def _codec_error(name: str) -> str:
    """What hivemind's codec raises on a small round trip in this process ("" if fine):
    inside an all-reduce such an error only shows as parts missing from the result."""
    import torch
    from hivemind.compression import CompressionInfo

    codec = _hivemind_compression(name)
    tensor = torch.randn(1024)
    try:
        codec.extract(codec.compress(tensor, CompressionInfo.from_tensor(tensor)))
    except Exception as e:
        return repr(e)[:300]
    return ""


def _timed_averager_class() -> Any:
    """``DecentralizedAverager`` that records when its all-reduce starts and ends.

    ``_aggregate_with_group`` runs after matchmaking, in the averager's own process: it
    balances the parts, runs hivemind's butterfly all-reduce and adds the result to the
    tensors in place. Its start and end go to shared memory for the caller to read.
    """
    import ctypes
    import multiprocessing as mp

    import torch
    from hivemind.averaging import DecentralizedAverager

    class TimedAverager(DecentralizedAverager):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.bench_times = mp.Array(ctypes.c_double, 2)  # before the fork in start=True
            super().__init__(*args, **kwargs)

        def run(self) -> None:
            torch.set_num_threads(1)  # as in every peer process of the benchmark
            super().run()

        async def _aggregate_with_group(self, *args: Any, **kwargs: Any) -> Any:
            self.bench_times[0] = time.monotonic()
            self.bench_times[1] = 0.0
            try:
                return await super()._aggregate_with_group(*args, **kwargs)
            finally:
                self.bench_times[1] = time.monotonic()

    return TimedAverager


def hivemind_node(options: dict[str, Any]) -> None:
    """One hivemind peer: start its DHT, print ``joined`` with its maddrs, serve commands."""
    import torch

    torch.set_num_threads(1)  # inherited by the processes it forks
    import hivemind
    from hivemind.compression import quantization

    began = time.monotonic()
    dht = hivemind.DHT(
        initial_peers=options.get("initial_peers") or None,
        host_maddrs=[f"/ip4/{options.get('host', LOOPBACK)}/tcp/0"],
        start=False,
    )
    averager: Any = None
    member = _Member()
    work: Any = None
    try:
        dht.run_in_background(await_ready=True, timeout=HIVEMIND_JOIN_TIMEOUT)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        emit({"event": "joined", "join_s": time.monotonic() - began, "addrs": maddrs})
        timed_averager = _timed_averager_class()
        stock_extract = quantization.Quantization.extract
        for _, line in zip(range(MAX_COMMANDS), sys.stdin, strict=False):
            command = json.loads(line)
            op = command.get("op")
            if op == "prepare":
                if averager is not None:
                    averager.shutdown()
                    averager = None
                work = None
                member.prepare(command)
                work = member.local.clone()
                emit({"event": "prepared", "bounds": {}})
            elif op == "averager":
                if averager is not None:
                    averager.shutdown()
                quantization.Quantization.extract = (
                    _patched_extract if command.get("patch_8bit") else stock_extract
                )
                seconds = float(command["matchmaking_seconds"])
                averager = timed_averager(
                    averaged_tensors=[work],
                    dht=dht,
                    prefix=str(command["prefix"]),
                    target_group_size=int(command["num_members"]),
                    min_group_size=int(command["num_members"]),
                    min_matchmaking_time=seconds,
                    request_timeout=min(3.0, seconds / 2),  # hivemind asks for < the above
                    sender_timeout=float(command["sender_timeout"]),
                    reducer_timeout=float(command["reducer_timeout"]),
                    allreduce_timeout=float(command["allreduce_timeout"]),
                    compression=_hivemind_compression(command["codec"]),
                    bandwidth=command.get("bandwidth"),
                    start=True,
                )
                emit({"event": "averager", "codec_error": _codec_error(command["codec"])})
            elif op == "step":
                with averager.get_tensors() as tensors:
                    tensors[0].copy_(member.local)  # every round averages the same inputs
                sleep_until(float(command["start_at"]))
                started, cpu = time.monotonic(), tree_cpu_seconds(os.getpid())
                try:
                    gathered = averager.step(timeout=float(command["timeout"]), allow_retries=False)
                except Exception as e:
                    emit({"event": "step", "error": repr(e)[:500]})
                    continue
                ended, cpu = time.monotonic(), tree_cpu_seconds(os.getpid()) - cpu
                if gathered is None:
                    emit({"event": "step", "error": "averager.step returned None (no group)"})
                    continue
                with averager.get_tensors() as tensors:
                    checked = member.check(tensors[0], int(command["num_members"]))
                emit(
                    {
                        "event": "step",
                        "started": started,
                        "ended": ended,
                        "allreduce_started": averager.bench_times[0],
                        "allreduce_ended": averager.bench_times[1],
                        "group_size": len(gathered),
                        "cpu_seconds": cpu,
                        **tree_memory_mb(os.getpid()),
                        **checked,
                    }
                )
            else:
                break
    finally:
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


# --- raw TCP ---------------------------------------------------------------------------


def _pattern(num_bytes: int) -> bytearray:
    """``num_bytes`` of non-zero, touched memory (zero pages would flatter a sender)."""
    chunk = os.urandom(1 << 20)
    out = bytearray(num_bytes)
    for offset in range(0, num_bytes, len(chunk)):
        piece = chunk[: num_bytes - offset]
        out[offset : offset + len(piece)] = piece
    return out


def _exchange(links: list[socket.socket], payload: memoryview, start_at: float) -> dict[str, Any]:
    """From ``start_at``, send ``payload`` on every link while receiving as many bytes
    from each, all at once (a sending and a receiving thread per link)."""
    errors: list[str] = []

    def send(link: socket.socket) -> None:
        try:
            link.sendall(payload)
        except OSError as e:
            errors.append(repr(e))

    def receive(link: socket.socket) -> None:
        buffer = bytearray(RAW_RECV_BYTES)
        left = len(payload)
        try:
            while left > 0:
                got = link.recv_into(buffer, min(left, len(buffer)))
                if got == 0:
                    raise ConnectionError("peer closed the link early")
                left -= got
        except OSError as e:
            errors.append(repr(e))

    threads = [
        threading.Thread(target=work, args=(link,)) for link in links for work in (send, receive)
    ]
    sleep_until(start_at)
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ended = time.monotonic()
    return {"event": "transferred", "started": started, "ended": ended, "errors": errors}


def raw_node(host: str = LOOPBACK) -> None:
    """All-to-all over plain TCP: the bytes a butterfly all-reduce moves, nothing else."""
    listener = socket.create_server((host, 0), backlog=64)
    emit({"event": "listening", "host": host, "port": listener.getsockname()[1]})
    links: list[socket.socket] = []
    payload = bytearray()
    for _, line in zip(range(MAX_COMMANDS), sys.stdin, strict=False):
        command = json.loads(line)
        op = command.get("op")
        if op == "connect":
            rank, ports = int(command["rank"]), [int(p) for p in command["ports"]]
            hosts = [str(h) for h in command.get("hosts", [LOOPBACK] * len(ports))]
            # Lower ranks dial higher ones; each link carries traffic both ways.
            for peer_host, port in list(zip(hosts, ports, strict=True))[rank + 1 :]:
                links.append(socket.create_connection((peer_host, port)))
            listener.settimeout(RAW_CONNECT_TIMEOUT)
            for _ in range(rank):
                links.append(listener.accept()[0])
            for link in links:
                link.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            emit({"event": "connected"})
        elif op == "transfer":
            num_bytes = int(command["bytes_per_link"])
            if len(payload) != num_bytes:
                payload = bytearray()  # free the previous size's first
                payload = _pattern(num_bytes)
            emit(_exchange(links, memoryview(payload), float(command["start_at"])))
        else:
            break
    for link in links:
        with contextlib.suppress(OSError):
            link.close()
    listener.close()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # so ``finally`` shuts hivemind's processes (and its daemon) down


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if sys.argv[1:2] == ["hivemind"] and len(sys.argv) == 3:
        hivemind_node(json.loads(sys.argv[2]))
    elif sys.argv[1:2] == ["raw"] and len(sys.argv) <= 3:
        raw_node(*sys.argv[2:])
    else:
        sys.exit("usage: python _allreduce_peers.py hivemind OPTIONS_JSON | raw [HOST]")
