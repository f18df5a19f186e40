"""Which addresses learned from peers we dial (pure: the caller says where we are).

A peer tells us where other peers are: in identify, in DHT contacts and records, in
matchmaking and state records, in a hole punch. A hostile one can name any address, and
dialing it spends our SYN and a multistream header on whatever answers there: a service
on our own machine (loopback), our router's admin page (our LAN), a victim of a
reflection (a DNS name we resolve, perhaps to a LAN address). So an address that came
from a peer is dialed only if it is sensible:

- a public IP address: always (that is where peers are);
- loopback: only when every address we are bound to is loopback too (a local swarm,
  whose peers all announce loopback; honest peers announce loopback to no one else);
- a private, CGNAT, link-local or unique-local address: only inside a network one of
  our interfaces is on (we share that LAN, so the peer may be on it);
- a DNS name, an unspecified, multicast or reserved address, port 0: never;
- a relayed address: by the address of its relay.

Addresses the user gave us (``connect``, initial peers) are dialed as given.

198.18.0.0/15 (RFC 2544's benchmarking range) counts as public: it is never routed on
the internet, so no honest peer announces it there, and our namespace lab uses it for
its emulated internet and its LANs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import psutil
from multiaddr import Multiaddr

from peers.addresses import circuit_address, is_circuit, tcp_target
from peers.errors import PeersError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Never routed on the internet; the namespace lab's internet (see the module docstring).
BENCHMARK_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")


@dataclass(frozen=True, slots=True)
class LocalNetworks:
    """Where this peer is: the networks of its interfaces, and whether it is bound to
    loopback alone (or to nothing)."""

    networks: tuple[IPNetwork, ...] = ()
    loopback_only: bool = True

    @classmethod
    def of_this_machine(cls, bound: Iterable[Multiaddr]) -> LocalNetworks:
        """Read this machine's interfaces (their networks, by netmask); ``bound`` are
        the concrete addresses our listeners are bound to."""
        loopback_only = True
        for addr in bound:
            ip = _ip_of(addr)
            if ip is None or not ip.is_loopback:
                loopback_only = False
        return cls(networks=tuple(_interface_networks()), loopback_only=loopback_only)


def refusal(addr: Multiaddr, local: LocalNetworks) -> str | None:
    """Why ``addr``, learned from a peer, is not dialed; ``None`` if it may be."""
    if is_circuit(addr):
        try:
            relay = circuit_address(addr).relay_addr
        except PeersError as e:
            return str(e)
        if is_circuit(relay):
            return "a relay reached through another relay"
        return refusal(relay, local)
    try:
        target = tcp_target(addr)
    except PeersError as e:
        return str(e)
    if target.is_dns:
        return "a DNS name (resolving names peers give us could lead anywhere)"
    if target.port == 0:
        return "port 0"
    try:
        ip = _unmapped(ipaddress.ip_address(target.host))
    except ValueError:
        return f"not an IP address: {target.host!r}"
    if ip.is_loopback:
        return None if local.loopback_only else "loopback (we are not a local swarm)"
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return "an unspecified, multicast or reserved address"
    if ip.is_global or ip in BENCHMARK_NETWORK:
        return None
    if any(ip in network for network in local.networks if network.version == ip.version):
        return None
    return "a private address of a network we are not on"


def dialable(addrs: Iterable[Multiaddr], local: LocalNetworks) -> list[Multiaddr]:
    """The addresses of ``addrs`` that :func:`refusal` lets us dial."""
    return [addr for addr in addrs if refusal(addr, local) is None]


def _unmapped(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) as the IPv4 address it is."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _ip_of(addr: Multiaddr) -> IPAddress | None:
    try:
        target = tcp_target(addr)
        return _unmapped(ipaddress.ip_address(target.host))
    except (PeersError, ValueError):
        return None


def _interface_networks() -> list[IPNetwork]:
    found: list[IPNetwork] = []
    with contextlib.suppress(OSError):
        for entries in psutil.net_if_addrs().values():
            for entry in entries:
                if entry.family not in (socket.AF_INET, socket.AF_INET6) or not entry.netmask:
                    continue
                address = entry.address.split("%", 1)[0]  # an IPv6 scope (fe80::1%eth0)
                with contextlib.suppress(ValueError):
                    # a mask as a prefix length: ipaddress reads IPv6 masks only that way
                    bits = bin(int(ipaddress.ip_address(entry.netmask))).count("1")
                    found.append(ipaddress.ip_interface(f"{address}/{bits}").network)
    return found
