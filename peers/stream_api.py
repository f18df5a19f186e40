"""The stream and host surfaces that protocol code uses, as ``typing.Protocol``s.

Protocol code (RPC framing, the butterfly all-reduce) needs only these; both the real
:class:`peers.connection.Stream` / :class:`peers.host.Peer` and the in-memory
:class:`peers.memory_network.MemoryStream` / :class:`peers.memory_network.MemoryPeer`
satisfy them, so the same code runs over TCP or on a virtual clock (CONTRIBUTING.md,
"Interfaces come with a conformance test" and "How tests are organised").
See docs/design/memory-network.md.

Methods take positional-only parameters: implementations name theirs as they like
(``Peer.new_stream`` calls its second one ``protocols`` and also takes a list).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from peers.errors import ConnectionClosed
from peers.identity import KeyPair, PeerID

if TYPE_CHECKING:
    from multiaddr import Multiaddr

    from peers.traffic import TrafficBook


@runtime_checkable
class StreamLike(Protocol):
    """An ordered byte pipe to one remote peer, with half-close and reset.

    ``read`` returns ``b""`` at the remote's end of stream and raises
    :class:`peers.errors.StreamReset` once the stream is reset (by either side) or its
    connection broke; writes raise :class:`peers.errors.ConnectionClosed` then.
    """

    @property
    def protocol(self) -> str | None:
        """The protocol id the stream speaks (``None`` before negotiation)."""

    @property
    def remote_peer_id(self) -> PeerID: ...

    @property
    def has_buffered_data(self) -> bool:
        """Whether a ``read`` would return data without waiting."""

    @property
    def is_reset(self) -> bool: ...

    async def read(self, max_bytes: int = -1, /) -> bytes: ...

    async def read_chunks(self, max_bytes: int, /) -> list[bytes | memoryview]: ...

    async def readexactly(self, num_bytes: int, /) -> bytes: ...

    def unread(self, data: bytes, /) -> None: ...

    async def write(self, data: bytes | bytearray | memoryview, /) -> None: ...

    async def write_many(self, buffers: Iterable[bytes | bytearray | memoryview], /) -> None: ...

    async def close(self) -> None:
        """Half-close: we send no more; the remote reads EOF after what we sent."""

    def reset(self) -> None:
        """Abort both ways; the remote's reads raise :class:`peers.errors.StreamReset`."""

    async def wait_failed(self) -> ConnectionClosed: ...

    def on_failure(self, callback: Callable[[], None], /) -> None: ...

    def remove_on_failure(self, callback: Callable[[], None], /) -> None: ...


#: What a host runs for each inbound stream of a protocol it serves.
StreamHandlerLike = Callable[[StreamLike], Awaitable[None]]


@runtime_checkable
class StreamHost(Protocol):
    """A peer that opens streams to other peers and serves protocols on inbound ones."""

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def identity(self) -> KeyPair:
        """The key pair behind ``peer_id``: what the peer signs its own statements with
        (a round's vote, a DHT record)."""

    async def new_stream(self, peer: PeerID, protocol: str, /) -> StreamLike:
        """A stream to ``peer`` speaking ``protocol``. Raises
        :class:`peers.errors.DialError` if the peer cannot be reached; a protocol the
        remote does not serve surfaces as :class:`peers.errors.ProtocolNotSupported`
        from the first read."""

    def set_stream_handler(self, protocol: str, handler: StreamHandlerLike, /) -> None:
        """Serve ``protocol``; ``ValueError`` if a handler for it is already set."""

    def remove_stream_handler(self, protocol: str, /) -> None: ...


@runtime_checkable
class PooledStreamHost(StreamHost, Protocol):
    """A :class:`StreamHost` that can spread one transfer over several connections to
    a peer (:meth:`peers.host.Peer.new_pooled_stream`) and says each link's round trip:
    what the all-reduce uses on long fat pipes, where one TCP window caps a connection."""

    def round_trip(self, peer_id: PeerID, /) -> float | None:
        """Seconds there and back on our connection to ``peer_id``, ``None`` unknown."""

    async def new_pooled_stream(self, peer_id: PeerID, protocol: str, index: int, /) -> StreamLike:
        """A stream to ``peer_id`` on our ``index``-th connection to it (``index`` >= 1;
        0 is :meth:`new_stream`'s). Raises :class:`peers.errors.DialError` where no
        further connection can be made."""

    async def connect_pooled(self, peer_id: PeerID, index: int, /) -> None:
        """Make sure our ``index``-th connection to ``peer_id`` is up (dialing it if
        not), so that :meth:`new_pooled_stream` on it opens at once; raises as that."""


@runtime_checkable
class RpcHost(Protocol):
    """What :mod:`peers.rpc` needs of a peer: streams to a peer named by id or address,
    handlers for inbound ones, and a book of traffic by protocol (``Peer.traffic``)."""

    @property
    def traffic(self) -> TrafficBook: ...

    async def new_stream(self, peer: PeerID | Multiaddr | str, protocol: str, /) -> StreamLike:
        """As :meth:`StreamHost.new_stream`; an address dials it first."""

    def set_stream_handler(self, protocol: str, handler: StreamHandlerLike, /) -> None: ...

    def remove_stream_handler(self, protocol: str, /) -> None: ...


class ConnectionLike(Protocol):
    """What a host says about its connection to one peer."""

    @property
    def remote_address(self) -> Multiaddr:
        """The address the remote reaches us from (its end of the connection): what
        per-network quotas count by (:mod:`peers.subnets`), never an address it claims."""


@runtime_checkable
class AddressedHost(RpcHost, Protocol):
    """A host whose peers have addresses: what the DHT needs (:mod:`peers.dht`). It
    listens at addresses it can tell others, dials an address to learn who is there,
    keeps a book of where peers are, and says where a connected peer reaches it from."""

    @property
    def peer_id(self) -> PeerID: ...

    @property
    def identity(self) -> KeyPair: ...

    @property
    def listen_addrs(self) -> list[Multiaddr]:
        """Where others can dial us, each ending in ``/p2p/OUR_ID``; none for a host that
        cannot be dialed (behind NAT, or a client)."""

    async def connect(self, addr: Multiaddr | str, /) -> PeerID:
        """Reach ``addr`` and return who answered. Raises :class:`peers.errors.DialError`
        if nobody does, :class:`peers.errors.PeerIDMismatch` if the address names
        someone else."""

    def connection_to(self, peer_id: PeerID, /) -> ConnectionLike | None:
        """Our live connection to ``peer_id``, if there is one."""

    def add_addresses(self, peer_id: PeerID, addrs: Iterable[Multiaddr | str], /) -> None:
        """Remember where ``peer_id`` can be dialed (as learned from other peers)."""


class PunchStatus(Protocol):
    @property
    def punchable(self) -> bool:
        """Whether we are behind a NAT that hole punching gets through
        (:attr:`peers.nat.NatManager.punchable`)."""


@runtime_checkable
class ReachableHost(AddressedHost, Protocol):
    """An :class:`AddressedHost` that says every address it is reached at (relayed ones
    too) and whether hole punching reaches it: what the averaging services need of
    their peer (matchmaking, the state server)."""

    @property
    def advertised_addrs(self) -> list[Multiaddr]: ...

    @property
    def nat(self) -> PunchStatus: ...


if TYPE_CHECKING:
    # Services generic over their host (the matchmaker, the averager) default to a real
    # Peer, so a bare ``Averager`` annotation keeps ``averager.peer`` a Peer. PEP 696
    # defaults are for the type checker only, as in peers.rpc.
    from typing_extensions import TypeVar as DefaultTypeVar

    from peers.host import Peer

    ReachableHostT = DefaultTypeVar("ReachableHostT", bound=ReachableHost, default=Peer)
else:
    ReachableHostT = TypeVar("ReachableHostT", bound=ReachableHost)
