"""How a long-running peer of a swarm listens, joins and is known: what ``swarm
bootstrap``, ``swarm serve``, ``swarm serve-stage`` and ``swarm train`` share (their
``--listen``, ``--initial-peers``, ``--identity``, ... flags are made from these fields;
docs/cli.md). :class:`swarm.trainer.TrainerConfig` extends it. Imports no torch: a
bootstrap machine may not have it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peers.config import SWARM_LISTEN_ADDRS, PeerConfig
from peers.identity import KeyPair, PeerID
from peers.pnet import SwarmKeyError, load_swarm_key
from swarm.errors import SwarmError
from swarm.status import STATUS_INTERVAL_SECONDS, check_status_interval


class ConfigError(SwarmError, ValueError):
    """A config holds a value it cannot work with (named in the message)."""


@dataclass(frozen=True, kw_only=True)
class JoinConfig:
    """How this peer listens, joins the swarm and is known to it."""

    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of peers already in the swarm (any one that answers suffices); empty:
    this peer starts the swarm."""
    listen: tuple[str, ...] = SWARM_LISTEN_ADDRS
    """Where this peer listens: every interface unless given, so that peers on other
    machines reach it and hole punching can start (``peers.config.SWARM_LISTEN_ADDRS``).
    Empty: client mode, it dials out only."""
    announce: tuple[str, ...] = ()
    """Addresses to announce instead of the bound ones (a port-forwarded machine)."""
    reachability: str = "auto"
    """Whether others can dial this peer: ``auto`` finds out with AutoNAT, ``public`` and
    ``private`` say so (``peers.PeerConfig.reachability``)."""
    relay: bool = True
    """Serve as a circuit relay for peers behind NAT while public, and use relays while
    private."""
    identity: Path | None = None
    """Key file of this peer's PeerID, created if missing (without one, a new PeerID
    each run)."""
    allowed_peers: frozenset[PeerID] | None = None
    """A private swarm: talk only to these peers (``PeerConfig.allowed_peers``; this
    peer's own id is always allowed). For others to list this peer it needs an
    ``identity``. None: anyone."""
    swarm_key: Path | None = None
    """Key file of a private network: every connection is encrypted with it, so peers
    without it cannot connect (``swarm swarm-key PATH`` makes one). Read when the config
    is made (``PeerConfig.swarm_key``, :mod:`peers.pnet`). None: an open swarm."""
    status_interval: float = STATUS_INTERVAL_SECONDS
    """Seconds between this peer's signed status records, what ``swarm status`` and
    ``swarm dashboard`` show (at least
    :data:`~peers.dht.status.MIN_STATUS_INTERVAL_SECONDS` s; :mod:`swarm.status`)."""

    def __post_init__(self) -> None:
        try:
            check_status_interval(self.status_interval)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if self.reachability not in ("auto", "public", "private"):
            raise ConfigError(
                f"reachability must be auto, public or private, not {self.reachability!r}"
            )
        if self.swarm_key is not None:
            try:
                load_swarm_key(self.swarm_key)
            except SwarmKeyError as e:
                raise ConfigError(str(e)) from e

    def peer_config(self) -> PeerConfig:
        """The peer these fields describe (its identity file created if missing)."""
        return PeerConfig(
            identity=KeyPair.load_or_create(self.identity) if self.identity else None,
            allowed_peers=self.allowed_peers,
            swarm_key=load_swarm_key(self.swarm_key) if self.swarm_key else None,
            listen_addrs=self.listen,
            announce_addrs=self.announce,
            reachability=self.reachability,
            relay_service=self.relay,
            use_relays=self.relay,
        )
