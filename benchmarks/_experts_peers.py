"""Child processes of ``bench_experts.py``: one server or one client of one system each.

Started with multiprocessing's ``spawn`` context; each talks to the parent over a pipe:
it sends ``("ready", info)`` (and ``("pids", [...])`` for daemons it starts), then
answers ``("measure", options)`` with ``("ok", seconds_per_call)`` until ``("stop", _)``
or the pipe closes. Every child runs torch on one thread: the machine is shared by a
server and a client, and both systems get the same.

A measurement is ``calls`` timed calls after ``warmup`` untimed ones, on one batch:
``forward`` runs the module under ``torch.no_grad()``; ``forward_backward`` runs it on an
input that requires grad and backpropagates a fixed output gradient (the server then
recomputes the forward, backpropagates and takes an Adam step; the local module does
the same step, without the recomputation). Servers and the local module take
``{"fused_adam": bool}``: torch's fused Adam, or its plain one; our server and the local
module also ``{"linear_kernels": ...}`` (:mod:`swarm.experts.kernels`), and our server
reports which its Linear layers use. A local module given it computes as our server
does, with those kernels and the kept heap (:func:`peers.runtime.keep_freed_memory`);
without it, as plain torch in a plain process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from _common import run_role

HIDDEN = 1024
UID = "ffn.0.0"
HIVEMIND_UID = "expert.0"
LOOPBACK = "127.0.0.1"
#: Seconds a child lives at most: it exits by itself if the parent forgets it.
CHILD_LIFETIME = 900.0
#: Seconds one call may take before the run is declared broken.
CALL_TIMEOUT = 60.0
#: Most commands a child answers before it stops by itself.
MAX_COMMANDS = 10_000


def child_entry(role: str, conn: Connection, options: dict[str, Any]) -> None:
    """Entry point of every spawned child: run ``role``, report a failure on the pipe.
    With ``{"namespace": name}`` the child first enters that network namespace (the
    namespace lab's hosts, for ``bench_wan.py``); servers listen on ``{"host": ip}``."""
    if options.get("namespace"):
        from peers.netlab import enter_namespace

        enter_namespace(options["namespace"])  # before any thread starts
    import torch

    torch.set_num_threads(1)
    run_role(ROLES, role, conn, options)


def _listen(options: dict[str, Any]) -> str:
    return f"/ip4/{options.get('host', LOOPBACK)}/tcp/0"


def _serve_commands(
    conn: Connection, measure: Callable[[dict[str, Any]], list[float]] | None
) -> None:
    deadline = time.monotonic() + CHILD_LIFETIME
    for _ in range(MAX_COMMANDS):
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            return
        try:
            kind, options = conn.recv()
        except (EOFError, OSError):
            return
        if kind == "stop":
            return
        try:
            assert measure is not None, "servers take no measurements"
            conn.send(("ok", measure(options)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _timed(call: Callable[[Any, Any], None], options: dict[str, Any]) -> list[float]:
    import torch

    gen = torch.Generator().manual_seed(options["batch"])
    x = torch.randn(options["batch"], HIDDEN, generator=gen)
    g = torch.randn(options["batch"], HIDDEN, generator=gen)
    seconds = []
    for i in range(options["warmup"] + options["calls"]):
        started = time.perf_counter()
        call(x, g)
        if i >= options["warmup"]:
            seconds.append(time.perf_counter() - started)
    return seconds


def _module_measure(
    module: Any, after_backward: Callable[[], None]
) -> Callable[[dict[str, Any]], list[float]]:
    """Measurements of any torch module (local, ours or hivemind's RemoteExpert)."""
    import torch

    def forward(x: Any, g: Any) -> None:
        with torch.no_grad():
            module(x)

    def forward_backward(x: Any, g: Any) -> None:
        module(x.requires_grad_()).backward(g)
        after_backward()

    def measure(options: dict[str, Any]) -> list[float]:
        return _timed(forward if options["mode"] == "forward" else forward_backward, options)

    return measure


# --- ours -----------------------------------------------------------------------------


def _ours_server(conn: Connection, options: dict[str, Any]) -> None:
    import asyncio

    import torch

    from peers import BlockingPeer, PeerConfig
    from peers.runtime import keep_freed_memory
    from swarm.experts import ExpertServer, ModuleBackend, ServerConfig
    from swarm.experts.layers import ffn

    module, specs = ffn(HIDDEN)
    backend = ModuleBackend(
        UID,
        module,
        inputs=specs,
        max_batch_size=1024,
        optimizer=torch.optim.Adam(module.parameters(), fused=options["fused_adam"]),
        # hivemind's backend does not clip by default: the same work on both sides. Our
        # default clipping costs about 1.5 ms a step on this module (docs/experts-trust.md).
        clip_grad_norm=None,
    )
    # The ExpertServer tunes the heap for the threads started after it; tuned first, the
    # peer's loop thread (where a batch-1 forward runs) shares it too, as under peers.run.
    keep_freed_memory()
    peer = BlockingPeer(PeerConfig(listen_addrs=(_listen(options),)))
    stop = asyncio.Event()

    config = ServerConfig(linear_kernels=options["linear_kernels"])
    used: list[str] = []

    async def host(ready: asyncio.Future[None]) -> None:
        async with ExpertServer(peer.peer, [backend], config) as server:
            used.append(server.statistics().linear_kernels)
            ready.set_result(None)
            await stop.wait()

    async def begin() -> asyncio.Task[None]:
        ready = asyncio.get_running_loop().create_future()
        hosting = asyncio.create_task(host(ready))
        await asyncio.wait([ready, hosting], return_when=asyncio.FIRST_COMPLETED)
        if hosting.done():
            hosting.result()  # it failed before it was ready: raise why
        return hosting

    async def end(hosting: asyncio.Task[None]) -> None:
        stop.set()
        await hosting  # the server has stopped before the peer closes under it

    hosting = peer.run(begin(), timeout=60)
    conn.send(("ready", {"addrs": [str(a) for a in peer.listen_addrs], "kernels": used[0]}))
    try:
        _serve_commands(conn, None)
    finally:
        peer.run(end(hosting), timeout=10)
        peer.close()


def _ours_client(conn: Connection, options: dict[str, Any]) -> None:
    from peers import BlockingPeer, PeerConfig, PeerID
    from swarm.experts import ExpertCallConfig, ExpertLocation, RemoteExpert

    addr: str = options["addrs"][0]
    peer = BlockingPeer(PeerConfig(listen_addrs=()))
    try:
        location = ExpertLocation(UID, PeerID.from_base58(addr.rsplit("/p2p/", 1)[1]), (addr,))
        config = ExpertCallConfig(forward_timeout=CALL_TIMEOUT, backward_timeout=CALL_TIMEOUT)
        expert = RemoteExpert(location, peer, config)
        _ = expert.info
        conn.send(("ready", {}))
        _serve_commands(conn, _module_measure(expert, lambda: None))
    finally:
        peer.close()


def _local(conn: Connection, options: dict[str, Any]) -> None:
    import torch

    from swarm.experts.kernels import use_linear_kernels
    from swarm.experts.layers import ffn

    module, _ = ffn(HIDDEN)
    if "linear_kernels" in options:  # computed as our server computes: its kernels, its heap
        from peers.runtime import keep_freed_memory

        keep_freed_memory()
        use_linear_kernels(module, options["linear_kernels"])
    optimizer = torch.optim.Adam(module.parameters(), fused=options["fused_adam"])

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    conn.send(("ready", {}))
    _serve_commands(conn, _module_measure(module, step))


# --- hivemind -------------------------------------------------------------------------


def _quiet_hivemind() -> None:
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")


def _silence_stderr() -> None:
    """hivemind's shutdown prints warnings and tracebacks of its own processes and event
    loops that say nothing about the measurement; they would bury the table."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def _hivemind_server(conn: Connection, options: dict[str, Any]) -> None:
    _quiet_hivemind()
    import torch
    from hivemind.moe.server import Server

    server = Server.create(
        expert_uids=[HIVEMIND_UID],
        expert_cls="ffn",
        hidden_dim=HIDDEN,
        max_batch_size=1024,
        optim_cls=functools.partial(torch.optim.Adam, fused=options["fused_adam"]),
        device="cpu",
        host_maddrs=[_listen(options)],
        start=True,
    )
    try:
        conn.send(("pids", _descendants_hint()))
        maddrs = [str(m) for m in server.dht.get_visible_maddrs()]
        conn.send(("ready", {"addrs": maddrs, "peer_id": server.dht.peer_id.to_base58()}))
        _serve_commands(conn, None)
    finally:
        _silence_stderr()
        server.shutdown()


def _descendants_hint() -> list[int]:
    """Our child processes now (hivemind's DHT, handlers, p2pd), for the parent to stop."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stat = open(f"/proc/{entry}/stat").read().rpartition(")")[2].split()
                    if int(stat[1]) == os.getpid():
                        found.append(int(entry))
    return found


def _hivemind_client(conn: Connection, options: dict[str, Any]) -> None:
    _quiet_hivemind()
    import hivemind
    from hivemind.moe.client.expert import create_remote_experts
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import PeerID

    dht = hivemind.DHT(initial_peers=options["addrs"], client_mode=True, start=True)
    try:
        info = ExpertInfo(HIVEMIND_UID, PeerID.from_base58(options["peer_id"]))
        (expert,) = create_remote_experts([info], dht)
        _ = expert.info
        conn.send(("ready", {}))
        _serve_commands(conn, _module_measure(expert, lambda: None))
    finally:
        _silence_stderr()
        dht.shutdown()


ROLES: dict[str, Callable[[Connection, dict[str, Any]], None]] = {
    "ours_server": _ours_server,
    "ours_client": _ours_client,
    "hivemind_server": _hivemind_server,
    "hivemind_client": _hivemind_client,
    "local": _local,
}
