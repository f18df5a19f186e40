"""The collaborative optimizer in one process: what it leaves behind when it closes."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time

import pytest
import torch

from averaging.state.manifest import TensorSpec
from peers import KeyPair, PeerConfig
from peers.dht import BlockingDHT
from peers.dht.ids import Contact
from swarm.collaborative.config import CollaborativeConfig
from swarm.collaborative.optimizer import CollaborativeOptimizer
from swarm.collaborative.state import pack_state


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
            return len(opt.driver._tasks)

        assert dht.peer.run(left(), timeout=5) == 0


def test_config_checks_the_cadence_and_the_aggregation() -> None:
    from averaging import CenteredClipConfig
    from swarm.collaborative.config import DiLoCoConfig, OptimizerError

    CollaborativeConfig(run_id="r", target_batch_size=8, aggregation=CenteredClipConfig())
    bad: list[dict[str, object]] = [
        {"refresh_interval": 0.01},  # below progress_interval
        {"refresh_interval": 6.0},  # a live record would expire between publications
        {"refresh_interval": 0.0},
        {"aggregation": "centered-clip"},
        {"error_feedback": True},  # gradients travel exact by default: nothing to feed back
        {"error_feedback": True, "diloco": DiLoCoConfig(codec="none")},
    ]
    for fields in bad:
        with pytest.raises(OptimizerError):
            CollaborativeConfig(run_id="r", target_batch_size=8, **fields)  # type: ignore[arg-type]
    CollaborativeConfig(run_id="r", target_batch_size=8, error_feedback=True, diloco=DiLoCoConfig())


def test_a_record_is_republished_when_it_changed_or_grew_old() -> None:
    with BlockingDHT() as dht:
        param = torch.nn.Parameter(torch.zeros(4))
        config = CollaborativeConfig(run_id="cadence", target_batch_size=8)
        with CollaborativeOptimizer(torch.optim.SGD([param], lr=0.1), dht, config) as opt:
            driver = opt.driver

            async def check() -> None:  # on the loop, whose clock stamps publications
                mine = driver.machine.mine(driver.clock())
                now = asyncio.get_running_loop().time()
                driver._published = (mine, now)
                assert not driver._stale(mine)  # unchanged and fresh
                more = dataclasses.replace(mine, samples=mine.samples + 4, time=mine.time + 0.01)
                assert not driver._stale(more)  # changed, but published within progress_interval
                driver._published = (mine, now - 2 * config.progress_interval)
                assert driver._stale(more)
                assert not driver._stale(dataclasses.replace(mine, time=mine.time + 0.1))
                driver._published = (mine, now - config.refresh_interval)
                assert driver._stale(mine)  # unchanged, but due for a refresh

            dht.peer.run(check())


def test_a_nan_update_is_dropped_and_training_goes_on() -> None:
    """A diverged batch's gradient never reaches a round (nor, alone, the parameters):
    the peer drops it, tries to resync, and its next finite step is taken."""
    with BlockingDHT() as dht:
        param = torch.nn.Parameter(torch.ones(4))
        config = CollaborativeConfig(run_id="nan", target_batch_size=8, state_timeout=1.0)
        with CollaborativeOptimizer(torch.optim.SGD([param], lr=0.5), dht, config) as opt:
            param.grad = torch.tensor([1.0, float("nan"), 0.0, float("inf")])
            opt.step(8)
            assert opt.epoch == 0 and opt.accumulated == 0
            assert torch.equal(param.detach(), torch.ones(4))
            param.grad = torch.full((4,), 2.0)
            opt.step(8)
            assert opt.epoch == 1
            assert torch.equal(param.detach(), torch.zeros(4))  # 1 - 0.5 * 2


def test_a_loaded_state_carries_its_rounds_fingerprint_and_a_malformed_one_is_refused() -> None:
    """A late joiner that loads the swarm's state is on the branch of the round that made
    it (before, it came with no fingerprint, saw itself split from everyone and loaded a
    second time); a donor's fingerprint that is not a short byte string (``10**12`` would
    have become a terabyte of zeros) is refused before any download."""
    loopback = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
    config = CollaborativeConfig(run_id="fingerprint", target_batch_size=8, state_timeout=10.0)
    with BlockingDHT(peer_config=loopback) as first:
        address = str(first.peer.listen_addrs[0])
        with BlockingDHT([address], peer_config=loopback) as second:
            old, new = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
            with CollaborativeOptimizer(torch.optim.SGD([old], lr=0.5), first, config) as donor:
                for _ in range(3):  # alone: each step has a fingerprint of its own
                    old.grad = torch.ones(4)
                    donor.step(8)
                assert donor.epoch == 3
                with CollaborativeOptimizer(
                    torch.optim.SGD([new], lr=0.5), second, config
                ) as joiner:
                    for _ in range(200):  # bounded: 0.05 s each
                        if joiner.swarm_progress().epoch == 3:
                            break
                        time.sleep(0.05)
                    assert joiner.load_state_from_peers()
                    assert joiner.epoch == 3 and torch.equal(new.detach(), old.detach())
                    assert (
                        joiner.driver.machine.fingerprint == donor.driver.machine.fingerprint != b""
                    )
                    specs = [TensorSpec("extra/param/0", "float32", [4])]
                    for bad in (10**12, b"x" * 33, "text"):
                        _, metadata = pack_state(
                            [new], {"inner": joiner.optimizer}, {"epoch": 3, "fingerprint": bad}
                        )
                        problem = joiner.driver._state_problem(3, specs, metadata)
                        assert problem is not None and "fingerprint" in problem, problem
