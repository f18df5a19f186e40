"""Whether others can dial us, decided from what they saw and what they could dial.

A pure record (no I/O, the caller passes ``now``; CONTRIBUTING.md,
"Data structures never start I/O"): identify tells us the address each remote saw our
connection come from (its *observed address*), and AutoNAT v1 dial-backs tell us
whether a remote could open a new connection to an address of ours. From them this
decides which addresses we may announce and whether we are *public* (some remote dialed
us back) or *private* (remotes tried and could not): a private peer announces no direct
address, so the DHT and matchmaking treat it as a client, and it reserves relay slots
instead.

One remote's word moves nothing on its own when others are there to ask: a verdict
needs :data:`CONFIRMATIONS` distinct servers (or every server we know, when fewer are
known), so one hostile AutoNAT server can neither make us announce a wrong address to
the swarm nor push us behind a relay (CONTRIBUTING.md, "A peer is a stranger").
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Collection
from dataclasses import dataclass, field

from multiaddr import Multiaddr

from peers.addresses import is_circuit, tcp_target
from peers.errors import AddressError
from peers.identity import PeerID

#: Distinct AutoNAT servers whose answers settle a verdict. go-libp2p's AutoNAT v1
#: waits for 3 agreeing answers; a volunteer swarm often has only 1-2 public peers at
#: first, so 2 (or all that exist) balances trust against time to a verdict.
CONFIRMATIONS = 2
#: Seconds a dial-back result counts for. Home routers change their external address
#: (DHCP leases, reconnects); an hour-old verdict is re-checked (go re-probes every 15
#: minutes when confident; this is the window an answer stays in the tally).
RESULT_TTL_SECONDS = 30 * 60.0
#: Observed addresses kept: a peer has a handful of real ones; each remote could report
#: a different (false) one, so the table is bounded and keeps the most-reported.
MAX_OBSERVED_ADDRS = 16
#: Remotes remembered per observed address (for the count; more adds nothing).
MAX_OBSERVERS_PER_ADDR = 8


class NatMapping(enum.Enum):
    """How our NAT (if any) maps our listen port, judged from observed addresses."""

    UNKNOWN = "unknown"
    """Fewer than two remotes have told us what they saw."""
    ENDPOINT_INDEPENDENT = "endpoint-independent"
    """Two remotes saw the same address and port: every destination sees one mapping,
    which is what TCP hole punching needs (most home routers)."""
    SYMMETRIC = "symmetric"
    """Every remote saw another port: each destination gets its own mapping, so the
    port the other side of a hole punch would dial is never the one we use."""


class Reachability(enum.Enum):
    UNKNOWN = "unknown"
    """Nobody has tried to dial us back yet (or we only listen on loopback)."""
    PUBLIC = "public"
    """A remote dialed us back: the confirmed addresses reach us."""
    PRIVATE = "private"
    """Remotes tried every address we gave them and none reached us (behind NAT)."""


@dataclass(frozen=True, slots=True)
class ReachabilityStatistics:
    reachability: Reachability
    mapping: NatMapping
    confirmed_addrs: tuple[Multiaddr, ...]
    observed_addrs: tuple[Multiaddr, ...]
    num_dial_backs_ok: int
    num_dial_backs_failed: int


@dataclass(slots=True)
class _Result:
    ok: bool
    addr: Multiaddr | None
    time: float


def is_public_candidate(addr: Multiaddr) -> bool:
    """Whether ``addr`` could reach us from elsewhere: a direct TCP address that is not
    loopback, link-local or unspecified (relayed addresses are announced separately)."""
    if is_circuit(addr):
        return False
    try:
        target = tcp_target(addr)
    except AddressError:
        return False
    if target.is_dns:
        return True
    try:
        ip = ipaddress.ip_address(target.host)
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


@dataclass
class ReachabilityTracker:
    """What we know about our own reachability; fed by identify and AutoNAT."""

    confirmations: int = CONFIRMATIONS
    result_ttl_seconds: float = RESULT_TTL_SECONDS
    _observed: dict[Multiaddr, set[PeerID]] = field(default_factory=dict)
    _results: dict[PeerID, _Result] = field(default_factory=dict)
    _num_ok: int = 0
    _num_failed: int = 0
    _verdict: Reachability = Reachability.UNKNOWN

    # --- inputs ------------------------------------------------------------------

    def observed(self, addr: Multiaddr, observer: PeerID) -> None:
        """``observer`` saw our connection come from ``addr`` (identify's observedAddr)."""
        if not is_public_candidate(addr):
            return
        observers = self._observed.get(addr)
        if observers is None:
            if len(self._observed) >= MAX_OBSERVED_ADDRS:
                weakest = min(self._observed, key=lambda a: len(self._observed[a]))
                if len(self._observed[weakest]) > 1:
                    return  # a table of confirmed sightings outranks one new claim
                del self._observed[weakest]
            observers = self._observed[addr] = set()
        if len(observers) < MAX_OBSERVERS_PER_ADDR:
            observers.add(observer)

    def dial_back(self, server: PeerID, *, ok: bool, addr: Multiaddr | None, now: float) -> None:
        """``server`` tried to dial us back: ``ok`` with the address that reached us, or
        not (it could dial none of the addresses we sent)."""
        self._results[server] = _Result(ok=ok, addr=addr if ok else None, time=now)
        if ok:
            self._num_ok += 1
        else:
            self._num_failed += 1

    # --- verdicts ----------------------------------------------------------------

    def _live(self, now: float) -> list[_Result]:
        cutoff = now - self.result_ttl_seconds
        for server in [s for s, r in self._results.items() if r.time < cutoff]:
            del self._results[server]
        return list(self._results.values())

    def reachability(self, now: float, *, num_servers_known: int | None = None) -> Reachability:
        """The verdict: PUBLIC once a server reached us (and no more servers failed than
        succeeded), PRIVATE once enough distinct servers failed and none succeeded."""
        results = self._live(now)
        num_ok = sum(r.ok for r in results)
        num_failed = len(results) - num_ok
        needed = self.confirmations
        if num_servers_known is not None:
            needed = max(1, min(needed, num_servers_known))
        if num_ok and num_ok >= num_failed:
            self._verdict = Reachability.PUBLIC
        elif num_failed >= needed and num_failed > num_ok:
            self._verdict = Reachability.PRIVATE
        elif not results:
            self._verdict = Reachability.UNKNOWN
        # else: a verdict reached with fewer servers than are known now (one was found
        # since) holds until the new ones answer otherwise; going back to "unknown"
        # would announce addresses nobody can dial for the seconds that takes
        return self._verdict

    def confirmed_addrs(self, now: float) -> list[Multiaddr]:
        """Addresses a server reached us at, most often confirmed first."""
        counts: dict[Multiaddr, int] = {}
        for result in self._live(now):
            if result.ok and result.addr is not None:
                counts[result.addr] = counts.get(result.addr, 0) + 1
        return sorted(counts, key=lambda a: -counts[a])

    def observed_addrs(self) -> list[Multiaddr]:
        """Observed addresses, most observers first (the candidates a dial-back tests and
        the addresses a hole punch tells the other side)."""
        return sorted(self._observed, key=lambda a: -len(self._observed[a]))

    def mapping(self, listen_ports: Collection[int] = ()) -> NatMapping:
        """From observed addresses: the same ``ip:port`` seen by two remotes means one
        mapping for all destinations; two or more remotes that each saw a different
        port on the same IP mean one per destination. With one remote so far, a port
        it saw equal to one of ``listen_ports`` (we dial from the listen port) says the
        router kept our port, as endpoint-independent routers do; a symmetric one that
        randomises ports would keep it once in tens of thousands."""
        if any(len(observers) >= 2 for observers in self._observed.values()):
            return NatMapping.ENDPOINT_INDEPENDENT
        by_ip: dict[str, set[PeerID]] = {}
        for addr, observers in self._observed.items():
            by_ip.setdefault(tcp_target(addr).host, set()).update(observers)
        if any(len(observers) >= 2 for observers in by_ip.values()):
            return NatMapping.SYMMETRIC
        if any(tcp_target(addr).port in listen_ports for addr in self._observed):
            return NatMapping.ENDPOINT_INDEPENDENT
        return NatMapping.UNKNOWN

    def num_servers_asked(self, now: float) -> int:
        return len(self._live(now))

    def has_answer_from(self, server: PeerID, now: float) -> bool:
        result = self._results.get(server)
        return result is not None and result.time >= now - self.result_ttl_seconds

    def statistics(self, now: float) -> ReachabilityStatistics:
        return ReachabilityStatistics(
            reachability=self.reachability(now),
            mapping=self.mapping(),
            confirmed_addrs=tuple(self.confirmed_addrs(now)),
            observed_addrs=tuple(self.observed_addrs()),
            num_dial_backs_ok=self._num_ok,
            num_dial_backs_failed=self._num_failed,
        )
