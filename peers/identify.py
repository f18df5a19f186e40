"""libp2p identify (``/ipfs/id/1.0.0``): on a new stream, the listener sends one
length-prefixed ``Identify`` protobuf and closes (libp2p identify spec).

Message fields: publicKey = 1, listenAddrs = 2 (repeated, binary multiaddrs),
protocols = 3 (repeated), observedAddr = 4, protocolVersion = 5, agentVersion = 6.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from multiaddr import Multiaddr

from peers import limits
from peers.addresses import parse_multiaddr, split_peer_id, tcp_target
from peers.config import PeerConfig
from peers.connection import Stream
from peers.errors import AddressError, RemoteProtocolError
from peers.identity import KeyPair, PeerID, PublicKey
from peers.protobuf import all_bytes, decode_fields, encode_fields, first_bytes
from peers.serialization import FrameDecoder, encode_frame

IDENTIFY_PROTOCOL_ID = "/ipfs/id/1.0.0"
PROTOCOL_VERSION = "ipfs/0.1.0"
#: Addresses we keep from one identify reply; a peer has a handful at most.
MAX_IDENTIFY_ADDRS = 32
#: Protocols we keep from one identify reply.
MAX_IDENTIFY_PROTOCOLS = 256


class IdentifyHost(Protocol):
    """What identify needs of a peer (:class:`peers.host.Peer` is one): who it is, what
    it serves and where it listens, streams, and a book of other peers' addresses."""

    @property
    def identity(self) -> KeyPair: ...

    @property
    def config(self) -> PeerConfig:
        """Its agent version goes out in every identify reply."""

    @property
    def advertised_addrs(self) -> list[Multiaddr]: ...

    @property
    def protocols(self) -> list[str]: ...

    async def new_stream(self, peer: PeerID | Multiaddr | str, protocol: str, /) -> Stream: ...

    def set_stream_handler(
        self, protocol: str, handler: Callable[[Stream], Awaitable[None]], /
    ) -> None: ...

    def add_addresses(self, peer_id: PeerID, addrs: Iterable[Multiaddr | str], /) -> None: ...


@dataclass(frozen=True, slots=True)
class IdentifyInfo:
    peer_id: PeerID
    agent_version: str
    protocol_version: str
    protocols: tuple[str, ...]
    listen_addrs: tuple[Multiaddr, ...]
    observed_addr: Multiaddr | None


def addrs_for(peer: IdentifyHost, remote: Multiaddr) -> list[Multiaddr]:
    """What we tell the peer at ``remote`` we can be reached at: never a loopback address
    unless it is on this machine too (loopback elsewhere is the remote's own)."""
    addrs = peer.advertised_addrs
    try:
        host = tcp_target(remote).host
        local = ipaddress.ip_address(host).is_loopback
    except (AddressError, ValueError):
        local = False
    if local:
        return addrs
    return [a for a in addrs if not _is_loopback(a)]


def _is_loopback(addr: Multiaddr) -> bool:
    try:
        return ipaddress.ip_address(tcp_target(addr).host).is_loopback
    except (AddressError, ValueError):
        return False


def encode_identify(peer: IdentifyHost, stream: Stream) -> bytes:
    observed = stream.connection.remote_address
    fields: list[tuple[int, int | bytes]] = [
        (5, PROTOCOL_VERSION.encode()),
        (6, peer.config.agent_version.encode()),
        (1, peer.identity.public_key.to_protobuf()),
    ]
    fields += [(2, split_peer_id(a)[0].to_bytes()) for a in addrs_for(peer, observed)]
    fields.append((4, observed.to_bytes()))
    fields += [(3, p.encode()) for p in peer.protocols]
    return encode_fields(fields)


def decode_identify(data: bytes, remote: PeerID) -> IdentifyInfo:
    """Parse an identify message; raises :class:`RemoteProtocolError` if it is malformed or
    its public key is not the one the connection authenticated."""
    fields = decode_fields(data)
    key_bytes = first_bytes(fields, 1)
    if key_bytes is not None and not remote.matches(PublicKey.from_protobuf(key_bytes)):
        raise RemoteProtocolError("identify carries a public key that is not the peer's")
    addrs: list[Multiaddr] = []
    for raw in all_bytes(fields, 2)[:MAX_IDENTIFY_ADDRS]:
        try:
            addrs.append(parse_multiaddr(raw))
        except AddressError:  # one unreadable address costs only itself
            continue
    observed_raw = first_bytes(fields, 4)
    observed: Multiaddr | None = None
    if observed_raw:
        try:
            observed = parse_multiaddr(observed_raw)
        except AddressError:
            observed = None
    return IdentifyInfo(
        peer_id=remote,
        agent_version=(first_bytes(fields, 6) or b"").decode(errors="replace"),
        protocol_version=(first_bytes(fields, 5) or b"").decode(errors="replace"),
        protocols=tuple(
            p.decode(errors="replace") for p in all_bytes(fields, 3)[:MAX_IDENTIFY_PROTOCOLS]
        ),
        listen_addrs=tuple(addrs),
        observed_addr=observed,
    )


def install_identify(peer: IdentifyHost) -> None:
    async def serve_identify(stream: Stream) -> None:
        await stream.write(encode_frame(encode_identify(peer, stream)))
        await stream.close()

    peer.set_stream_handler(IDENTIFY_PROTOCOL_ID, serve_identify)


async def identify(peer: IdentifyHost, remote: PeerID | Multiaddr | str) -> IdentifyInfo:
    """Ask ``remote`` who it is; raises RemoteProtocolError on a malformed reply."""
    stream = await peer.new_stream(remote, IDENTIFY_PROTOCOL_ID)
    decoder = FrameDecoder(limits.MAX_IDENTIFY_BYTES)
    while True:
        data = await stream.read()
        if not data:
            raise RemoteProtocolError("identify stream ended before a whole message")
        frames = decoder.feed(data)
        if frames:
            break
    await stream.close()
    info = decode_identify(bytes(frames[0]), stream.remote_peer_id)
    peer.add_addresses(info.peer_id, info.listen_addrs)
    return info
