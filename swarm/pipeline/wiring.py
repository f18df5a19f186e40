"""Stochastic wiring: which server of a stage takes the next micro-batch (pure).

SWARM parallelism (Ryabinin et al. 2023, "SWARM Parallelism: Training Large Models Can
Be Surprisingly Communication-Efficient", its "stochastic wiring") sends each
micro-batch to a server of the next stage drawn at random, with odds that follow how
much work each can take, so fast servers get more and a slow or dead one costs little.
Here the odds of a server are ``throughput / (1 + queue)``, the queue counted in
micro-batches of the size being placed (queued samples / ``num_samples``): that is
inversely proportional to the time this micro-batch would take there.

- throughput: this client's own measurement once it has one (samples per second of a
  forward round trip, smoothed); before that, the mean of the stage's measured servers
  (a newcomer gets an even share until measured), or the announced compute throughput
  when nobody is measured yet;
- queue: the samples the server announced queued, plus those we have in flight there;
- a server that fails is banned for ``ban_seconds`` (one that said it is busy, for
  ``busy_seconds``) and not drawn meanwhile, even while the DHT still lists it (its
  entries outlive a dead server by up to the announcement TTL).

One :class:`Wiring` per stage. No clock reads and no I/O
(CONTRIBUTING.md, "Protocols are pure state machines"): every call takes ``now``;
randomness comes from the ``random.Random`` the caller passes.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from peers.identity import PeerID
from swarm.experts.announce import Announcement, ExpertLocation

#: Throughput (samples/s) below which a server still gets this much weight: a server
#: that announced 0 (it has not computed yet) must stay reachable, or it never would be.
MIN_THROUGHPUT = 1e-3


@dataclass(frozen=True, kw_only=True)
class WiringConfig:
    """How a client spreads micro-batches over the servers of a stage."""

    ban_seconds: float = 30.0
    """Seconds a server that failed a call (unreachable, timed out, broke the protocol)
    is passed over. Shorter than a typical announcement TTL would let a dead server
    back in before its DHT entries expire, so it costs a failed call more."""
    busy_seconds: float = 1.0
    """Seconds a server that refused a call as busy (its queue full) is passed over."""
    smoothing: float = 0.3
    """Weight of the newest measurement in a server's smoothed throughput."""

    def __post_init__(self) -> None:
        for name in ("ban_seconds", "busy_seconds"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")


@dataclass(slots=True)
class _Server:
    location: ExpertLocation
    announced_throughput: float
    announced_load: int
    measured: float | None = None
    in_flight: int = 0
    num_calls: int = 0
    num_failures: int = 0


@dataclass(frozen=True, slots=True)
class ServerRecord:
    """One server as a stage's wiring sees it (see :meth:`Wiring.statistics`)."""

    peer_id: PeerID
    throughput: float
    """Samples/s used for its odds (measured, or the prior)."""
    measured: bool
    queued_samples: int
    num_calls: int
    num_failures: int
    banned: bool


class Wiring:
    """The servers of one stage: who is listed, how fast they were, who is banned."""

    def __init__(self, config: WiringConfig | None = None) -> None:
        self.config = config or WiringConfig()
        self._servers: dict[PeerID, _Server] = {}
        self._banned_until: dict[PeerID, float] = {}

    def update(self, announcements: Sequence[Announcement], now: float) -> None:
        """Replace the listing with what the DHT lists now. Servers no longer listed are
        forgotten (their measurements too), new ones added; bans stay until they end."""
        listed: dict[PeerID, _Server] = {}
        for a in announcements:
            peer_id = a.location.peer_id
            server = self._servers.get(peer_id) or listed.get(peer_id)
            if server is None:
                server = _Server(a.location, a.throughput, a.load)
            server.location = a.location
            server.announced_throughput, server.announced_load = a.throughput, a.load
            listed[peer_id] = server
        self._servers = listed
        self._banned_until = {p: t for p, t in self._banned_until.items() if t > now}

    def is_banned(self, peer_id: PeerID, now: float) -> bool:
        return self._banned_until.get(peer_id, -math.inf) > now

    def live(self, now: float) -> list[ExpertLocation]:
        """The listed servers not banned now."""
        return [s.location for p, s in self._servers.items() if not self.is_banned(p, now)]

    @property
    def num_listed(self) -> int:
        return len(self._servers)

    def _throughput(self, server: _Server) -> float:
        if server.measured is not None:
            return server.measured
        measured = [s.measured for s in self._servers.values() if s.measured is not None]
        if measured:
            return sum(measured) / len(measured)
        return max(server.announced_throughput, MIN_THROUGHPUT)

    def weights(
        self, num_samples: int, now: float, exclude: Collection[PeerID] = ()
    ) -> dict[PeerID, float]:
        """Each candidate's odds (unnormalised): listed, not banned, not in ``exclude``."""
        out: dict[PeerID, float] = {}
        for peer_id, server in self._servers.items():
            if peer_id in exclude or self.is_banned(peer_id, now):
                continue
            queue = (server.announced_load + server.in_flight) / max(num_samples, 1)
            out[peer_id] = max(self._throughput(server), MIN_THROUGHPUT) / (1.0 + queue)
        return out

    def choose(
        self,
        num_samples: int,
        now: float,
        rng: random.Random,
        exclude: Collection[PeerID] = (),
    ) -> ExpertLocation | None:
        """A server for a micro-batch of ``num_samples``, drawn with probability
        proportional to its :meth:`weights`; ``None`` if no candidate is left."""
        weights = self.weights(num_samples, now, exclude)
        if not weights:
            return None
        point = rng.random() * sum(weights.values())
        for peer_id, weight in weights.items():
            point -= weight
            if point < 0:
                return self._servers[peer_id].location
        return self._servers[peer_id].location  # rounding left a sliver past the end

    def on_start(self, peer_id: PeerID, num_samples: int) -> None:
        """A call of ``num_samples`` samples went out to ``peer_id``."""
        server = self._servers.get(peer_id)
        if server is not None:
            server.in_flight += num_samples
            server.num_calls += 1

    def on_success(
        self, peer_id: PeerID, num_samples: int, seconds: float | None, now: float
    ) -> None:
        """The call answered; ``seconds`` (its round trip) updates the server's measured
        throughput, ``None`` leaves it (a backward, which costs more than a forward)."""
        server = self._servers.get(peer_id)
        if server is None:
            return
        server.in_flight = max(0, server.in_flight - num_samples)
        if seconds is not None and seconds > 0:
            rate = num_samples / seconds
            if server.measured is None:
                server.measured = rate
            else:
                server.measured += self.config.smoothing * (rate - server.measured)

    def on_failure(self, peer_id: PeerID, num_samples: int, now: float, *, busy: bool) -> None:
        """The call failed: pass the server over for ``ban_seconds`` (``busy_seconds`` if
        it only said it is busy)."""
        server = self._servers.get(peer_id)
        if server is not None:
            server.in_flight = max(0, server.in_flight - num_samples)
            server.num_failures += 1
        seconds = self.config.busy_seconds if busy else self.config.ban_seconds
        self._banned_until[peer_id] = max(self._banned_until.get(peer_id, now), now + seconds)

    def statistics(self, now: float) -> tuple[ServerRecord, ...]:
        return tuple(
            ServerRecord(
                peer_id=peer_id,
                throughput=self._throughput(s),
                measured=s.measured is not None,
                queued_samples=s.announced_load + s.in_flight,
                num_calls=s.num_calls,
                num_failures=s.num_failures,
                banned=self.is_banned(peer_id, now),
            )
            for peer_id, s in self._servers.items()
        )
