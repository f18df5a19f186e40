"""Where peers can be dialed: the address book, and what a wildcard listen address means."""

from __future__ import annotations

import contextlib
import socket
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from multiaddr import Multiaddr

from peers.addresses import tcp_multiaddr, tcp_target
from peers.identity import PeerID

#: Addresses kept per peer: a peer controls what it announces, so only the newest few.
MAX_ADDRESSES_PER_PEER = 16


@dataclass
class AddressBook:
    addrs: dict[PeerID, list[Multiaddr]] = field(default_factory=lambda: defaultdict(list))

    def add(self, peer_id: PeerID, addrs: Iterable[Multiaddr]) -> None:
        known = self.addrs[peer_id]
        for addr in addrs:
            if addr not in known:
                known.append(addr)
        del known[: max(0, len(known) - MAX_ADDRESSES_PER_PEER)]


def expand_wildcard(addr: Multiaddr) -> list[Multiaddr]:
    """A wildcard bind (0.0.0.0, ::) as the concrete addresses others can dial: loopback
    and this host's addresses (as libp2p resolves unspecified listen addresses)."""
    target = tcp_target(addr)
    if target.host not in ("0.0.0.0", "::"):
        return [addr]
    family = socket.AF_INET if target.host == "0.0.0.0" else socket.AF_INET6
    hosts = {"127.0.0.1" if family == socket.AF_INET else "::1"}
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, family):
            hosts.add(str(info[4][0]))
    return [tcp_multiaddr(h, target.port) for h in sorted(hosts)]
