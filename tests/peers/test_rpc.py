"""Two in-process peers on loopback: connections, identify, ping and RPC semantics."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from peers import (
    CallContext,
    DialError,
    KeyPair,
    Peer,
    PeerIDMismatch,
    PeersError,
    ProtocolNotSupported,
    RemoteError,
    with_peer_id,
)
from peers.addresses import split_peer_id
from peers.echo import ECHO_PROTOCOL_ID, ECHO_STREAM_PROTOCOL_ID, install_echo

Run = Callable[[Coroutine[Any, Any, Any]], Any]


@dataclass(frozen=True)
class Add:
    a: int
    b: int


@dataclass(frozen=True)
class Sum:
    total: int
    served_by: str


def test_connect_identify_ping(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as a, Peer() as b:
            install_echo(a)
            remote = await b.connect(a.listen_addrs[0])
            assert remote == a.peer_id
            info = await b.identify(remote)
            assert info.peer_id == a.peer_id
            assert ECHO_PROTOCOL_ID in info.protocols and "/ipfs/ping/1.0.0" in info.protocols
            assert info.agent_version.startswith("swarmtrain/")
            assert [str(x) for x in info.listen_addrs] == [
                str(split_peer_id(x)[0]) for x in a.listen_addrs
            ]
            assert 0 < await b.ping(remote) < 5
            # the connection was reused for all of that
            assert b.statistics().num_connections == 1
            # and a sees b as the same authenticated peer
            assert a.connected_peers() == [b.peer_id]

    arun(main())


def test_unary_typed_call_and_remote_error(arun: Run) -> None:
    async def add(request: Add, context: CallContext) -> Sum:
        if request.a < 0:
            raise ValueError(f"negative operand {request.a}")
        return Sum(request.a + request.b, str(context.remote_peer_id))

    async def main() -> None:
        async with Peer() as a, Peer() as b:
            a.add_unary_handler("/test/add/1.0.0", add, Add)
            result = await b.call_unary(a.listen_addrs[0], "/test/add/1.0.0", Add(2, 3), Sum)
            assert result == Sum(5, str(b.peer_id))
            with pytest.raises(RemoteError) as info:
                await b.call_unary(a.peer_id, "/test/add/1.0.0", Add(-1, 3), Sum)
            assert info.value.remote_type == "ValueError"
            assert "negative operand -1" in info.value.remote_message
            # a request of the wrong shape is refused at the remote's edge, clearly
            with pytest.raises(RemoteError, match="WireError"):
                await b.call_unary(a.peer_id, "/test/add/1.0.0", {"a": 1}, Sum)
            with pytest.raises(ProtocolNotSupported):
                await b.call_unary(a.peer_id, "/test/nothing/1.0.0", Add(1, 1), Sum)
            # still fine afterwards, on the same connection
            assert (await b.call_unary(a.peer_id, "/test/add/1.0.0", Add(1, 1), Sum)).total == 2
            assert b.statistics().num_connections == 1

    arun(main())


def test_deadline_and_cancel_cancel_the_remote_handler(arun: Run) -> None:
    async def main() -> None:
        started = asyncio.Event()
        cancelled: list[float | None] = []
        cancellation = asyncio.Event()

        async def slow(request: int, context: CallContext) -> int:
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(context.timeout)
                cancellation.set()
                raise
            return request

        async with Peer() as a, Peer() as b:
            a.add_unary_handler("/test/slow/1.0.0", slow, int)
            with pytest.raises(TimeoutError):
                await b.call_unary(a.listen_addrs[0], "/test/slow/1.0.0", 1, int, timeout=0.3)
            async with asyncio.timeout(5):
                await cancellation.wait()
            assert cancelled == [0.3]  # the handler saw the caller's deadline
            # explicit cancellation of the calling task
            started.clear()
            cancellation.clear()
            call = asyncio.ensure_future(b.call_unary(a.peer_id, "/test/slow/1.0.0", 2, int))
            async with asyncio.timeout(5):
                await started.wait()
            call.cancel()
            async with asyncio.timeout(5):
                await cancellation.wait()
            assert cancelled[1] is None

    arun(main())


def test_remote_handler_deadline_raises_there_too(arun: Run) -> None:
    async def main() -> None:
        async def sleepy(request: float, context: CallContext) -> float:
            await asyncio.sleep(request)
            return request

        async with Peer() as a, Peer() as b:
            a.add_unary_handler("/test/sleepy/1.0.0", sleepy, float)
            assert (
                await b.call_unary(a.listen_addrs[0], "/test/sleepy/1.0.0", 0.01, float, timeout=5)
                == 0.01
            )

    arun(main())


def test_bidirectional_streaming(arun: Run) -> None:
    async def running_sum(requests: AsyncIterator[int], context: CallContext) -> AsyncIterator[int]:
        total = 0
        async for value in requests:
            total += value
            yield total

    async def failing(requests: AsyncIterator[int], context: CallContext) -> AsyncIterator[int]:
        async for value in requests:
            if value == 3:
                raise KeyError("three is not allowed")
            yield value

    async def main() -> None:
        async with Peer() as a, Peer() as b:
            a.add_stream_handler("/test/sum/1.0.0", running_sum, int)
            a.add_stream_handler("/test/failing/1.0.0", failing, int)
            out = [
                x
                async for x in b.call_stream(a.listen_addrs[0], "/test/sum/1.0.0", range(1, 6), int)
            ]
            assert out == [1, 3, 6, 10, 15]

            async def slowly() -> AsyncIterator[int]:
                for i in range(3):
                    await asyncio.sleep(0)
                    yield i

            assert [
                x async for x in b.call_stream(a.peer_id, "/test/sum/1.0.0", slowly(), int)
            ] == [0, 1, 3]
            got: list[int] = []
            with pytest.raises(RemoteError, match="three is not allowed"):
                async for x in b.call_stream(a.peer_id, "/test/failing/1.0.0", range(10), int):
                    got.append(x)
            assert got == [0, 1, 2]
            assert [x async for x in b.call_stream(a.peer_id, "/test/sum/1.0.0", [], int)] == []

    arun(main())


def test_many_concurrent_streams_share_one_connection(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as a, Peer() as b:
            install_echo(a)
            texts = [f"message {i}" * (i + 1) for i in range(100)]
            replies = await asyncio.gather(
                *(
                    b.call_unary(a.listen_addrs[0], ECHO_PROTOCOL_ID, t, str, timeout=10)
                    for t in texts
                )
            )
            assert replies == texts
            arrays = [np.random.default_rng(i).random(50_000).astype(np.float32) for i in range(8)]

            async def echo_arrays(i: int) -> bool:
                out = [
                    x
                    async for x in b.call_stream(
                        a.peer_id, ECHO_STREAM_PROTOCOL_ID, [arrays[i]] * 4, np.ndarray
                    )
                ]
                return len(out) == 4 and all(np.array_equal(x, arrays[i]) for x in out)

            assert all(await asyncio.gather(*(echo_arrays(i) for i in range(8))))
            assert b.statistics().num_connections == 1

    arun(main())


def test_torch_tensor_over_rpc(arun: Run) -> None:
    torch = pytest.importorskip("torch")

    async def double(request: Any, context: CallContext) -> Any:
        assert isinstance(request, torch.Tensor)
        return request * 2

    async def main() -> None:
        async with Peer() as a, Peer() as b:
            a.add_unary_handler("/test/double/1.0.0", double, Any)  # type: ignore[arg-type]
            tensor = torch.randn(64, 32).to(torch.bfloat16)
            out = await b.call_unary(a.listen_addrs[0], "/test/double/1.0.0", tensor, torch.Tensor)
            assert out.dtype == torch.bfloat16 and torch.equal(out, tensor * 2)

    arun(main())


def test_dial_failures_are_clear(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as a, Peer() as b:
            impostor = KeyPair.generate().peer_id
            wrong = with_peer_id(split_peer_id(a.listen_addrs[0])[0], impostor)
            with pytest.raises(PeerIDMismatch, match=str(impostor)):
                await b.connect(wrong)
            with pytest.raises(DialError, match="cannot connect"):
                await b.connect("/ip4/127.0.0.1/tcp/1")
            with pytest.raises(DialError, match="no known address"):
                await b.ping(KeyPair.generate().peer_id)
            # the honest address still works afterwards
            assert await b.connect(a.listen_addrs[0]) == a.peer_id

    arun(main())


def test_simultaneous_dials_make_one_connection(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as a, Peer() as b:
            results = await asyncio.gather(*(b.connect(a.listen_addrs[0]) for _ in range(10)))
            assert set(results) == {a.peer_id}
            assert b.statistics().num_connections == 1

    arun(main())


def test_ipv6_loopback(arun: Run) -> None:
    import socket

    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")

    async def main() -> None:
        from peers import PeerConfig

        try:
            server = Peer(PeerConfig(listen_addrs=("/ip6/::1/tcp/0",)))
            await server.__aenter__()
        except Exception as e:  # no ::1 configured in this sandbox
            pytest.skip(f"cannot listen on ::1: {e}")
        try:
            async with Peer() as client:
                assert str(server.listen_addrs[0]).startswith("/ip6/::1/tcp/")
                assert await client.connect(server.listen_addrs[0]) == server.peer_id
        finally:
            await server.__aexit__(None, None, None)

    arun(main())


def test_dns_address_and_standard_event_loop() -> None:
    # asyncio.run: the standard loop (the other tests use uvloop where installed).
    async def main() -> None:
        async with Peer() as a, Peer() as b:
            port = split_peer_id(a.listen_addrs[0])[0].value_for_protocol("tcp")
            remote = await b.connect(f"/dns/localhost/tcp/{port}/p2p/{a.peer_id}")
            assert remote == a.peer_id
            assert await b.ping(remote) > 0

    asyncio.run(main())


def test_listener_answers_a_dialer_that_waits_for_its_header(arun: Run) -> None:
    """Some dialers (py-libp2p) send only the multistream header and wait for ours
    before proposing; the header must come back even when it arrived with the SYN."""
    from peers.multistream import MULTISTREAM_PROTOCOL_ID, encode_message

    async def main() -> None:
        async with Peer() as server, Peer() as client:
            install_echo(server)
            remote = await client.connect(server.listen_addrs[0])
            connection = client.connection_to(remote)
            assert connection is not None
            stream = connection.open_stream_raw()
            await stream.write(encode_message(MULTISTREAM_PROTOCOL_ID))  # rides with the SYN
            async with asyncio.timeout(5):
                assert await stream.readexactly(20) == encode_message(MULTISTREAM_PROTOCOL_ID)
                await stream.write(encode_message(ECHO_PROTOCOL_ID))
                echoed = encode_message(ECHO_PROTOCOL_ID)
                assert await stream.readexactly(len(echoed)) == echoed

    arun(main())


SLOW_PROTOCOL = "/test/slow-answer/1.0.0"


def _reverse_after(num_bytes: int, go: asyncio.Event) -> Callable[[Any], Coroutine[Any, Any, None]]:
    """A stream handler: read ``num_bytes``, wait for ``go``, answer them reversed."""

    async def handler(stream: Any) -> None:
        request = await stream.readexactly(num_bytes)
        await go.wait()
        await stream.write(request[::-1])
        await stream.close()

    return handler


def _run_slow_call(
    arun: Run,
    num_bytes: int,
    go: asyncio.Event,
    dialer: Callable[[Any, Any], Coroutine[Any, Any, None]],
) -> None:
    """``dialer(connection, stream)`` against a server running ``_reverse_after``, on a
    lazily negotiated stream."""

    async def main() -> None:
        async with Peer() as server, Peer() as client:
            server.set_stream_handler(SLOW_PROTOCOL, _reverse_after(num_bytes, go))
            remote = await client.connect(server.listen_addrs[0])
            connection = client.connection_to(remote)
            assert connection is not None
            await dialer(connection, await client.new_stream(remote, SLOW_PROTOCOL))

    arun(main())


def test_a_lazy_request_gets_its_answer_ack_and_reply_in_one_go(arun: Run) -> None:
    """A dialer that sent its request with the proposal hears nothing (no protocol
    answer, no yamux ACK) until the handler writes: all of it then arrives together."""
    go = asyncio.Event()

    async def dialer(connection: Any, stream: Any) -> None:
        await stream.write(b"ping")
        before = connection.session_statistics().num_wire_bytes_received
        await asyncio.sleep(0.2)  # were anything sent early, loopback delivers it by now
        assert connection.session_statistics().num_wire_bytes_received == before
        go.set()
        async with asyncio.timeout(5):
            assert await stream.read() == b"gnip"

    _run_slow_call(arun, 4, go, dialer)


def test_a_handler_waiting_for_more_sends_its_deferred_answer_first(arun: Run) -> None:
    """A dialer may send part of its request lazily, then wait for the protocol answer
    before sending the rest; the handler's read that has to wait sends the answer."""
    go = asyncio.Event()
    go.set()

    async def dialer(connection: Any, stream: Any) -> None:
        before = connection.session_statistics().num_wire_bytes_received
        await stream.write(b"half")  # the handler wants 8 bytes
        for _ in range(500):  # up to 5 s: without the answer, the wait never ends
            if connection.session_statistics().num_wire_bytes_received != before:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the handler never sent its protocol answer")
        async with asyncio.timeout(5):
            await stream.write(b"more")
            assert await stream.read() == b"eromflah"

    _run_slow_call(arun, 8, go, dialer)


def test_callers_sharing_a_failed_dial_get_their_own_error_and_no_cycles(arun: Run) -> None:
    """Concurrent callers share one dial; when it fails each raises its own copy of the
    error. Raising the one kept by the shared future tied every caller's frames (and
    what they held: an all-reduce round's tensors) into a cycle until a gc run."""

    class Held:
        pass

    async def main() -> None:
        async with Peer() as b:
            unknown = KeyPair.generate().peer_id
            b.add_addresses(unknown, ["/ip4/127.0.0.1/tcp/1"])  # refused, after an await
            refs: list[weakref.ref[Held]] = []
            errors: list[DialError] = []

            async def caller() -> None:
                held = Held()
                refs.append(weakref.ref(held))
                try:  # not pytest.raises: its ExceptionInfo would itself make a cycle
                    await b.ping(unknown)
                except DialError as e:
                    errors.append(e)

            gc.collect()
            gc.disable()
            try:
                await asyncio.gather(*(caller() for _ in range(3)))
                assert len({id(e) for e in errors}) == 3
                assert all("cannot connect" in str(e) for e in errors)
                errors.clear()
                assert [r() for r in refs] == [None, None, None]
            finally:
                gc.enable()

    arun(main())


def test_read_chunks_returns_the_pieces_as_they_arrived_within_the_bound(arun: Run) -> None:
    """Bytes written in many pieces come back in order, in batches of whole received
    pieces (never sliced: the piece that reaches ``max_bytes`` ends the batch), then
    ``[]`` at the end; a reset is raised once what arrived before it was read."""
    payload = bytes(range(256)) * 4096  # 1 MiB
    received: asyncio.Queue[list[bytes]] = asyncio.Queue()

    async def sink(stream: Any) -> None:
        batches = []
        while batch := await stream.read_chunks(100_000):
            assert batch and sum(len(piece) for piece in batch[:-1]) < 100_000
            assert all(len(piece) <= 70_000 for piece in batch)  # as written, or less
            batches.append(batch)
        await received.put([piece for batch in batches for piece in batch])

    async def main() -> None:
        async with Peer() as a, Peer() as b:
            a.set_stream_handler("/test/sink/1", sink)
            await b.connect(a.listen_addrs[0])
            stream = await b.new_stream(a.peer_id, "/test/sink/1")
            for start in range(0, len(payload), 70_000):
                await stream.write(payload[start : start + 70_000])
            await stream.close()
            pieces = await asyncio.wait_for(received.get(), 10)
            assert b"".join(pieces) == payload
            assert len(pieces) > len(payload) // 100_000  # batches, not one joined blob

            async def reset_after_data(stream: Any) -> None:
                await stream.write(b"last words")
                await asyncio.sleep(0.1)
                stream.reset()

            a.set_stream_handler("/test/reset/1", reset_after_data)
            stream = await b.new_stream(a.peer_id, "/test/reset/1")
            await stream.write(b"hello")
            assert b"".join(await stream.read_chunks(1 << 20)) == b"last words"
            with pytest.raises(PeersError):
                await stream.read_chunks(1 << 20)
            with pytest.raises(ValueError):
                await stream.read_chunks(0)

    arun(main())
