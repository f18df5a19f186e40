"""An in-memory network of peers, with latency, bandwidth and injected faults.

Protocol code written against :class:`peers.stream_api.StreamHost` and
:class:`peers.stream_api.StreamLike` runs here on many in-process peers, without
sockets, Noise or yamux. On the virtual clock of :func:`peers.virtual_clock.run_virtual`
a run is fast and, given the seed and the order of calls, the same every time, so a
checker can try thousands of fault schedules (docs/design/memory-network.md).

Each directed pair of peers is a FIFO link. Whatever a stream sends (its opening, data,
end of stream, reset, flow-control credit) queues on the link from its peer to the
remote, and is delivered at ``max(transmitted + latency, previous delivery + epsilon)``:
strictly later than the one before it on that link, so order holds. A cut link, or one
whose end is paused, holds what it carries and delivers it in order once healed (TCP
keeps retransmitting into a black hole; it does not lose data and go on).

Streams are flow-controlled as yamux streams are, with a fixed window (no auto-tuning):
a writer waits once the remote has ``window_bytes`` unread, so writing into a cut link
blocks as it does over TCP.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from peers.addresses import parse_multiaddr, split_peer_id, tcp_multiaddr, with_peer_id
from peers.errors import (
    ConnectionClosed,
    DialError,
    PeerIDMismatch,
    ProtocolNotSupported,
    StreamReset,
)
from peers.identity import KeyPair, PeerID
from peers.stream_api import ReachableHost, RpcHost, StreamHost, StreamLike
from peers.traffic import TrafficBook
from peers.virtual_clock import run_virtual
from peers.yamux import INITIAL_WINDOW_BYTES

if TYPE_CHECKING:
    from multiaddr import Multiaddr

    from peers.connection import Stream
    from peers.host import Peer

__all__ = [
    "Delivery",
    "MemoryConnection",
    "MemoryNat",
    "MemoryNetwork",
    "MemoryPeer",
    "MemoryStream",
    "run_virtual",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Where the network numbers its peers: the i-th peer added listens at the i-th address
#: after this one (198.18.0.0/15 is set aside for benchmarking networks, RFC 2544), on
#: :data:`LISTEN_PORT`, so addresses look like the lab's and never like a real host's.
FIRST_ADDRESS = ipaddress.IPv4Address("198.18.0.0")
LISTEN_PORT = 4001
#: One-way latency of a link unless set: a LAN's, small against any protocol timeout.
DEFAULT_LATENCY_SECONDS = 0.001
#: Least gap between two deliveries on one link: asyncio's timer heap is not stable for
#: equal times, so equal delivery times could swap two frames of one direction.
ORDER_EPSILON_SECONDS = 1e-9

#: ``on_frame(src, dst, protocol, num_bytes)``, called as a stream writes a frame.
FrameCallback = Callable[[PeerID, PeerID, str, int], None]
MemoryStreamHandler = Callable[["MemoryStream"], Awaitable[None]]

#: A peer, or its id: what the fault and link methods take.
PeerRef: TypeAlias = "MemoryPeer | PeerID"

_OPEN, _DATA, _EOF, _RESET, _WINDOW, _REFUSE = "open", "data", "eof", "reset", "window", "refuse"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One thing a link delivered: what a determinism check or a trace compares."""

    time: float
    """When it was delivered (later than ``due`` if the link held it)."""
    due: float
    """When latency and bandwidth had it arrive: strictly increasing on each link."""
    src: PeerID
    dst: PeerID
    kind: str
    """``open``, ``data``, ``eof``, ``reset``, ``window`` (flow-control credit) or
    ``refuse`` (the remote serves no such protocol)."""
    protocol: str
    num_bytes: int


@dataclass(slots=True)
class _Item:
    due: float
    kind: str
    target: MemoryStream  # the endpoint it is delivered to
    data: bytes = b""
    credit: int = 0
    connection_broke: bool = False


class _Link:
    """One direction between two peers: a FIFO of items and its delivery timer."""

    def __init__(self, src: PeerID, dst: PeerID, latency: float) -> None:
        self.src = src
        self.dst = dst
        self.latency_seconds = latency
        self.bytes_per_second: float | None = None
        self.cut = False
        self.busy_until = -math.inf  # when the last byte handed to it is transmitted
        self.last_due = -math.inf
        self.num_frames_sent = 0
        self.queue: deque[_Item] = deque()
        self.timer: asyncio.TimerHandle | None = None
        self.pumping = False


class MemoryNetwork:
    """A registry of :class:`MemoryPeer` s and the links between them.

    ``seed`` fixes the peers' identities (the ``i``-th peer added always has the same
    PeerID) and the latency jitter. Fault methods may be called at any time from code
    on the loop; each takes effect at once and its consequences arrive over the links.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        latency_seconds: float = DEFAULT_LATENCY_SECONDS,
        jitter_seconds: float = 0.0,
        window_bytes: int = INITIAL_WINDOW_BYTES,
    ) -> None:
        if latency_seconds < 0 or jitter_seconds < 0:
            raise ValueError("latency and jitter must not be negative")
        if window_bytes < 1:
            raise ValueError("window_bytes must be positive")
        self.latency_seconds = latency_seconds
        self.jitter_seconds = jitter_seconds
        self.window_bytes = window_bytes
        self._key_rng = random.Random(f"{seed}/keys")
        self._jitter_rng = random.Random(f"{seed}/jitter")
        self._peers: dict[PeerID, MemoryPeer] = {}
        self._by_address: dict[str, PeerID] = {}
        self._links: dict[tuple[PeerID, PeerID], _Link] = {}
        self._paused_until: dict[PeerID, float] = {}
        self.on_frame: FrameCallback | None = None
        """Called synchronously as a stream writes a frame (before it is queued: a
        fault fired from here already applies to that frame)."""
        self.on_deliver: Callable[[Delivery], None] | None = None
        """Called synchronously for everything a link delivers to a live endpoint."""

    # --- peers ---------------------------------------------------------------------

    def add_peer(self) -> MemoryPeer:
        """A new peer, with the next identity and the next address (198.18.0.1, ...)."""
        ip = FIRST_ADDRESS + len(self._peers) + 1
        address = tcp_multiaddr(str(ip), LISTEN_PORT)
        peer = MemoryPeer(self, KeyPair.from_seed(self._key_rng.randbytes(32)), address)
        self._peers[peer.peer_id] = peer
        self._by_address[str(address)] = peer.peer_id
        return peer

    @property
    def peers(self) -> list[MemoryPeer]:
        return list(self._peers.values())

    def peer(self, peer_id: PeerID) -> MemoryPeer:
        return self._peers[peer_id]

    async def aclose(self) -> None:
        """Close every peer and wait for the tasks they own to end."""
        tasks: list[asyncio.Task[Any]] = []
        for peer in self._peers.values():
            tasks.extend(peer._tasks)
            peer.close()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> MemoryNetwork:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- link properties -----------------------------------------------------------

    def set_latency(self, a: PeerRef, b: PeerRef, seconds: float, *, one_way: bool = False) -> None:
        """One-way latency from ``a`` to ``b`` (and back unless ``one_way``), for what is
        sent from now on."""
        if seconds < 0:
            raise ValueError("latency must not be negative")
        for link in self._directions(a, b, one_way):
            link.latency_seconds = seconds

    def set_bandwidth(
        self,
        a: PeerRef,
        b: PeerRef,
        bytes_per_second: float | None,
        *,
        one_way: bool = False,
    ) -> None:
        """Bytes per second from ``a`` to ``b`` (and back unless ``one_way``); ``None``
        for no limit. Frames are transmitted one after another at this rate."""
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise ValueError("bandwidth must be positive (or None for no limit)")
        for link in self._directions(a, b, one_way):
            link.bytes_per_second = bytes_per_second

    def num_frames_sent(self, src: PeerRef, dst: PeerRef) -> int:
        """Frames (non-empty writes) streams of ``src`` wrote towards ``dst`` so far."""
        return self._link(_id(src), _id(dst)).num_frames_sent

    # --- faults --------------------------------------------------------------------

    def cut(self, a: PeerRef, b: PeerRef, *, one_way: bool = False) -> None:
        """Hold everything from ``a`` to ``b`` (and back unless ``one_way``) until healed."""
        for link in self._directions(a, b, one_way):
            link.cut = True

    def heal(self, a: PeerRef, b: PeerRef, *, one_way: bool = False) -> None:
        """Undo :meth:`cut`: what the link held is delivered, in order, at once."""
        for link in self._directions(a, b, one_way):
            link.cut = False
            self._schedule(link)

    def kill(self, peer: PeerRef) -> None:
        """The peer dies: its handlers and the tasks it owns are cancelled, its streams
        fail locally, each remote end is reset after what was already in flight, and
        new streams to it fail with :class:`DialError`."""
        self._peers[_id(peer)]._shut_down("peer was killed", by_us=False)

    def reset_link(self, a: PeerRef, b: PeerRef) -> None:
        """The connection between ``a`` and ``b`` breaks: every stream between them is
        reset at both ends, each end after what is already in flight towards it; the
        handlers serving them are cancelled. New streams may be opened afterwards."""
        for near, far in ((_id(a), _id(b)), (_id(b), _id(a))):
            for stream in list(self._peers[near]._streams):
                if stream.remote_peer_id == far:
                    self._send(far, stream, _RESET, connection_broke=True)

    def pause(self, peer: PeerRef, seconds: float) -> None:
        """Hold every delivery to and from ``peer`` for ``seconds`` (a stop-the-world
        pause, as the network sees it: the peer's own timers still run)."""
        if seconds < 0:
            raise ValueError("seconds must not be negative")
        peer_id = _id(peer)
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        if until > self._paused_until.get(peer_id, -math.inf):
            self._paused_until[peer_id] = until
            loop.call_at(until, self._unpause, peer_id, until)

    def _unpause(self, peer_id: PeerID, until: float) -> None:
        # Compared with the time this timer was set for, not with loop.time(): a timer
        # may fire up to the clock's resolution early.
        if self._paused_until.get(peer_id) != until:
            return  # a longer pause since
        del self._paused_until[peer_id]
        for link in list(self._links.values()):
            if peer_id in (link.src, link.dst):
                self._schedule(link)

    # --- delivery ------------------------------------------------------------------

    def _link(self, src: PeerID, dst: PeerID) -> _Link:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[(src, dst)] = _Link(src, dst, self.latency_seconds)
        return link

    def _directions(self, a: PeerRef, b: PeerRef, one_way: bool) -> list[_Link]:
        links = [self._link(_id(a), _id(b))]
        if not one_way:
            links.append(self._link(_id(b), _id(a)))
        return links

    def _frame_written(self, stream: MemoryStream, num_bytes: int) -> None:
        link = self._link(stream._peer.peer_id, stream.remote_peer_id)
        link.num_frames_sent += 1
        if self.on_frame is not None:
            self.on_frame(link.src, link.dst, stream.protocol or "", num_bytes)

    def _send(
        self,
        src: PeerID,
        target: MemoryStream,
        kind: str,
        *,
        data: bytes = b"",
        credit: int = 0,
        connection_broke: bool = False,
    ) -> None:
        """Queue ``kind`` from ``src`` to the endpoint ``target``."""
        link = self._link(src, target._peer.peer_id)
        now = asyncio.get_running_loop().time()
        transmitted = max(now, link.busy_until)
        if link.bytes_per_second is not None:
            transmitted += len(data) / link.bytes_per_second
        link.busy_until = transmitted
        delay = link.latency_seconds
        if self.jitter_seconds:
            delay += self._jitter_rng.uniform(0.0, self.jitter_seconds)
        due = max(
            transmitted + delay,
            link.last_due + ORDER_EPSILON_SECONDS,
            math.nextafter(link.last_due, math.inf),  # epsilon vanishes past ~1e7 s
        )
        link.last_due = due
        link.queue.append(_Item(due, kind, target, data, credit, connection_broke))
        self._schedule(link)

    def _blocked(self, link: _Link) -> bool:
        return link.cut or link.src in self._paused_until or link.dst in self._paused_until

    def _schedule(self, link: _Link) -> None:
        """Make sure a timer will deliver the link's head, unless the link is held."""
        if link.pumping or link.timer is not None or not link.queue or self._blocked(link):
            return
        link.timer = asyncio.get_running_loop().call_at(link.queue[0].due, self._pump, link)

    def _pump(self, link: _Link) -> None:
        link.timer = None
        now = asyncio.get_running_loop().time()
        link.pumping = True
        try:
            # A timer fires up to the clock's resolution early: the head is due then too.
            while link.queue and not self._blocked(link) and link.queue[0].due <= now + 1e-9:
                self._deliver(link, link.queue.popleft())
        finally:
            link.pumping = False
        self._schedule(link)

    def _deliver(self, link: _Link, item: _Item) -> None:
        target = item.target
        peer = target._peer
        if not peer._alive or target._error is not None:
            return  # a dead peer, or an endpoint reset already: nothing is listening
        if self.on_deliver is not None:
            self.on_deliver(
                Delivery(
                    asyncio.get_running_loop().time(),
                    item.due,
                    link.src,
                    link.dst,
                    item.kind,
                    target.protocol or "",
                    len(item.data),
                )
            )
        if item.kind == _DATA:
            target._feed(item.data)
        elif item.kind == _WINDOW:
            target._grant(item.credit)
        elif item.kind == _EOF:
            target._feed_eof()
        elif item.kind == _RESET:
            message = "connection broke" if item.connection_broke else "reset by the remote"
            target._fail(StreamReset(f"stream was {message}"))
            if item.connection_broke and target._handler_task is not None:
                target._handler_task.cancel()  # as a real connection's shutdown does
        elif item.kind == _REFUSE:
            target._refused = True
            target._fail(StreamReset(f"the remote does not serve {target.protocol}"))
        elif item.kind == _OPEN:
            peer._accept(target)


def _id(peer: PeerRef) -> PeerID:
    return peer if isinstance(peer, PeerID) else peer.peer_id


@dataclass(frozen=True, slots=True)
class MemoryConnection:
    """What :meth:`MemoryPeer.connection_to` says of a remote: where it reaches us from."""

    remote_address: Multiaddr


@dataclass(frozen=True, slots=True)
class MemoryNat:
    """A memory peer's NAT status: it is behind none, so hole punching never applies
    (``punchable`` is False, as for a public :class:`peers.Peer`)."""

    punchable: bool = False


class MemoryPeer:
    """A peer of a :class:`MemoryNetwork`, with the :class:`StreamHost` and
    :class:`ReachableHost` surfaces.

    Each peer has one address (``address``; :attr:`listen_addrs` adds ``/p2p/ID``) and
    is connected to every live peer: the network routes by PeerID, so an address is how
    code that starts from one (a DHT's initial peers) learns whom it names, and
    :meth:`add_addresses` only keeps a book (:attr:`address_book`) for tests to read.
    """

    def __init__(self, network: MemoryNetwork, identity: KeyPair, address: Multiaddr) -> None:
        self.network = network
        self.identity = identity
        self.peer_id = identity.peer_id
        self.address = address
        #: Addresses other peers told us of (:meth:`add_addresses`), the latest per peer.
        self.address_book: dict[PeerID, list[Multiaddr]] = {}
        self.nat = MemoryNat()
        #: Its unary calls' latencies, as a real peer's (``peers.rpc.call_unary``).
        self.traffic = TrafficBook()
        self._handlers: dict[str, MemoryStreamHandler] = {}
        # Dicts, not sets: iteration in insertion order keeps a run deterministic.
        self._streams: dict[MemoryStream, None] = {}
        self._tasks: dict[asyncio.Task[Any], None] = {}
        self._alive = True

    def __repr__(self) -> str:
        return f"MemoryPeer({self.peer_id})"

    @property
    def is_alive(self) -> bool:
        return self._alive

    def set_stream_handler(self, protocol: str, handler: MemoryStreamHandler) -> None:
        """Serve ``protocol``; ``ValueError`` if a handler for it is already set. The
        handler's stream is reset if it raises; its task is cancelled if the connection
        breaks (:meth:`MemoryNetwork.reset_link`, a killed remote) or this peer dies."""
        if protocol in self._handlers:
            raise ValueError(f"a handler for {protocol} is already registered")
        self._handlers[protocol] = handler

    def remove_stream_handler(self, protocol: str) -> None:
        self._handlers.pop(protocol, None)

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        return [with_peer_id(self.address, self.peer_id)]

    @property
    def advertised_addrs(self) -> list[Multiaddr]:
        """Every address we are reached at: :attr:`listen_addrs` (no relays here)."""
        return self.listen_addrs

    async def connect(self, addr: Multiaddr | str) -> PeerID:
        """Who is at ``addr``: :class:`DialError` if nobody (or a dead peer, or us),
        :class:`PeerIDMismatch` if ``addr`` ends in another peer's ``/p2p/ID``."""
        peer_id = self._resolve(addr)
        self._reachable(peer_id)
        return peer_id

    def connection_to(self, peer_id: PeerID) -> MemoryConnection | None:
        remote = self.network._peers.get(peer_id)
        if remote is None or not remote._alive or not self._alive:
            return None
        return MemoryConnection(remote.address)

    def add_addresses(self, peer_id: PeerID, addrs: Iterable[Multiaddr | str]) -> None:
        self.address_book[peer_id] = [parse_multiaddr(a) for a in addrs]

    def _resolve(self, addr: Multiaddr | str) -> PeerID:
        """The peer at ``addr`` (an address of this network, with or without
        ``/p2p/ID``)."""
        transport, named = split_peer_id(parse_multiaddr(addr))
        found = self.network._by_address.get(str(transport))
        if found is None:
            raise DialError(f"no peer of this in-memory network listens at {transport}")
        if named is not None and named != found:
            raise PeerIDMismatch(f"{addr} names {named}, but {found} listens there")
        return found

    def _reachable(self, peer: PeerID) -> MemoryPeer:
        if not self._alive:
            raise DialError("peer is closing")
        if peer == self.peer_id:
            raise DialError("cannot dial ourselves")
        remote = self.network._peers.get(peer)
        if remote is None:
            raise DialError(f"no known address for {peer}")
        if not remote._alive:
            raise DialError(f"could not reach {peer}: it does not answer")
        return remote

    async def new_stream(self, peer: PeerID | Multiaddr | str, protocol: str) -> MemoryStream:
        """A stream to ``peer`` (a PeerID, or an address :meth:`connect` accepts)
        speaking ``protocol``, returned at once (as a real peer's lazily negotiated
        stream on an open connection is). Raises :class:`DialError` if ``peer`` is
        unknown, dead, or this peer; a protocol the remote does not serve surfaces as
        :class:`ProtocolNotSupported` from the first read."""
        if not isinstance(peer, PeerID):
            peer = self._resolve(peer)
        remote = self._reachable(peer)
        ours = MemoryStream(self, peer, protocol)
        theirs = MemoryStream(remote, self.peer_id, protocol)
        ours._other, theirs._other = theirs, ours
        self._streams[ours] = None
        remote._streams[theirs] = None  # so a reset or a kill before it arrives finds it
        self.network._send(self.peer_id, theirs, _OPEN)
        return ours

    def round_trip(self, peer_id: PeerID) -> float | None:
        """The latency of the links to ``peer_id`` and back (``None`` for a peer not
        in the network): what a real peer's TCP measures."""
        if peer_id not in self.network._peers or peer_id == self.peer_id:
            return None
        there = self.network._link(self.peer_id, peer_id)
        back = self.network._link(peer_id, self.peer_id)
        return there.latency_seconds + back.latency_seconds

    async def new_pooled_stream(self, peer_id: PeerID, protocol: str, index: int) -> MemoryStream:
        """As :meth:`new_stream`: this network's links have no per-connection window,
        so a pool of connections is one link (protocol code runs its pooled path
        unchanged; how the bytes share the link is the same)."""
        await self.connect_pooled(peer_id, index)
        return await self.new_stream(peer_id, protocol)

    async def connect_pooled(self, peer_id: PeerID, index: int) -> None:
        """Nothing to dial (a pool is one link here); raises as :meth:`new_pooled_stream`
        would for a peer that cannot be reached."""
        if index < 1:
            raise ValueError(f"connection index {index} is not a further connection")
        self._reachable(peer_id)

    def create_task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` as a task this peer owns: cancelled when the peer is killed or
        closed (a dead process runs nothing). The caller awaits it for its result."""
        task = asyncio.get_running_loop().create_task(coro)
        if not self._alive:
            task.cancel()
        self._own(task)
        return task

    def close(self) -> None:
        """Leave the network as a closing peer does: as :meth:`MemoryNetwork.kill`, but
        our own streams fail as closed by us."""
        self._shut_down("peer closed", by_us=True)

    # --- network side ----------------------------------------------------------------

    def _own(self, task: asyncio.Task[Any]) -> None:
        self._tasks[task] = None
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(task, None)

    def _accept(self, stream: MemoryStream) -> None:
        handler = self._handlers.get(stream.protocol or "")
        if handler is None:
            self._forget(stream)
            stream._error = StreamReset("refused: protocol not served", by_us=True)
            self.network._send(self.peer_id, stream._remote(), _REFUSE)
            return
        task = asyncio.get_running_loop().create_task(self._serve(handler, stream))
        stream._handler_task = task
        self._own(task)

    async def _serve(self, handler: MemoryStreamHandler, stream: MemoryStream) -> None:
        try:
            await handler(stream)
        except ConnectionClosed as e:  # the remote reset it or left mid-request: theirs
            logger.info("handler for %s ended: %r", stream.protocol, e)
            stream.reset()
        except Exception as e:  # a handler's failure costs only its stream
            logger.warning("handler for %s failed: %r", stream.protocol, e)
            stream.reset()

    def _shut_down(self, reason: str, *, by_us: bool) -> None:
        if not self._alive:
            return
        self._alive = False
        self._handlers.clear()
        for stream in list(self._streams):
            stream._fail(StreamReset(f"stream failed: {reason}", by_us=by_us))
            self.network._send(self.peer_id, stream._remote(), _RESET, connection_broke=True)
        self._streams.clear()
        for task in list(self._tasks):
            task.cancel()

    def _forget(self, stream: MemoryStream) -> None:
        self._streams.pop(stream, None)


class MemoryStream:
    """One end of an in-memory stream, with the :class:`StreamLike` surface and the
    semantics of :class:`peers.connection.Stream`: data that arrived before a reset is
    read first, then the reset is raised."""

    def __init__(self, peer: MemoryPeer, remote_peer_id: PeerID, protocol: str) -> None:
        self._peer = peer
        self._remote_peer_id = remote_peer_id
        self.protocol: str | None = protocol
        self._other: MemoryStream | None = None
        self._chunks: deque[bytes] = deque()
        self._chunk_offset = 0
        self._buffered_bytes = 0
        self._unread = b""
        self._eof = False
        self._error: ConnectionClosed | None = None
        self._refused = False  # the remote does not serve the protocol: the next read says
        self._write_closed = False
        self._send_window = peer.network.window_bytes
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._failed = asyncio.Event()
        self._fail_callbacks: list[Callable[[], None]] = []
        self._handler_task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"MemoryStream({self._peer.peer_id} -> {self._remote_peer_id}, {self.protocol})"

    @property
    def remote_peer_id(self) -> PeerID:
        return self._remote_peer_id

    @property
    def has_buffered_data(self) -> bool:
        return bool(self._buffered_bytes or self._unread)

    @property
    def is_reset(self) -> bool:
        return isinstance(self._error, StreamReset)

    def _remote(self) -> MemoryStream:
        assert self._other is not None
        return self._other

    # --- from the network --------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered_bytes += len(data)
        self._readable.set()

    def _feed_eof(self) -> None:
        self._eof = True
        self._readable.set()
        self._forget_if_done()

    def _grant(self, credit: int) -> None:
        self._send_window += credit
        self._writable.set()

    def _fail(self, error: ConnectionClosed) -> None:
        if self._error is None:
            self._error = error
        self._readable.set()
        self._writable.set()
        self._failed.set()
        self._peer._forget(self)
        callbacks, self._fail_callbacks = self._fail_callbacks, []
        for callback in callbacks:
            callback()

    def _forget_if_done(self) -> None:
        if self._write_closed and self._eof:
            self._peer._forget(self)

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (once) when the stream is reset or its connection breaks."""
        if self._error is not None:
            callback()
        else:
            self._fail_callbacks.append(callback)

    def remove_on_failure(self, callback: Callable[[], None]) -> None:
        if callback in self._fail_callbacks:
            self._fail_callbacks.remove(callback)

    async def wait_failed(self) -> ConnectionClosed:
        await self._failed.wait()
        assert self._error is not None
        return self._error

    # --- reading -----------------------------------------------------------------------

    def unread(self, data: bytes) -> None:
        self._unread = data + self._unread

    async def _wait_readable(self) -> bool:
        """As :meth:`peers.connection.Stream._wait_readable`: True once data is
        buffered, False at EOF; the stream's error once nothing buffered is left."""
        while not self._buffered_bytes:
            if self._refused:
                self._refused = False
                raise ProtocolNotSupported(f"the remote does not serve {self.protocol}")
            if self._error is not None:
                raise self._error.fresh()
            if self._eof:
                return False
            self._readable.clear()
            await self._readable.wait()
        return True

    def _take(self, max_bytes: int) -> bytes:
        first = self._chunks[0]
        end = len(first) if max_bytes < 0 else min(len(first), self._chunk_offset + max_bytes)
        data = first[self._chunk_offset : end]
        if end == len(first):
            self._chunks.popleft()
            self._chunk_offset = 0
        else:
            self._chunk_offset = end
        self._buffered_bytes -= len(data)
        return data

    def _consumed(self, num_bytes: int) -> None:
        if num_bytes and self._error is None and not self._eof and self._peer._alive:
            self._peer.network._send(self._peer.peer_id, self._remote(), _WINDOW, credit=num_bytes)

    async def read(self, max_bytes: int = -1) -> bytes:
        """Up to ``max_bytes`` (all buffered if -1) once some are there; ``b""`` at EOF."""
        if self._unread:
            cut = len(self._unread) if max_bytes < 0 else max_bytes
            data, self._unread = self._unread[:cut], self._unread[cut:]
            return data
        if not await self._wait_readable():
            return b""
        if max_bytes < 0:
            pieces = [self._take(-1) for _ in range(len(self._chunks))]
            data = b"".join(pieces)
        else:
            data = self._take(max_bytes)
        self._consumed(len(data))
        return data

    async def read_chunks(self, max_bytes: int) -> list[bytes | memoryview]:
        """As :meth:`read`, the pieces as they arrived: whole pieces while fewer than
        ``max_bytes`` are taken (the last may pass it); ``[]`` at EOF."""
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        if self._unread:
            data = await self.read(max_bytes)
            return [data] if data else []
        if not await self._wait_readable():
            return []
        chunks: list[bytes | memoryview] = []
        total = 0
        while self._chunks and total < max_bytes:
            piece = self._take(-1)
            chunks.append(piece)
            total += len(piece)
        self._consumed(total)
        return chunks

    async def readexactly(self, num_bytes: int) -> bytes:
        """Exactly ``num_bytes``; raises :class:`asyncio.IncompleteReadError` at early EOF."""
        parts: list[bytes] = []
        remaining = num_bytes
        while remaining:
            data = await self.read(remaining)
            if not data:
                raise asyncio.IncompleteReadError(b"".join(parts), num_bytes)
            parts.append(data)
            remaining -= len(data)
        return b"".join(parts)

    # --- writing -----------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._error is not None:
            raise self._error.fresh()
        if self._write_closed:
            raise ConnectionClosed("stream was closed for writing", by_us=True)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        await self.write_many((data,))

    async def write_many(self, buffers: Iterable[bytes | bytearray | memoryview]) -> None:
        """Send the buffers in order as one frame (copied: the caller may reuse them),
        waiting for the remote's window as a yamux stream does."""
        data = b"".join(memoryview(b).cast("B") for b in buffers)
        if not data:
            return
        self._check_writable()
        network = self._peer.network
        network._frame_written(self, len(data))
        offset = 0
        while offset < len(data):
            self._check_writable()  # also after on_frame: a fault may have fired there
            if self._send_window <= 0:
                self._writable.clear()
                await self._writable.wait()
                continue
            piece = data[offset : offset + self._send_window]
            self._send_window -= len(piece)
            offset += len(piece)
            network._send(self._peer.peer_id, self._remote(), _DATA, data=piece)

    async def close(self) -> None:
        """Half-close: the remote reads EOF after what we sent."""
        if self._write_closed or self._error is not None:
            return
        self._write_closed = True
        self._peer.network._send(self._peer.peer_id, self._remote(), _EOF)
        self._forget_if_done()

    def reset(self) -> None:
        """Abort both ways; the remote's reads raise :class:`StreamReset` once what was
        in flight before has been read."""
        if self._error is None:
            self._fail(StreamReset("stream was reset by us", by_us=True))
            self._peer.network._send(self._peer.peer_id, self._remote(), _RESET)


if TYPE_CHECKING:
    # The conformance mypy checks: the real classes and ours both have the surfaces.
    def _conforms(
        stream: Stream, peer: Peer, memory_stream: MemoryStream, memory_peer: MemoryPeer
    ) -> tuple[StreamLike, StreamLike, StreamHost, StreamHost, RpcHost, RpcHost]:
        return stream, memory_stream, peer, memory_peer, peer, memory_peer

    def _addressed(peer: Peer, memory_peer: MemoryPeer) -> tuple[ReachableHost, ReachableHost]:
        return peer, memory_peer
