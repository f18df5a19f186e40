"""RPC over streams: unary and bidirectional-streaming calls with typed messages.

One call is one stream, negotiated with multistream-select under the service's
protocol id (e.g. ``/swarmtrain/dht/1.0.0``). Every frame is an unsigned-varint length
and a msgpack array ``[kind, body, ...]``:

- ``[0, message]`` a request or response message (``[0, message, timeout]`` for a
  call's first request: the seconds the caller will wait, so the handler gets the
  same deadline);
- ``[1, type_name, text]`` the handler raised; the call fails with
  :class:`peers.errors.RemoteError`.

The caller half-closes after its last request; the handler's side half-closes after
its last response. Cancelling a call (or its deadline expiring) resets the stream, and
the remote handler's task is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from multiaddr import Multiaddr

from peers.connection import Stream
from peers.errors import (
    ConnectionClosed,
    RemoteError,
    RemoteProtocolError,
    StreamReset,
    raisable_copy,
)
from peers.identity import PeerID
from peers.serialization import (
    MAX_FRAME_BYTES,
    MAX_VALUE_ITEMS,
    FrameDecoder,
    frame_buffers,
    unpack,
)
from peers.stream_api import RpcHost, StreamLike
from peers.wire import from_wire, to_wire

if TYPE_CHECKING:
    # PEP 696 defaults: a bare ``FramedStream`` annotation still means one over a real
    # Stream. Python 3.11's TypeVar takes no default, and typing_extensions is not a
    # dependency of ours, so only the type checker sees it.
    from typing_extensions import TypeVar as DefaultTypeVar

    S = DefaultTypeVar("S", bound=StreamLike, default=Stream)
else:
    S = TypeVar("S", bound=StreamLike)

logger = logging.getLogger(__name__)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_KIND_MESSAGE = 0
_KIND_ERROR = 1
#: Longest remote error text we keep: enough for a traceback's last line, not a flood.
MAX_ERROR_MESSAGE_CHARS = 4096
#: Seconds a handler waits for a call's first frame: a caller that opens a stream and
#: sends nothing would otherwise hold it, and a task, for as long as the connection lives.
FIRST_FRAME_SECONDS = 10.0
#: The same for a streaming call, longer: a caller may open its stream to a spare donor
#: before it has a request for it (state sync does, for a fallback).
STREAM_FIRST_FRAME_SECONDS = 120.0
#: Longest a unary handler runs, whatever deadline the caller sent (or none): the caller
#: chooses how long it waits, not how long we work for it.
MAX_HANDLER_SECONDS = 600.0
#: Most bytes a framed stream takes from its stream at once.
_READ_BYTES = 1 << 20
#: Handlers one remote peer may have running here at once, every protocol and every
#: connection together. A peer's own work needs a few dozen (a DHT writer's 16 stores, a
#: mixture of experts' calls to one server); without this bound, 4 connections of 256
#: streams each let one peer hold a thousand handlers and what they reply, unread.
MAX_CALLS_IN_FLIGHT_PER_PEER = 128


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call it serves."""

    remote_peer_id: PeerID
    protocol: str
    timeout: float | None


class FramedStream(Generic[S]):
    """Reads and writes length-prefixed msgpack frames on a stream, within a frame bound.

    Any :class:`peers.stream_api.StreamLike` will do (a real Stream, or an in-memory one
    of :mod:`peers.memory_network`); ``stream`` keeps the type it was given.
    """

    def __init__(
        self,
        stream: S,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_value_items: int = MAX_VALUE_ITEMS,
    ) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(max_frame_bytes)
        self._max_items = max_value_items
        self._frames: list[bytearray | memoryview] = []
        self._eof = False
        self.bytes_read = 0
        """Bytes read from the stream so far (frames and their length prefixes)."""

    async def read_frame(self) -> list[Any] | None:
        """The next decoded frame, or ``None`` at a clean end of stream.

        Raises :class:`RemoteProtocolError` for a malformed frame, an oversized one, or
        a stream that ends in the middle of a frame.
        """
        while not self._frames:
            if self._eof:
                if not self._decoder.at_frame_boundary():
                    raise RemoteProtocolError("stream ended in the middle of a frame")
                return None
            pieces = await self.stream.read_chunks(_READ_BYTES)
            if not pieces:
                self._eof = True
                continue
            for data in pieces:
                self.bytes_read += len(data)
                self._frames.extend(self._decoder.feed(data))
        frame = unpack(self._frames.pop(0), max_items=self._max_items)
        if not isinstance(frame, list) or not frame or not isinstance(frame[0], int):
            raise RemoteProtocolError("an RPC frame must be an array starting with its kind")
        return frame

    async def write_frame(self, frame: list[Any]) -> None:
        await self.stream.write_many(frame_buffers(frame))


async def _refuse(framed: FramedStream[S], error: RemoteProtocolError) -> None:
    """Answer a malformed call with an error frame, then reset the stream: the caller
    may still be sending (an oversized frame, say) and must not wait on a window we
    will never open again. The error frame arrives before the reset."""
    await framed.write_frame(_error_frame(error))
    framed.stream.reset()


def _error_frame(error: BaseException) -> list[Any]:
    return [_KIND_ERROR, type(error).__name__, str(error)[:MAX_ERROR_MESSAGE_CHARS]]


def _raise_remote(frame: list[Any]) -> None:
    if len(frame) >= 3 and isinstance(frame[1], str) and isinstance(frame[2], str):
        raise RemoteError(frame[1], frame[2][:MAX_ERROR_MESSAGE_CHARS])
    raise RemoteProtocolError("malformed error frame")


def _message_body(frame: list[Any]) -> Any:
    if frame[0] == _KIND_ERROR:
        _raise_remote(frame)
    if frame[0] != _KIND_MESSAGE or len(frame) < 2:
        raise RemoteProtocolError(f"unexpected RPC frame kind {frame[0]}")
    return frame[1]


async def _serve_guarded(stream: StreamLike, work: Awaitable[None]) -> None:
    """Run ``work`` in this task, cancelling it as soon as the remote resets the stream."""
    task = asyncio.current_task()
    assert task is not None
    reset = False

    def cancel_work() -> None:
        nonlocal reset
        reset = True
        task.cancel()

    stream.on_failure(cancel_work)
    try:
        await work
    except asyncio.CancelledError:
        # Our own cancellation of a reset call ends quietly; any other propagates.
        if not (reset and task.uncancel() == 0):
            raise
    finally:
        stream.remove_on_failure(cancel_work)


async def _first_frame(framed: FramedStream[StreamLike], timeout: float) -> list[Any] | None:
    """The call's first frame, or :class:`RemoteProtocolError` after ``timeout`` s."""
    try:
        async with asyncio.timeout(timeout):
            return await framed.read_frame()
    except TimeoutError:
        raise RemoteProtocolError(f"no request within {timeout:g} s") from None


def _timeout_of(frame: list[Any]) -> float | None:
    if len(frame) >= 3 and isinstance(frame[2], int | float) and frame[2] > 0:
        return float(frame[2])
    return None


# --- serving ----------------------------------------------------------------------


class _CallsInFlight:
    """Handlers running for each remote peer, on one of our peers."""

    def __init__(self) -> None:
        self.counts: dict[PeerID, int] = {}

    @contextlib.contextmanager
    def admit(self, remote: PeerID) -> Iterator[bool]:
        """Yields False (and counts nothing) if ``remote`` is at its bound."""
        held = self.counts.get(remote, 0)
        if held >= MAX_CALLS_IN_FLIGHT_PER_PEER:
            yield False
            return
        self.counts[remote] = held + 1
        try:
            yield True
        finally:
            left = self.counts[remote] - 1
            if left:
                self.counts[remote] = left
            else:
                del self.counts[remote]


_CALLS: weakref.WeakKeyDictionary[RpcHost, _CallsInFlight] = weakref.WeakKeyDictionary()


def calls_in_flight(peer: RpcHost) -> dict[PeerID, int]:
    """Handlers running on ``peer`` now, by the remote peer they serve."""
    tracker = _CALLS.get(peer)
    return dict(tracker.counts) if tracker is not None else {}


def _calls_of(peer: RpcHost) -> _CallsInFlight:
    tracker = _CALLS.get(peer)
    if tracker is None:
        tracker = _CALLS[peer] = _CallsInFlight()
    return tracker


async def _serve_admitted(
    peer: RpcHost, stream: StreamLike, framed: FramedStream[StreamLike], work: Awaitable[None]
) -> None:
    """Run ``work`` for ``stream``'s remote if it is under its bound of calls in flight;
    else refuse the call with an error frame (the remote's, and only its, to retry)."""
    with _calls_of(peer).admit(stream.remote_peer_id) as admitted:
        if admitted:
            await _serve_guarded(stream, work)
            return
        if asyncio.iscoroutine(work):
            work.close()  # never started
        error = RemoteProtocolError(
            f"{MAX_CALLS_IN_FLIGHT_PER_PEER} calls of yours are in flight here already"
        )
        with contextlib.suppress(ConnectionClosed):
            await _refuse(framed, error)


def add_unary_handler(
    peer: RpcHost,
    protocol: str,
    handler: Callable[[Req, CallContext], Awaitable[Resp]],
    request_type: type[Req],
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    max_value_items: int = MAX_VALUE_ITEMS,
    first_frame_timeout: float = FIRST_FRAME_SECONDS,
    max_handler_seconds: float = MAX_HANDLER_SECONDS,
) -> None:
    """Serve a unary RPC: one ``request_type`` in, one response out.

    The handler runs with the caller's deadline, at most ``max_handler_seconds``; if it
    raises, the caller gets a RemoteError with the exception's type and message; if the
    caller cancels, the handler is cancelled. A request that has not arrived within
    ``first_frame_timeout`` seconds is refused with an error frame.
    """

    async def serve(stream: StreamLike) -> None:
        framed = FramedStream(stream, max_frame_bytes, max_value_items)

        async def work() -> None:
            try:
                frame = await _first_frame(framed, first_frame_timeout)
                if frame is None:
                    raise RemoteProtocolError("call ended without a request")
                request = from_wire(request_type, _message_body(frame))
                context = CallContext(stream.remote_peer_id, protocol, _timeout_of(frame))
            except RemoteProtocolError as e:
                await _refuse(framed, e)
                return
            try:
                async with asyncio.timeout(min(context.timeout or math.inf, max_handler_seconds)):
                    response = await handler(request, context)
                reply = [_KIND_MESSAGE, to_wire(response)]
            except Exception as e:
                reply = _error_frame(e)
            await framed.write_frame(reply)
            await stream.close()

        await _serve_admitted(peer, stream, framed, work())

    peer.set_stream_handler(protocol, serve)


def add_stream_handler(
    peer: RpcHost,
    protocol: str,
    handler: Callable[[AsyncIterator[Req], CallContext], AsyncIterator[Resp]],
    request_type: type[Req],
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    first_frame_timeout: float = STREAM_FIRST_FRAME_SECONDS,
) -> None:
    """Serve a bidirectional-streaming RPC.

    ``handler(requests, context)`` is an async generator: it reads ``requests`` (an async
    iterator of decoded ``request_type``) as it likes and yields responses, each sent as
    soon as it is yielded (waiting for the remote's flow-control window). A first frame
    that has not arrived within ``first_frame_timeout`` seconds is refused.
    """

    async def serve(stream: StreamLike) -> None:
        framed = FramedStream(stream, max_frame_bytes)

        async def work() -> None:
            try:
                first = await _first_frame(framed, first_frame_timeout)
            except RemoteProtocolError as e:  # a bad first frame: refuse it like any other
                await _refuse(framed, e)
                return
            context = CallContext(
                stream.remote_peer_id, protocol, _timeout_of(first) if first else None
            )

            async def requests() -> AsyncIterator[Req]:
                frame = first
                while frame is not None:
                    yield from_wire(request_type, _message_body(frame))
                    frame = await framed.read_frame()

            responses = handler(requests(), context)
            try:
                async with asyncio.timeout(context.timeout):
                    async for response in responses:
                        await framed.write_frame([_KIND_MESSAGE, to_wire(response)])
            except ConnectionClosed:
                raise
            except Exception as e:
                await framed.write_frame(_error_frame(e))
            finally:
                # Run the handler's own cleanup now (its ``finally`` blocks, freeing what
                # it holds), not whenever the abandoned generator is collected.
                aclose = getattr(responses, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            await stream.close()

        await _serve_admitted(peer, stream, framed, work())

    peer.set_stream_handler(protocol, serve)


# --- calling ----------------------------------------------------------------------


async def call_unary(
    peer: RpcHost,
    remote: PeerID | Multiaddr | str,
    protocol: str,
    request: object,
    response_type: type[Resp],
    *,
    timeout: float | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    max_value_items: int = MAX_VALUE_ITEMS,
) -> Resp:
    """Call a unary RPC and return the decoded response (a frame of at most
    ``max_frame_bytes`` holding at most ``max_value_items`` msgpack items).

    Raises :class:`RemoteError` if the handler raised, :class:`TimeoutError` when
    ``timeout`` seconds pass (the remote handler is then cancelled), and the dial and
    protocol errors of :meth:`Peer.new_stream`. Cancelling the call resets the stream.
    Its duration, and whether it failed, go into ``peer.traffic`` (a cancelled call is
    not counted).
    """
    started = time.monotonic()
    try:
        response = await _call_unary(
            peer,
            remote,
            protocol,
            request,
            response_type,
            timeout,
            max_frame_bytes,
            max_value_items,
        )
    except Exception:
        peer.traffic.call_ended(protocol, time.monotonic() - started, failed=True)
        raise
    peer.traffic.call_ended(protocol, time.monotonic() - started, failed=False)
    return response


async def _call_unary(
    peer: RpcHost,
    remote: PeerID | Multiaddr | str,
    protocol: str,
    request: object,
    response_type: type[Resp],
    timeout: float | None,
    max_frame_bytes: int,
    max_value_items: int,
) -> Resp:
    async with asyncio.timeout(timeout):
        stream = await peer.new_stream(remote, protocol)
        answered = False
        try:
            framed = FramedStream(stream, max_frame_bytes, max_value_items)
            try:
                await framed.write_frame([_KIND_MESSAGE, to_wire(request), timeout])
                await stream.close()
            except StreamReset:
                pass  # the remote refused mid-request: its error frame, if any, is next
            frame = await framed.read_frame()
            answered = True
            if frame is None:
                raise RemoteProtocolError("remote closed the call without a response")
            return from_wire(response_type, _message_body(frame))
        finally:
            if not answered:  # timeout, cancellation or a broken stream: stop the handler
                stream.reset()


async def call_stream(
    peer: RpcHost,
    remote: PeerID | Multiaddr | str,
    protocol: str,
    requests: AsyncIterable[Any] | Iterable[Any],
    response_type: type[Resp],
    *,
    timeout: float | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> AsyncIterator[Resp]:
    """Call a streaming RPC: send ``requests`` while yielding decoded responses.

    Requests are sent by a task owned by this generator; closing the generator early,
    an error, or ``timeout`` resets the stream and so cancels the remote handler.
    Raises :class:`RemoteError` if the handler raised. The call's duration (to the end
    of the response stream), and whether it failed, go into ``peer.traffic`` (a call
    closed early or cancelled is not counted).
    """
    started = time.monotonic()
    responses = _call_stream(
        peer, remote, protocol, requests, response_type, timeout, max_frame_bytes
    )
    async with contextlib.aclosing(responses):  # closed early: its stream resets now
        try:
            async for response in responses:
                yield response
        except Exception:
            peer.traffic.stream_call_ended(protocol, time.monotonic() - started, failed=True)
            raise
    peer.traffic.stream_call_ended(protocol, time.monotonic() - started, failed=False)


async def _call_stream(
    peer: RpcHost,
    remote: PeerID | Multiaddr | str,
    protocol: str,
    requests: AsyncIterable[Any] | Iterable[Any],
    response_type: type[Resp],
    timeout: float | None,
    max_frame_bytes: int,
) -> AsyncGenerator[Resp, None]:
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    async with asyncio.timeout_at(deadline):
        stream = await peer.new_stream(remote, protocol)
    framed = FramedStream(stream, max_frame_bytes)
    sender = asyncio.ensure_future(_send_requests(framed, requests, timeout))
    finished = False
    try:
        while True:
            async with asyncio.timeout_at(deadline):
                frame = await framed.read_frame()
            if frame is None:
                finished = True
                break
            yield from_wire(response_type, _message_body(frame))
        if sender.done() and not sender.cancelled():
            error = sender.exception()
            if error is not None:
                raise raisable_copy(error) from None  # the task keeps the original
    finally:
        if not finished:
            stream.reset()
        if not sender.done():
            sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
            await sender


async def _send_requests(
    framed: FramedStream[StreamLike],
    requests: AsyncIterable[Any] | Iterable[Any],
    timeout: float | None,
) -> None:
    first = True

    async def send(request: object) -> None:
        nonlocal first
        frame = [_KIND_MESSAGE, to_wire(request)]
        if first:
            frame.append(timeout)
            first = False
        await framed.write_frame(frame)

    if isinstance(requests, AsyncIterable):
        async for request in requests:
            await send(request)
    else:
        for request in requests:
            await send(request)
    await framed.stream.close()
