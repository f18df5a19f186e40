"""The collaborative optimizer in one process: what it leaves behind when it closes."""

from __future__ import annotations

import socket
import time

import torch

from peers import KeyPair
from peers.dht import BlockingDHT
from peers.dht.ids import Contact
from swarm.optimizer import CollaborativeOptimizer
from swarm.optimizer_config import CollaborativeConfig


def _wait_until_closed(conn: socket.socket, timeout: float) -> bool:
    """True once the other end closes ``conn`` (within ``timeout`` seconds)."""
    conn.settimeout(timeout)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_close_cancels_the_progress_publishes_in_flight() -> None:
    """Progress is published in the background; a publish still dialing a peer that
    never answers when the optimizer closes is the optimizer's to end: its dial is
    abandoned at once (not at its 10 s handshake timeout), and no task of it is left
    to be destroyed pending when the DHT's loop closes."""
    with socket.create_server(("127.0.0.1", 0)) as silent, BlockingDHT() as dht:
        silent.settimeout(10)
        port = silent.getsockname()[1]
        ghost = Contact(KeyPair.generate().peer_id, (f"/ip4/127.0.0.1/tcp/{port}",))

        async def meet_ghost() -> None:
            dht.node.routing.update(ghost, time.monotonic())

        dht.peer.run(meet_ghost())
        param = torch.nn.Parameter(torch.zeros(4))
        opt = CollaborativeOptimizer(
            torch.optim.SGD([param], lr=0.1),
            dht,
            CollaborativeConfig(run_id="close", target_batch_size=8),
        )
        held, _ = silent.accept()  # a publish is dialing the ghost: it is in flight
        with held:
            started = time.monotonic()
            opt.close()
            assert time.monotonic() - started < 3.0
            assert _wait_until_closed(held, timeout=3.0), "the publish still dials"

        async def left() -> int:
            return len(opt._tasks)

        assert dht.peer.run(left(), timeout=5) == 0
