"""Multiaddrs: parsing, the /p2p part, and what a TCP dial needs.

Built on the ``multiaddr`` package (the one py-libp2p uses), so our addresses are the
ones libp2p users already know: ``/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from peers.errors import AddressError
from peers.identity import PeerID

__all__ = [
    "CircuitAddress",
    "Multiaddr",
    "TcpTarget",
    "circuit_address",
    "is_circuit",
    "parse_multiaddr",
    "split_peer_id",
    "tcp_target",
    "with_peer_id",
]


#: Parsed addresses remembered: the multiaddr package parses slowly (tens of
#: microseconds), and a DHT node sees the same few hundred addresses over and over.
_PARSE_CACHE_SIZE = 4096


def parse_multiaddr(text: str | bytes | Multiaddr) -> Multiaddr:
    """Parse a multiaddr; raises :class:`AddressError` with the reason if it is malformed."""
    if isinstance(text, Multiaddr):
        return text
    return _parse_cached(text)


@functools.lru_cache(maxsize=_PARSE_CACHE_SIZE)
def _parse_cached(text: str | bytes) -> Multiaddr:
    try:
        return Multiaddr(text)
    except (MultiaddrError, ValueError, TypeError) as e:
        raise AddressError(f"invalid multiaddr {text!r}: {e}") from e


def split_peer_id(addr: Multiaddr) -> tuple[Multiaddr, PeerID | None]:
    """Split ``/.../p2p/ID`` into the transport part and the PeerID (``None`` if absent).

    Only a trailing ``/p2p`` is split off; a relayed address keeps its inner parts.
    Raises :class:`peers.errors.IdentityError` if the /p2p part is not a PeerID.
    """
    return _split_cached(addr)


@functools.lru_cache(maxsize=_PARSE_CACHE_SIZE)
def _split_cached(addr: Multiaddr) -> tuple[Multiaddr, PeerID | None]:
    items = list(addr.items())
    if not items or items[-1][0].name != "p2p":
        return addr, None
    peer_id = PeerID.from_base58(items[-1][1])
    transport = Multiaddr(
        "".join(f"/{p.name}/{v}" if v is not None else f"/{p.name}" for p, v in items[:-1])
    )
    return transport, peer_id


def with_peer_id(addr: Multiaddr, peer_id: PeerID) -> Multiaddr:
    """``addr`` with ``/p2p/ID`` appended (replacing any /p2p it had)."""
    transport, _ = split_peer_id(addr)
    return Multiaddr(f"{transport}/p2p/{peer_id.to_base58()}")


@dataclass(frozen=True, slots=True)
class TcpTarget:
    """What a TCP dial or listen needs: host (an IP literal or a DNS name) and port."""

    host: str
    port: int
    is_dns: bool


def tcp_target(addr: Multiaddr) -> TcpTarget:
    """The host and port of an ``/ip4|ip6|dns|dns4|dns6/.../tcp/PORT[/p2p/ID]`` address.

    Raises :class:`AddressError` for anything else (e.g. a relay circuit or UDP).
    """
    transport, _ = split_peer_id(addr)
    items = list(transport.items())
    if len(items) != 2 or items[1][0].name != "tcp":
        raise AddressError(f"not a TCP address: {addr}")
    proto, host = items[0][0].name, items[0][1]
    if proto not in ("ip4", "ip6", "dns", "dns4", "dns6") or host is None:
        raise AddressError(f"unsupported network protocol /{proto} in {addr}")
    return TcpTarget(host=host, port=int(items[1][1]), is_dns=proto.startswith("dns"))


def tcp_multiaddr(host: str, port: int) -> Multiaddr:
    """The multiaddr of a bound socket address."""
    proto = "ip6" if ":" in host else "ip4"
    return Multiaddr(f"/{proto}/{host}/tcp/{port}")


@dataclass(frozen=True, slots=True)
class CircuitAddress:
    """A relayed address, ``RELAY_ADDR/p2p/RELAY/p2p-circuit[/p2p/DEST]`` (circuit relay v2):
    where the relay is, who it is, and whom to reach through it (``None`` if unnamed)."""

    relay_addr: Multiaddr
    relay: PeerID
    destination: PeerID | None


def is_circuit(addr: Multiaddr) -> bool:
    """Whether ``addr`` goes through a relay."""
    return any(p.name == "p2p-circuit" for p, _ in addr.items())


def circuit_address(addr: Multiaddr) -> CircuitAddress:
    """The parts of a relayed address; :class:`AddressError` if it is not one we can dial
    (a relay reached directly over TCP, named by its PeerID; one hop only)."""
    items = list(addr.items())
    names = [p.name for p, _ in items]
    if names.count("p2p-circuit") != 1:
        raise AddressError(f"not a one-hop relayed address: {addr}")
    cut = names.index("p2p-circuit")
    if cut < 1 or names[cut - 1] != "p2p":
        raise AddressError(f"a relayed address names its relay with /p2p/ID: {addr}")
    tail = items[cut + 1 :]
    if len(tail) > 1 or (tail and tail[0][0].name != "p2p"):
        raise AddressError(f"only /p2p/ID may follow /p2p-circuit: {addr}")
    relay_text = "".join(
        f"/{p.name}/{v}" if v is not None else f"/{p.name}" for p, v in items[:cut]
    )
    relay_addr = parse_multiaddr(relay_text)
    transport, relay = split_peer_id(relay_addr)
    assert relay is not None
    tcp_target(transport)  # the relay itself must be dialable directly
    destination = PeerID.from_base58(tail[0][1]) if tail and tail[0][1] else None
    return CircuitAddress(relay_addr=relay_addr, relay=relay, destination=destination)
