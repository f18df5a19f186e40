"""An AutoNAT v1 server's decisions, pure: which addresses it may dial back, whether a
DIAL is acceptable, and how often it serves one.

autonat-v1.md, "AutoNAT Protocol": "implementations MUST NOT dial any multiaddress
unless it is based on the IP address the requesting node is observed as", and so "MUST
NOT accept dial requests via relayed connections". Otherwise an AutoNAT server is a
free amplifier: many peers claiming one victim's address make every server dial it
(RFC 3489 section 12.1.1).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from multiaddr import Multiaddr

from peers.addresses import is_circuit
from peers.autonat.messages import AutoNATProtocolError, Dial
from peers.binary_multiaddr import (
    IPAddress,
    components,
    ip_of,
    normalize_ip,
    parse_binary_multiaddr,
)
from peers.identity import PeerID

#: Addresses dialed back for one request: go-libp2p's ``maxPeerAddresses`` default (16).
#: A peer has a handful of transports per IP; each dial costs the server a socket and up
#: to its dial timeout.
MAX_DIAL_BACK_ADDRS = 16

#: DIALs served per requesting peer per window: go-libp2p's ``throttlePeerMax`` (3).
#: A client asks one server once per check (go re-checks every 15 minutes, retrying
#: after 90 s); more is a peer using the server as a port scanner.
MAX_DIALS_PER_PEER = 3

#: DIALs served in all per window: go-libp2p's ``throttleGlobalMax`` (30). go waits
#: out the whole 15 s dial timeout on a failed dial (so the answer's timing reveals
#: nothing), so this allows about 30 * 15 / 60 = 8 dial-backs in flight on average.
MAX_DIALS_GLOBAL = 30

#: Seconds of the rate window: go-libp2p's ``throttleResetPeriod`` (1 minute).
DIAL_WINDOW_SECONDS = 60.0


def check_dial_request(dial: Dial, remote: PeerID) -> None:
    """Refuse a DIAL that names a peer other than the connection's: go-libp2p answers
    that ``E_BAD_REQUEST`` ("peer id mismatch"). Raises :class:`AutoNATProtocolError`."""
    if dial.peer_id is not None and dial.peer_id != remote:
        raise AutoNATProtocolError(f"DIAL names peer {dial.peer_id}, the connection is {remote}")


def _dialable_parts(addr: Multiaddr) -> list[tuple[str, bytes]] | None:
    parts = components(addr)
    if parts and parts[-1][0] == "p2p":
        parts = parts[:-1]
    if not parts or any(name == "p2p" for name, _ in parts):
        return None  # an inner /p2p names another peer: never ours to dial
    return parts


def dial_back_addresses(
    requested_addrs: Iterable[Multiaddr | bytes],
    observed_ip: str | IPAddress,
    *,
    substitute_observed_ip: bool = False,
    max_addrs: int = MAX_DIAL_BACK_ADDRS,
) -> list[Multiaddr]:
    """The requested addresses a server may dial back, in request order, deduplicated,
    at most ``max_addrs``.

    An address is kept only if it starts with ``/ip4`` or ``/ip6`` equal to
    ``observed_ip`` (the IP the request's connection came from; IPv4-mapped IPv6 counts
    as the IPv4 address). Dropped: unparsable bytes, relayed (``/p2p-circuit``)
    addresses, DNS names (what they resolve to is not checkable here), and addresses
    with an inner ``/p2p``; a trailing ``/p2p/<id>`` is stripped, because the dial-back
    dials the requester's PeerID, never one an address names.

    With ``substitute_observed_ip``, an address on another IP is dialed on the observed
    IP instead (its ports and transports kept), as go-libp2p's server does, so a peer
    that knows only its private addresses is still tested on their ports. Raises
    ``ValueError`` if ``observed_ip`` is not an IP address.
    """
    observed = normalize_ip(observed_ip)
    observed_family = f"ip{observed.version}"
    observed_part = Multiaddr(f"/{observed_family}/{observed}").to_bytes()
    kept: list[Multiaddr] = []
    seen: set[bytes] = set()
    for requested in requested_addrs:
        addr = parse_binary_multiaddr(requested) if isinstance(requested, bytes) else requested
        if addr is None or is_circuit(addr):
            continue
        parts = _dialable_parts(addr)
        ip = None if parts is None else ip_of(addr)
        if parts is None or ip is None:
            continue
        if ip != observed:
            if not substitute_observed_ip:
                continue
            parts[0] = (observed_family, observed_part)
        key = b"".join(part for _, part in parts)
        if key in seen:
            continue
        seen.add(key)
        kept.append(Multiaddr(key))
        if len(kept) >= max_addrs:
            break
    return kept


class DialRateLimiter:
    """Admits DIAL requests: at most ``max_per_peer`` per peer and ``max_global`` in all
    within any ``window_seconds``. Pure: ``now`` is passed in (monotonic seconds).

    It remembers only admitted requests, so its memory is at most ``max_global``
    entries whatever peers do.
    """

    def __init__(
        self,
        *,
        max_per_peer: int = MAX_DIALS_PER_PEER,
        max_global: int = MAX_DIALS_GLOBAL,
        window_seconds: float = DIAL_WINDOW_SECONDS,
    ) -> None:
        if max_per_peer < 1 or max_global < 1 or window_seconds <= 0:
            raise ValueError("rate limits and the window must be positive")
        self.max_per_peer = max_per_peer
        self.max_global = max_global
        self.window_seconds = window_seconds
        self._admitted: deque[tuple[float, PeerID]] = deque()
        self._per_peer: Counter[PeerID] = Counter()
        self.num_refused = 0

    def _forget_before(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._admitted and self._admitted[0][0] <= horizon:
            _, peer = self._admitted.popleft()
            self._per_peer[peer] -= 1
            if self._per_peer[peer] <= 0:
                del self._per_peer[peer]

    def allow(self, peer: PeerID, now: float) -> bool:
        """Admit (and count) a request from ``peer`` at ``now``, or refuse it; a refused
        request is answered ``E_DIAL_REFUSED`` and does not count."""
        self._forget_before(now)
        if len(self._admitted) >= self.max_global or self._per_peer[peer] >= self.max_per_peer:
            self.num_refused += 1
            return False
        self._admitted.append((now, peer))
        self._per_peer[peer] += 1
        return True

    @property
    def num_in_window(self) -> int:
        """Requests admitted in the current window (as of the last call)."""
        return len(self._admitted)
