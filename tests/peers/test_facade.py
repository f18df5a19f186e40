"""The blocking facade, used from plain (non-async) code."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from peers import BlockingPeer, CallContext, PeersError, RemoteError
from peers.echo import ECHO_PROTOCOL_ID, install_echo


def test_blocking_calls_and_futures() -> None:
    with BlockingPeer() as server, BlockingPeer() as client:
        server.run(_install(server))
        addr = server.listen_addrs[0]
        assert client.connect(addr, timeout=10) == server.peer_id
        assert client.ping(server.peer_id, timeout=10) > 0
        assert client.call_unary(addr, ECHO_PROTOCOL_ID, "hi", str, timeout=10) == "hi"
        futures = [
            client.call_unary_future(addr, ECHO_PROTOCOL_ID, str(i), str, timeout=10)
            for i in range(20)
        ]
        assert [f.result(10) for f in futures] == [str(i) for i in range(20)]


async def _install(peer: BlockingPeer) -> None:
    install_echo(peer.peer)


def test_plain_function_handlers_run_off_the_loop() -> None:
    loop_threads: list[str] = []

    def square(request: int, context: CallContext) -> int:
        loop_threads.append(threading.current_thread().name)
        if request < 0:
            raise ValueError("no negatives")
        return request * request

    with BlockingPeer() as server, BlockingPeer() as client:
        server.add_unary_handler("/test/square/1.0.0", square, int)
        assert (
            client.call_unary(server.listen_addrs[0], "/test/square/1.0.0", 7, int, timeout=10)
            == 49
        )
        with pytest.raises(RemoteError, match="no negatives"):
            client.call_unary(server.listen_addrs[0], "/test/square/1.0.0", -1, int, timeout=10)
        assert loop_threads and "swarmtrain-peer" not in loop_threads[0]


def test_close_is_idempotent_and_stops_the_thread() -> None:
    peer = BlockingPeer()
    thread = peer._thread
    peer.close()
    peer.close()
    assert not thread.is_alive()
    with pytest.raises(PeersError, match="closed"):
        peer.connect("/ip4/127.0.0.1/tcp/1")


def test_interpreter_exit_closes_peers_cleanly() -> None:
    code = (
        "from peers import BlockingPeer\np = BlockingPeer()\nprint(p.listen_addrs[0], flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "/p2p/" in out.stdout
    assert "Traceback" not in out.stderr and "Task was destroyed" not in out.stderr
