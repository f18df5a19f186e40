"""Which peers count as distinct sources: the network a connection comes from.

Identities are cheap to make (docs/benchmarks.md, "Figures behind constants"), addresses
are not: one volunteer can mint a thousand PeerIDs but rarely holds addresses in a
thousand networks. Wherever agreement among peers decides something (a state a newcomer
loads, later DHT buckets), peers are counted by :func:`source_group`, not by identity.

- A public IPv4 address counts by its /24 and a public IPv6 address by its /48: what
  one home line, one cloud tenant or one hosting customer typically holds.
- A private, CGNAT or benchmark-range address (a LAN, a namespace lab) counts by the
  whole address: there the network's owner hands out addresses, not the peer.
- Loopback counts by identity: peers on one machine are one user's own processes (a
  local test swarm), and someone who can start processes there needs no Sybils.
- An address without an IP (an in-memory test network) counts by identity too.

A relayed connection's address is the relay's, so peers reached through one relay
count as one source: the conservative choice, since the relay cannot tell us where
they are.
"""

from __future__ import annotations

import functools
import ipaddress

from multiaddr import Multiaddr

from peers.identity import PeerID

#: A public IPv4 source: the block one line or tenant usually holds.
IPV4_PREFIX = 24
#: A public IPv6 source: the prefix RIRs hand a site.
IPV6_PREFIX = 48


def source_group(addr: Multiaddr | None, peer_id: PeerID) -> str:
    """The source ``peer_id`` counts as when it reaches us from ``addr`` (a remote
    address; ``None`` when unknown)."""
    ip = _first_ip(addr)
    if ip is None or ip.is_loopback:
        return f"peer/{peer_id.to_base58()}"
    if not ip.is_global:
        return f"host/{ip}"
    return f"net/{public_block(ip)}"


def public_block(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The block a public address counts by: its /24 (IPv4) or /48 (IPv6)."""
    bits = IPV4_PREFIX if ip.version == 4 else IPV6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


#: Remote addresses whose IP is remembered: a DHT node asks for each request it serves.
ADDRESS_CACHE_SIZE = 4096


@functools.lru_cache(maxsize=ADDRESS_CACHE_SIZE)
def _first_ip(addr: Multiaddr | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if addr is None:
        return None
    for proto, value in addr.items():
        if proto.name in ("ip4", "ip6") and value is not None:
            try:
                return ipaddress.ip_address(value)
            except ValueError:
                return None
    return None
