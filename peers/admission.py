"""Which inbound TCP connections we take: counts and a handshake rate by source.

Decided when a connection is accepted, before we read a byte of it; a refused one is
closed at once and costs an accept and a close. Sources are what :mod:`peers.subnets`
says one holder controls:

- a **host**: an IPv4 address, or an IPv6 /64 (one home line or one machine gets a
  whole /64, so counting IPv6 addresses one by one would bound nothing);
- a **subnet** of public addresses: an IPv4 /24 or an IPv6 /48, so that a few
  neighbouring addresses cannot take every connection we have;
- loopback and private addresses (a LAN, the namespace lab) count by host only, and
  loopback has no handshake rate: a local test swarm opens dozens of connections at
  once, from a machine its owner controls.

The handshake rate is a token bucket per host: each accepted connection costs a token,
tokens come back at ``handshake_rate`` per second up to ``handshake_burst``. It bounds
what one host can make us spend on handshakes (an X25519 key generation and three
Diffie-Hellman operations, and a signature check, each), whatever it then does with
the connection. A public subnet has a bucket too, ``SUBNET_RATE_FACTOR`` times larger
and faster: an IPv6 /48 holds 65,536 hosts, each with a full bucket of its own.

A pure structure: the caller passes ``now`` and holds what :meth:`admit` returns until
the connection ends.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from peers.subnets import public_block

#: An IPv6 host: the prefix a single line or machine is given.
IPV6_HOST_PREFIX = 64
#: A public subnet's handshake rate and burst, in hosts' worth: a few volunteers behind
#: neighbouring addresses start at once, a whole /48 of fresh hosts does not.
SUBNET_RATE_FACTOR = 4
#: Sources (hosts and subnets) whose token bucket we remember at once. A bucket that has
#: refilled is the same as none, so only sources that handshook in the last
#: ``burst / rate`` seconds need one; past this many, full buckets are forgotten first,
#: then the oldest.
MAX_TRACKED_SOURCES = 4096


@dataclass(frozen=True, slots=True)
class Source:
    """Where an inbound connection comes from, as admission counts it."""

    host: str
    subnet: str | None
    """Public addresses only."""
    rate_limited: bool
    """False for loopback."""


def source_of(ip: str) -> Source:
    """The host and subnet ``ip`` (a socket's peer address) counts as."""
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return Source(host=ip, subnet=None, rate_limited=True)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack listener's view of an IPv4 peer
    if address.is_loopback:
        return Source(host=str(address), subnet=None, rate_limited=False)
    if address.version == 6:
        host = str(ipaddress.ip_network(f"{address}/{IPV6_HOST_PREFIX}", strict=False))
    else:
        host = str(address)
    if not address.is_global:
        return Source(host=host, subnet=None, rate_limited=True)
    # The same blocks as peers.subnets.source_group: what one line or tenant holds.
    return Source(host=host, subnet=public_block(address), rate_limited=True)


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    burst: int
    rate: float

    def full(self, now: float) -> bool:
        return self.tokens + (now - self.at) * self.rate >= self.burst


@dataclass(frozen=True, slots=True)
class Admitted:
    """An admitted connection: give it back to :meth:`InboundAdmission.release`."""

    source: Source


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a connection was refused (for logs and statistics)."""

    reason: str


@dataclass(kw_only=True)
class InboundAdmission:
    """Counts inbound connections (handshaking or established) by host and subnet, and
    hands out handshake tokens per host."""

    max_connections_per_ip: int
    """Per host (an IPv4 address, an IPv6 /64)."""
    max_connections_per_subnet: int
    """Per public IPv4 /24 or IPv6 /48."""
    handshake_rate: float
    """Tokens per second per host (loopback: unlimited)."""
    handshake_burst: int
    """Bucket size: handshakes a host may start at once after a quiet spell."""
    _per_host: dict[str, int] = field(default_factory=dict)
    _per_subnet: dict[str, int] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def admit(self, ip: str, now: float) -> Admitted | Refused:
        """Count a connection from ``ip`` accepted at ``now`` (seconds, monotonic), or
        say why it is refused. Nothing is counted for a refused one."""
        source = source_of(ip)
        if self._per_host.get(source.host, 0) >= self.max_connections_per_ip:
            return Refused(f"{self.max_connections_per_ip} connections from {source.host}")
        if (
            source.subnet is not None
            and self._per_subnet.get(source.subnet, 0) >= self.max_connections_per_subnet
        ):
            return Refused(f"{self.max_connections_per_subnet} connections from {source.subnet}")
        if source.rate_limited:
            keys = [(source.host, 1)]
            if source.subnet is not None:
                keys.append((source.subnet, SUBNET_RATE_FACTOR))
            buckets = [(self._refilled(key, factor, now), key) for key, factor in keys]
            for bucket, key in buckets:
                if bucket.tokens < 1.0:
                    return Refused(f"handshakes from {key} above their rate")
            for bucket, _ in buckets:
                bucket.tokens -= 1.0
        self._per_host[source.host] = self._per_host.get(source.host, 0) + 1
        if source.subnet is not None:
            self._per_subnet[source.subnet] = self._per_subnet.get(source.subnet, 0) + 1
        return Admitted(source)

    def release(self, admitted: Admitted) -> None:
        """The connection ``admitted`` stands for has ended."""
        _decrement(self._per_host, admitted.source.host)
        if admitted.source.subnet is not None:
            _decrement(self._per_subnet, admitted.source.subnet)

    def connections_from(self, ip: str) -> int:
        """Inbound connections now counted against ``ip``'s host."""
        return self._per_host.get(source_of(ip).host, 0)

    @property
    def num_tracked_sources(self) -> int:
        """Hosts and subnets whose handshake bucket is remembered."""
        return len(self._buckets)

    def _refilled(self, key: str, factor: int, now: float) -> _Bucket:
        burst, rate = self.handshake_burst * factor, self.handshake_rate * factor
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_SOURCES:
                self._forget(now)
            bucket = self._buckets[key] = _Bucket(float(burst), now, burst, rate)
        else:
            elapsed = max(0.0, now - bucket.at)
            bucket.tokens = min(burst, bucket.tokens + elapsed * rate)
            bucket.at = now
        return bucket

    def _forget(self, now: float) -> None:
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]
        while len(self._buckets) >= MAX_TRACKED_SOURCES:  # dicts keep insertion order
            del self._buckets[next(iter(self._buckets))]


def _decrement(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
