"""The configuration of a DHT node, and the values and statistics it hands out."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from peers.addresses import parse_multiaddr, split_peer_id
from peers.dht.lookup import ALPHA, DISJOINT_PATHS
from peers.dht.routing import K

#: Replicas a value is stored at (the paper stores at k; a handful survive churn: with
#: 30% of peers gone at once, all of 8 replicas are lost with probability 0.3^8 < 1e-4,
#: and republishing restores the count).
NUM_REPLICAS = 8


def dht_time() -> float:
    """Record expirations are absolute wall-clock times, shared by every peer."""
    return time.time()


@dataclass(frozen=True, kw_only=True)
class DHTConfig:
    """How a :class:`DHT` node joins the swarm and keeps itself and its records alive."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs (with /p2p/ID) of peers to join through; any one that answers suffices."""
    client_mode: bool | None = None
    """Never enter others' routing tables (for peers that cannot accept connections).
    ``None``: automatic, client mode exactly when the peer has no listen address."""
    k: int = K
    """Kademlia's k: bucket size and how many closest nodes a lookup converges on."""
    alpha: int = ALPHA
    """Kademlia's alpha: queries in flight during a lookup (on each of its paths)."""
    disjoint_paths: int = DISJOINT_PATHS
    """Lookups follow this many paths that share no node (S/Kademlia), and a store goes
    to each path's own nearest nodes: a hostile node met on one path misleads that path
    only, and ids ground near a key on many networks no longer take all its replicas.
    Costs about a lookup and ``num_replicas`` stores per path. 1 (the default):
    Kademlia's single lookup; 3 for a swarm that expects attackers on many networks."""
    num_replicas: int = NUM_REPLICAS
    """Closest nodes a record is stored at."""
    rpc_timeout: float = 3.0
    """Seconds one DHT request may take before its peer counts as failed."""
    bootstrap_timeout: float = 10.0
    """Seconds to reach the initial peers."""
    refresh_interval: float = 600.0
    """Seconds after which a bucket no lookup touched is refreshed (paper: an hour)."""
    republish_interval: float = 1200.0
    """Seconds between re-stores of the records this node published."""
    maintenance_interval: float = 15.0
    """Seconds between maintenance passes (refresh, republish, re-bootstrap, purge)."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.alpha < 1 or self.num_replicas < 1 or self.disjoint_paths < 1:
            raise ValueError("k, alpha, num_replicas and disjoint_paths must be at least 1")
        for name in (
            "rpc_timeout",
            "bootstrap_timeout",
            "refresh_interval",
            "republish_interval",
            "maintenance_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for addr in self.initial_peers:
            if split_peer_id(parse_multiaddr(addr))[1] is None:
                raise ValueError(f"initial peer {addr} lacks its /p2p/ID part")


@dataclass(frozen=True, slots=True)
class ValueWithExpiration:
    value: Any
    expiration_time: float


@dataclass(frozen=True, slots=True)
class DHTStatistics:
    num_contacts: int
    num_records: int
    client_mode: bool
    rpcs_served: dict[str, int]
    rpcs_sent: dict[str, int]
    rpcs_failed: dict[str, int]
    num_stores_refused_far: int = 0
    """Records refused because at least k nodes we know are closer to their key."""
    num_contacts_refused_by_source: int = 0
    """Contacts not added because their network already holds its share of the table."""
