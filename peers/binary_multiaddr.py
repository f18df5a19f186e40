"""Binary multiaddrs as libp2p control messages carry them (relay, AutoNAT, DCUtR), read
strictly.

The ``multiaddr`` package accepts some malformed binary addresses as they are: a
truncated ``/ip4`` value is padded on display (``04 01`` shows as ``/ip4/0.0.0.1``)
while the object keeps the short bytes, so it equals neither the address it shows nor
any address a peer could dial. We keep an address only if it re-encodes, from its text
form, to exactly the bytes that arrived.
"""

from __future__ import annotations

import ipaddress

from multiaddr import Multiaddr
from multiaddr.transforms import bytes_iter

from peers.addresses import is_circuit, parse_multiaddr

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: The protocol name of a relayed (circuit) hop; an address with it is not direct.


def parse_binary_multiaddr(raw: bytes) -> Multiaddr | None:
    """The multiaddr ``raw`` encodes, or ``None`` if it is empty, malformed or not in
    canonical form. Never raises: one unreadable address costs only itself."""
    if not raw:
        return None
    try:
        addr = parse_multiaddr(bytes(raw))
        if parse_multiaddr(str(addr)).to_bytes() != raw:
            return None
    # The multiaddr package's failures on hostile bytes are no documented closed set
    # (ValueError subclasses mostly); whatever it raises, the address is unreadable.
    except Exception:
        return None
    return addr


def normalize_ip(ip: str | IPAddress) -> IPAddress:
    """``ip`` as an address object, an IPv4-mapped IPv6 address as the IPv4 address it maps
    (a dual-stack socket reports IPv4 peers that way). Raises ``ValueError`` if it is not
    an IP address."""
    parsed = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return parsed.ipv4_mapped
    return parsed


def ip_of(addr: Multiaddr) -> IPAddress | None:
    """The IP an ``/ip4/...`` or ``/ip6/...`` address starts with, or ``None`` when it
    starts with anything else (a DNS name, ``/ip6zone``) or is relayed: a relayed
    connection's address says nothing checkable about the remote's own IP."""
    if is_circuit(addr):
        return None
    items = list(addr.items())
    if not items or items[0][0].name not in ("ip4", "ip6") or items[0][1] is None:
        return None
    try:
        return normalize_ip(items[0][1])
    except ValueError:
        return None


def components(addr: Multiaddr) -> list[tuple[str, bytes]]:
    """Each part of ``addr`` as (protocol name, its binary encoding). Concatenating parts
    gives a valid binary multiaddr, so addresses are cut and spliced in binary: the text
    form does not survive that for path protocols (``/unix``)."""
    raw = addr.to_bytes()
    parts = list(bytes_iter(raw))
    ends = [offset for offset, *_ in parts[1:]] + [len(raw)]
    return [
        (proto.name, raw[offset:end])
        for (offset, proto, _, _), end in zip(parts, ends, strict=True)
    ]
