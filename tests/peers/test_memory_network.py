"""The virtual clock and the in-memory network: time, order, faults, determinism."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import pytest

from peers import CallContext, DialError, Peer, PeersError, ProtocolNotSupported, StreamReset
from peers.addresses import with_peer_id
from peers.connection import Stream
from peers.echo import ECHO_PROTOCOL_ID, install_echo
from peers.errors import AddressError, PeerIDMismatch
from peers.memory_network import (
    Delivery,
    MemoryConnection,
    MemoryNetwork,
    MemoryPeer,
    MemoryStream,
)
from peers.rpc import FramedStream, add_unary_handler, call_unary
from peers.stream_api import AddressedHost, StreamHost, StreamLike
from peers.virtual_clock import Deadlock, Livelock, VirtualTimeExceeded, run_virtual

Run = Callable[[Coroutine[Any, Any, Any]], Any]

ECHO = "/test/echo/1.0.0"


async def serve_echo(stream: MemoryStream) -> None:
    """Send every frame back, then half-close at the caller's end of stream."""
    framed = FramedStream(stream)
    while (frame := await framed.read_frame()) is not None:
        await framed.write_frame(frame)
    await stream.close()


async def read_all(stream: MemoryStream) -> bytes:
    parts = []
    while data := await stream.read():
        parts.append(data)
    return b"".join(parts)


def now() -> float:
    return asyncio.get_running_loop().time()


# --- the virtual clock --------------------------------------------------------------


def test_an_hour_of_sleep_and_a_timeout_follow_the_virtual_clock() -> None:
    async def main() -> tuple[float, float, float]:
        start = now()
        await asyncio.sleep(3600)
        slept = now()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.Event().wait()
        return start, slept, now()

    start, slept, timed_out = run_virtual(main(), start=1000.0)
    assert start == 1000.0
    assert slept == pytest.approx(4600.0, abs=1e-6)
    assert timed_out == pytest.approx(4605.0, abs=1e-6)


def test_waiting_on_an_event_nobody_sets_is_a_deadlock() -> None:
    async def wait_forever() -> None:
        await asyncio.Event().wait()

    async def main() -> None:
        await asyncio.sleep(2)
        await wait_forever()

    with pytest.raises(Deadlock, match="wait_forever") as caught:
        run_virtual(main())
    assert isinstance(caught.value, PeersError)
    assert "at virtual time 2 s" in str(caught.value)


def test_spinning_without_time_moving_is_a_livelock() -> None:
    async def main() -> None:
        while True:  # noqa: ASYNC110 (the bug the guard is for)
            await asyncio.sleep(0)

    with pytest.raises(Livelock):
        run_virtual(main(), max_iterations_without_advance=1000)


def test_work_given_to_a_thread_runs_inline_and_takes_no_virtual_time() -> None:
    """``asyncio.to_thread`` (a state snapshot's hashing) runs at once in the loop's
    thread: same result, same exception, no virtual time, the same order every run."""

    async def main() -> None:
        loop_thread = threading.get_ident()
        started = now()
        assert await asyncio.to_thread(sum, [1, 2, 3]) == 6
        assert await asyncio.to_thread(threading.get_ident) == loop_thread
        with pytest.raises(ZeroDivisionError):
            await asyncio.to_thread(lambda: 1 / 0)
        assert now() == started

    run_virtual(main())


def test_a_run_stops_at_its_virtual_time_limit() -> None:
    async def main() -> None:
        await asyncio.sleep(10)

    with pytest.raises(VirtualTimeExceeded):
        run_virtual(main(), max_virtual_seconds=9)
    run_virtual(main(), max_virtual_seconds=10)


def test_leftover_tasks_are_cancelled_when_the_run_ends() -> None:
    cancelled = []

    async def background() -> None:
        try:
            await asyncio.sleep(1e9)
        except asyncio.CancelledError:
            cancelled.append(now())
            raise

    async def main() -> None:
        asyncio.get_running_loop().create_task(background())
        await asyncio.sleep(1)

    run_virtual(main())
    assert cancelled == [1.0]


# --- streams ------------------------------------------------------------------------


def test_echo_over_a_framed_stream_and_half_close() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=1) as net:
            a, b = net.add_peer(), net.add_peer()
            b.set_stream_handler(ECHO, serve_echo)
            stream = await a.new_stream(b.peer_id, ECHO)
            assert stream.remote_peer_id == b.peer_id
            framed = FramedStream(stream)
            frames: list[list[Any]] = [[0, i, bytes([i]) * (i * 1000)] for i in range(5)]
            for frame in frames:
                await framed.write_frame(frame)
            await stream.close()
            echoed: list[list[Any]] = []
            while (reply := await framed.read_frame()) is not None:
                echoed.append(reply)
            assert echoed == frames
            assert now() == pytest.approx(0.002, abs=1e-6)  # one round trip of 1 ms links

    run_virtual(main())


def test_unary_rpc_runs_over_the_memory_network() -> None:
    @dataclass(frozen=True)
    class Add:
        a: int
        b: int

    async def add(request: Add, context: CallContext) -> int:
        return request.a + request.b

    async def main() -> None:
        async with MemoryNetwork(seed=2) as net:
            a, b = net.add_peer(), net.add_peer()
            # rpc runs on any RpcHost (peers/stream_api.py): the memory peer is one.
            add_unary_handler(b, "/test/add", add, Add)
            total = await call_unary(a, b.peer_id, "/test/add", Add(2, 3), int)
            assert total == 5

    run_virtual(main())


def test_peers_have_addresses_that_dial_and_connect_the_peer_listening_there() -> None:
    """Each peer listens at its own 198.18.x.y address; an address (with or without
    /p2p/ID) opens a stream or connects to the peer there; one nobody listens at, a dead
    peer's, or one that names someone else is refused with the error a real dial gives."""

    async def main() -> None:
        async with MemoryNetwork(seed=4) as net:
            a, b, c = net.add_peer(), net.add_peer(), net.add_peer()
            assert [str(p.address) for p in (a, b, c)] == [
                f"/ip4/198.18.0.{i}/tcp/4001" for i in (1, 2, 3)
            ]
            assert a.listen_addrs == [with_peer_id(a.address, a.peer_id)]
            b.set_stream_handler(ECHO, serve_echo)
            for addr in (b.address, str(b.listen_addrs[0])):
                stream = await a.new_stream(addr, ECHO)
                assert stream.remote_peer_id == b.peer_id
                stream.reset()
            assert await a.connect(b.listen_addrs[0]) == b.peer_id
            assert a.connection_to(b.peer_id) == MemoryConnection(b.address)
            a.add_addresses(c.peer_id, [str(c.address)])
            assert a.address_book[c.peer_id] == [c.address]
            with pytest.raises(DialError, match="no peer of this in-memory network"):
                await a.new_stream("/ip4/198.18.7.7/tcp/4001", ECHO)
            with pytest.raises(AddressError, match="invalid multiaddr"):
                await a.connect("not an address")
            assert await a.connect(b.address) == b.peer_id  # and it goes on dialing
            with pytest.raises(PeerIDMismatch):
                await a.connect(with_peer_id(b.address, c.peer_id))
            net.kill(c)
            assert a.connection_to(c.peer_id) is None
            with pytest.raises(DialError, match="does not answer"):
                await a.connect(c.listen_addrs[0])

    run_virtual(main())


def test_a_protocol_the_remote_does_not_serve_fails_the_first_read() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=3) as net:
            a, b = net.add_peer(), net.add_peer()
            stream = await a.new_stream(b.peer_id, "/not/served")
            await stream.write(b"hello")  # lazily negotiated: the write goes out
            with pytest.raises(ProtocolNotSupported):
                await stream.read()
            with pytest.raises(StreamReset):
                await stream.read()

    run_virtual(main())


def test_order_is_kept_under_latency_jitter_and_bandwidth() -> None:
    sizes = [1, 70_000, 3, 300_000, 17, 5, 120_000, 2] * 4
    bandwidth = 1_000_000.0

    async def main() -> None:
        async with MemoryNetwork(seed=4, jitter_seconds=0.05) as net:
            a, b = net.add_peer(), net.add_peer()
            net.set_latency(a, b, 0.03)
            net.set_bandwidth(a, b, bandwidth, one_way=True)
            deliveries: list[Delivery] = []
            net.on_deliver = deliveries.append
            received: list[bytes] = []
            done = asyncio.Event()

            async def collect(stream: MemoryStream) -> None:
                received.append(await read_all(stream))
                done.set()

            b.set_stream_handler(ECHO, collect)
            stream = await a.new_stream(b.peer_id, ECHO)
            payload = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
            start = now()
            for data in payload:
                await stream.write(data)
            await stream.close()
            await done.wait()
            assert received == [b"".join(payload)]
            sent = [d for d in deliveries if d.src == a.peer_id]
            assert len(sent) > len(sizes)
            for earlier, later in itertools.pairwise(sent):
                assert earlier.due < later.due and earlier.time <= later.time
            # Transmission is serial: everything arrives no sooner than size / bandwidth.
            assert now() - start >= sum(sizes) / bandwidth

    run_virtual(main())


def test_a_one_way_cut_holds_frames_and_heal_delivers_them_in_order() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=5) as net:
            a, b = net.add_peer(), net.add_peer()
            inbound: list[MemoryStream] = []
            opened = asyncio.Event()

            async def keep(stream: MemoryStream) -> None:
                inbound.append(stream)
                opened.set()
                await stream.wait_failed()

            b.set_stream_handler(ECHO, keep)
            stream = await a.new_stream(b.peer_id, ECHO)
            await opened.wait()
            theirs = inbound[0]
            net.cut(a, b, one_way=True)
            for i in range(10):
                await stream.write(b"%d," % i)
            await asyncio.sleep(60)
            assert not theirs.has_buffered_data  # held, not delivered
            await theirs.write(b"back")  # the other direction still works
            assert await stream.read() == b"back"
            net.heal(a, b)
            assert await theirs.readexactly(20) == b"0,1,2,3,4,5,6,7,8,9,"
            stream.reset()

    run_virtual(main())


def test_a_writer_blocks_on_a_cut_link_once_the_window_is_full() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=6, window_bytes=1000) as net:
            a, b = net.add_peer(), net.add_peer()
            got: list[bytes] = []
            b.set_stream_handler(ECHO, lambda s: _append(got, read_all(s)))
            stream = await a.new_stream(b.peer_id, ECHO)
            net.cut(a, b)
            writing = asyncio.ensure_future(stream.write(b"x" * 5000))
            await asyncio.sleep(30)
            assert not writing.done()
            net.heal(a, b)
            await writing
            await stream.close()
            await asyncio.sleep(1)
            assert got == [b"x" * 5000]

    run_virtual(main())


async def _append(out: list[bytes], reading: Coroutine[Any, Any, bytes]) -> None:
    out.append(await reading)


def test_kill_resets_remote_reads_after_what_was_in_flight_and_dials_fail() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=7) as net:
            a, b, c = net.add_peer(), net.add_peer(), net.add_peer()
            handler_cancelled = asyncio.Event()

            async def speak_then_wait(stream: MemoryStream) -> None:
                await stream.write(b"last words")
                await asyncio.sleep(1e9)

            async def listen(stream: MemoryStream) -> None:
                try:
                    await asyncio.sleep(1e9)
                except asyncio.CancelledError:
                    handler_cancelled.set()
                    raise

            a.set_stream_handler(ECHO, speak_then_wait)
            c.set_stream_handler(ECHO, listen)
            from_b = await b.new_stream(a.peer_id, ECHO)
            to_c = await a.new_stream(c.peer_id, ECHO)
            await asyncio.sleep(0.0015)  # a's reply is on the wire, not yet at b
            net.kill(a)
            assert not a.is_alive
            assert await from_b.read() == b"last words"
            with pytest.raises(StreamReset, match="connection broke"):
                await from_b.read()
            await handler_cancelled.wait()  # c's handler for a's stream: cancelled
            assert to_c.is_reset
            with pytest.raises(DialError):
                await b.new_stream(a.peer_id, ECHO)
            with pytest.raises(DialError):
                await a.new_stream(b.peer_id, ECHO)

    run_virtual(main())


def test_reset_link_resets_both_ends_after_frames_in_flight() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=8) as net:
            a, b = net.add_peer(), net.add_peer()
            inbound: list[MemoryStream] = []
            served = asyncio.Event()

            async def keep(stream: MemoryStream) -> None:
                inbound.append(stream)
                served.set()
                await asyncio.sleep(1e9)  # hold it open; cancelled when the link resets

            b.set_stream_handler(ECHO, keep)
            ours = await a.new_stream(b.peer_id, ECHO)
            await served.wait()
            await ours.write(b"in flight")
            net.reset_link(a, b)
            with pytest.raises(StreamReset, match="connection broke"):
                await ours.read()
            (theirs,) = inbound
            assert await theirs.read() == b"in flight"
            with pytest.raises(StreamReset, match="connection broke"):
                await theirs.read()
            # A new connection works.
            b.remove_stream_handler(ECHO)
            b.set_stream_handler(ECHO, serve_echo)
            again = FramedStream(await a.new_stream(b.peer_id, ECHO))
            await again.write_frame([0, "hi"])
            assert await again.read_frame() == [0, "hi"]

    run_virtual(main())


def test_pause_holds_deliveries_until_it_ends() -> None:
    async def arrival(pause_seconds: float) -> float:
        async with MemoryNetwork(seed=9) as net:
            a, b = net.add_peer(), net.add_peer()
            b.set_stream_handler(ECHO, serve_echo)
            stream = FramedStream(await a.new_stream(b.peer_id, ECHO))
            await stream.write_frame([0, "first"])
            assert await stream.read_frame() == [0, "first"]
            if pause_seconds:
                net.pause(b, pause_seconds)
            start = now()
            await stream.write_frame([0, "second"])
            assert await stream.read_frame() == [0, "second"]
            return now() - start

    assert run_virtual(arrival(0)) == pytest.approx(0.002, abs=1e-6)
    assert run_virtual(arrival(5)) == pytest.approx(5.001, abs=1e-6)


def test_a_fault_fires_at_the_kth_frame_from_on_frame() -> None:
    async def main() -> None:
        async with MemoryNetwork(seed=10) as net:
            a, b = net.add_peer(), net.add_peer()
            got: list[bytes] = []
            b.set_stream_handler(ECHO, lambda s: _append(got, read_all(s)))

            def cut_at_third(src: Any, dst: Any, protocol: str, num_bytes: int) -> None:
                assert (src, dst, protocol) == (a.peer_id, b.peer_id, ECHO)
                if net.num_frames_sent(a, b) == 3:
                    net.cut(a, b)

            net.on_frame = cut_at_third
            stream = await a.new_stream(b.peer_id, ECHO)
            for i in range(5):
                await stream.write(b"%d" % i)
            await stream.close()
            await asyncio.sleep(10)
            assert got == []  # the end of stream is held behind frame 3
            assert net.num_frames_sent(a, b) == 5
            net.heal(a, b)
            await asyncio.sleep(1)
            assert got == [b"01234"]

    run_virtual(main())


# --- determinism --------------------------------------------------------------------


def _trace(seed: int) -> list[tuple[float, float, bytes, bytes, str, int]]:
    async def main() -> list[tuple[float, float, bytes, bytes, str, int]]:
        deliveries: list[Delivery] = []
        async with MemoryNetwork(seed=seed, jitter_seconds=0.01) as net:
            net.on_deliver = deliveries.append
            peers = [net.add_peer() for _ in range(4)]
            for peer in peers:
                peer.set_stream_handler(ECHO, serve_echo)

            async def talk(src: MemoryPeer, dst: MemoryPeer) -> None:
                framed = FramedStream(await src.new_stream(dst.peer_id, ECHO))
                for i in range(3):
                    await framed.write_frame([0, i, b"y" * 50_000])
                await framed.stream.close()
                while await framed.read_frame() is not None:
                    pass

            net.pause(peers[2], 0.004)
            async with asyncio.TaskGroup() as group:
                for src in peers:
                    for dst in peers:
                        if src is not dst:
                            group.create_task(talk(src, dst))
        return [
            (d.time, d.due, d.src.to_bytes(), d.dst.to_bytes(), d.kind, d.num_bytes)
            for d in deliveries
        ]

    return run_virtual(main())


def test_same_seed_same_program_gives_the_same_deliveries() -> None:
    first = _trace(11)
    assert len(first) > 100
    assert _trace(11) == first
    assert _trace(12) != first


# --- the surfaces -------------------------------------------------------------------

_STREAM_MEMBERS = [
    "protocol",
    "remote_peer_id",
    "has_buffered_data",
    "is_reset",
    "read",
    "read_chunks",
    "readexactly",
    "unread",
    "write",
    "write_many",
    "close",
    "reset",
    "wait_failed",
    "on_failure",
    "remove_on_failure",
]


def test_real_and_memory_classes_satisfy_the_protocols(arun: Run) -> None:
    """Statically, mypy checks peers.memory_network._conforms; here, at run time."""
    for cls in (Stream, MemoryStream):
        missing = [name for name in _STREAM_MEMBERS if name not in dir(cls)]
        missing = [m for m in missing if m != "protocol"]  # an instance attribute
        assert missing == [], cls

    async def memory() -> None:
        async with MemoryNetwork(seed=13) as net:
            a, b = net.add_peer(), net.add_peer()
            b.set_stream_handler(ECHO, serve_echo)
            assert isinstance(a, StreamHost) and isinstance(a, AddressedHost)
            assert isinstance(await a.new_stream(b.peer_id, ECHO), StreamLike)

    run_virtual(memory())

    async def real() -> None:
        async with Peer() as a, Peer() as b:
            install_echo(a)
            assert isinstance(b, StreamHost) and isinstance(b, AddressedHost)
            b.add_addresses(a.peer_id, a.listen_addrs)
            stream = await b.new_stream(a.peer_id, ECHO_PROTOCOL_ID)
            assert isinstance(stream, StreamLike)
            stream.reset()

    arun(real())
