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


#: Run in a fresh interpreter: stores still dialing a peer that never answers when the
#: DHT and its peer close. The listener is never accepted from, so each dial waits in
#: its handshake (10 s) until cancelled; accept() returning means one is in flight.
_CLOSE_WITH_STORES_IN_FLIGHT = """
import asyncio, concurrent.futures, gc, socket, time
from peers import KeyPair
from peers.dht import BlockingDHT, dht_time
from peers.dht.ids import Contact

silent = socket.create_server(("127.0.0.1", 0))
silent.settimeout(10)
dht = BlockingDHT()
ghost = Contact(KeyPair.generate().peer_id, (f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}",))

async def meet_ghost():
    dht.node.routing.update(ghost, time.monotonic())

dht.peer.run(meet_ghost())
stores = [dht.peer.submit(dht.node.store("k", i, dht_time() + 60)) for i in range(3)]
held, _ = silent.accept()
started = time.monotonic()
dht.close()
print("closed in", round(time.monotonic() - started, 1), flush=True)
assert all(f.done() for f in stores), stores
assert not asyncio.all_tasks(dht.peer._loop)
del dht, stores
gc.collect()
print("ok", flush=True)
"""


def test_closing_with_calls_in_flight_ends_them_before_the_loop_closes() -> None:
    """The facade owns what ``submit`` runs: closing cancels the calls still running and
    waits for them, so the loop closes with no task pending on it and nothing printed
    ("Task was destroyed but it is pending", "Event loop is closed" from a call's
    cleanup, "Task exception was never retrieved")."""
    out = subprocess.run(
        [sys.executable, "-c", _CLOSE_WITH_STORES_IN_FLIGHT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout, out.stdout
    for noise in (
        "Traceback",
        "Task was destroyed",
        "Event loop is closed",
        "exception was never retrieved",
        "never awaited",
    ):
        assert noise not in out.stderr, out.stderr


def test_interpreter_exit_ends_a_dht_left_open_quietly() -> None:
    """A BlockingDHT nobody closed: at exit its peer closes, and the node it holds (a
    call still running on the facade) is cancelled and left cleanly before the loop
    closes, rather than destroyed pending on a closed loop."""
    code = (
        "from peers.dht import BlockingDHT\n"
        "a = BlockingDHT()\n"
        "b = BlockingDHT([str(a.peer.listen_addrs[0])])\n"
        "b.store('k', 1, ttl=60)\n"
        "print('stored', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "stored" in out.stdout
    assert "Task was destroyed" not in out.stderr and "Event loop is closed" not in out.stderr
