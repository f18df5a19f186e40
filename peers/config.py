"""The configuration of a :class:`peers.host.Peer`, and what it reports about itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from peers import limits
from peers.addresses import parse_multiaddr, tcp_target
from peers.identity import KeyPair, PeerID
from peers.noise import NOISE_CIPHERS
from peers.relay.resources import RelayResourceConfig
from peers.traffic import TrafficSnapshot

#: Where a peer that joins a swarm listens unless told: every IPv4 interface, any free
#: port, as libp2p's own daemons do; so peers on other machines can dial it and TCP
#: hole punching can start from its listen port. ``swarm.trainer.TrainerConfig`` and
#: every ``swarm`` command take it.
SWARM_LISTEN_ADDRS: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
#: Where a bare :class:`PeerConfig` listens: loopback only, so that a peer built in a
#: test, a notebook or another program is not open to the network unless asked.
LOOPBACK_LISTEN_ADDRS: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)


@dataclass(frozen=True, kw_only=True)
class PeerConfig:
    """How a :class:`Peer` listens and what it tolerates from others."""

    identity: KeyPair | None = None
    """The peer's key pair; a fresh one if ``None``."""
    listen_addrs: tuple[str, ...] = LOOPBACK_LISTEN_ADDRS
    """Multiaddrs to listen on (``/ip4|ip6/HOST/tcp/PORT``; port 0 picks a free one).
    Loopback unless given (:data:`SWARM_LISTEN_ADDRS` reaches other machines)."""
    announce_addrs: tuple[str, ...] = ()
    """Addresses to tell others instead of the bound ones (e.g. a public IP behind NAT)."""
    reuse_port: bool = True
    """Listen with ``SO_REUSEPORT`` and dial non-loopback peers from the listen port, so
    that a NAT maps our outbound connections to the port others must dial and TCP hole
    punching can work. Off: dials leave from ephemeral ports."""
    reachability: str = "auto"
    """``"auto"``: find out with AutoNAT whether others can dial us (when we listen on a
    non-loopback address); ``"public"`` or ``"private"`` to say so instead (a server
    with a forwarded port; a peer that should always go through relays)."""
    relay_service: bool = True
    """Serve as a circuit relay v2 hop for peers behind NAT while we are not private
    (within :mod:`peers.relay.resources`' limits)."""
    relay_limits: RelayResourceConfig | None = None
    """Limits of our relay service (reservations, circuits, bytes and seconds per relayed
    connection); ``None`` for :mod:`peers.relay.resources`' defaults."""
    use_relays: bool = True
    """Once found private, reserve slots on relays and announce ``/p2p-circuit``
    addresses; off: a private peer is reachable only over connections it opens."""
    hole_punching: bool = True
    """Try to turn relayed connections into direct ones (DCUtR: TCP simultaneous open
    from the listen port); on failure the relayed connection stays."""
    dial_timeout: float = 10.0
    """Seconds for TCP connect plus the whole upgrade, per address tried."""
    handshake_timeout: float = limits.HANDSHAKE_TIMEOUT_SECONDS
    """Seconds an inbound connection has to finish its upgrade."""
    stream_negotiation_timeout: float = limits.STREAM_NEGOTIATION_TIMEOUT_SECONDS
    """Seconds a stream has to agree on a protocol."""
    max_connections: int = limits.MAX_CONNECTIONS
    """All connections, both directions."""
    max_connections_per_peer: int = limits.MAX_CONNECTIONS_PER_PEER
    """Connections to one PeerID."""
    max_connections_per_ip: int = limits.MAX_CONNECTIONS_PER_IP
    """Inbound connections (handshaking or established) from one IP address; an IPv6
    /64 counts as one address (see :mod:`peers.admission`)."""
    max_connections_per_subnet: int = limits.MAX_CONNECTIONS_PER_SUBNET
    """Inbound connections from one public IPv4 /24 or IPv6 /48."""
    handshake_rate_per_ip: float = limits.HANDSHAKE_RATE_PER_IP
    """Inbound handshakes per second one IP address (not loopback) may start, once its
    burst is spent; beyond it, connections are closed as soon as they are accepted."""
    handshake_burst_per_ip: int = limits.HANDSHAKE_BURST_PER_IP
    """Inbound handshakes one IP address may start at once after a quiet spell."""
    idle_connection_seconds: float = limits.IDLE_CONNECTION_SECONDS
    """When all ``max_connections`` are taken, an inbound connection may be closed to
    make room for a new one once it has had no stream for this long (the longest idle
    first; never one carrying a relay reservation of ours)."""
    max_streams_per_connection: int = limits.MAX_STREAMS_PER_CONNECTION
    """Concurrent yamux streams on one connection."""
    keepalive_interval: float = limits.KEEPALIVE_INTERVAL_SECONDS
    """A connection that received nothing for this long is pinged, and closed if nothing
    comes back within ``keepalive_timeout``: its path died silently (a NAT mapping
    dropped, a laptop asleep), and the next call dials afresh instead of timing out on
    it. 0 turns the check off."""
    keepalive_timeout: float = limits.KEEPALIVE_TIMEOUT_SECONDS
    """Seconds a pinged connection has to show any sign of life."""
    allowed_peers: frozenset[PeerID] | None = None
    """A private swarm: only these peers may connect to us, and we dial no one else
    (relays included). Checked once Noise has proved the remote's identity, on every
    connection, direct, relayed or hole punched; a stranger's connection is closed
    right after its handshake. ``None``: anyone."""
    swarm_key: bytes | None = field(default=None, repr=False)
    """A private network (libp2p pnet, :mod:`peers.pnet`): a 32-byte key shared by the
    swarm's peers (:func:`peers.pnet.load_swarm_key`). Every connection, direct or
    relayed, is encrypted with it from its first byte, so a peer without it cannot
    complete a handshake with us, nor we with it. ``None``: an open swarm."""
    agent_version: str = "swarmtrain/0.1.0"
    """What identify reports as our agent."""
    noise_ciphers: tuple[str, ...] = tuple(NOISE_CIPHERS)
    """Noise ciphers we accept, in our order of preference when dialing: ``"AESGCM"``
    (ours, ``/swarmtrain/noise-aesgcm/2.0.0``; a fifth of ChaChaPoly's CPU per byte where
    the CPU has AES instructions) and ``"ChaChaPoly"`` (libp2p's ``/noise``, which other
    libp2p implementations speak; faster on CPUs without AES instructions)."""

    def __post_init__(self) -> None:
        for name in (
            "dial_timeout",
            "handshake_timeout",
            "stream_negotiation_timeout",
            "handshake_rate_per_ip",
            "idle_connection_seconds",
            "keepalive_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.keepalive_interval < 0:
            raise ValueError("keepalive_interval must be >= 0 (0: no keepalive)")
        for name in (
            "max_connections",
            "max_connections_per_peer",
            "max_connections_per_ip",
            "max_connections_per_subnet",
            "handshake_burst_per_ip",
            "max_streams_per_connection",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.reachability not in ("auto", "public", "private"):
            raise ValueError(
                f"reachability must be 'auto', 'public' or 'private', got {self.reachability!r}"
            )
        for addr in (*self.listen_addrs, *self.announce_addrs):
            tcp_target(parse_multiaddr(addr))  # AddressError: not a TCP address
        allowed: object = self.allowed_peers
        if allowed is not None and (
            not isinstance(allowed, frozenset) or not all(isinstance(p, PeerID) for p in allowed)
        ):
            raise ValueError("allowed_peers must be None or a frozenset of PeerIDs")
        key: object = self.swarm_key
        if key is not None and (not isinstance(key, bytes) or len(key) != 32):
            raise ValueError("swarm_key must be None or 32 bytes (peers.pnet.load_swarm_key)")
        ciphers: object = self.noise_ciphers
        if (
            not isinstance(ciphers, tuple)
            or not ciphers
            or any(name not in NOISE_CIPHERS for name in ciphers)
            or len(set(ciphers)) != len(ciphers)
        ):
            raise ValueError(
                "noise_ciphers must be a non-empty tuple of distinct names among"
                f" {', '.join(map(repr, NOISE_CIPHERS))}; got {ciphers!r}"
            )


@dataclass(frozen=True, slots=True)
class PeerStatistics:
    num_connections: int
    num_streams: int
    num_inbound_connections_refused: int
    num_handshake_failures: int
    num_not_allowed: int
    """Connections refused (or dials not made) for a peer outside the allow-list."""
    num_idle_closed: int
    """Idle inbound connections closed to make room for new ones."""
    num_streams_refused: int
    num_addresses_refused: int
    """Addresses learned from peers that we will not dial (``peers.dial_filter``)."""
    num_relayed_connections: int = 0
    """Open connections that run through a circuit relay (of ``num_connections``)."""
    traffic: TrafficSnapshot = field(default_factory=TrafficSnapshot)
    """Payload bytes by protocol, and the latencies of this peer's unary calls
    (:mod:`peers.traffic`)."""
