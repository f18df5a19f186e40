"""Where peers can be dialed: the address book, and what a wildcard listen address means."""

from __future__ import annotations

import contextlib
import socket
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
from multiaddr import Multiaddr

from peers.addresses import tcp_multiaddr, tcp_target
from peers.identity import PeerID

#: Addresses kept per peer: a peer controls what it announces, so only the newest few.
MAX_ADDRESSES_PER_PEER = 16
#: Peers whose addresses we keep (those learned from others; the ones the user gave are
#: kept apart). A DHT routing table holds a few hundred peers and a round a few dozen;
#: past this, peers named to us in passing (a flood of made-up contacts) evict the ones
#: we heard of least recently, and memory stays bounded.
MAX_PEERS = 4096


@dataclass
class AddressBook:
    """Where peers can be dialed, newest addresses last. Addresses the user gave
    (``pin=True``) are kept whatever peers tell us; learned ones make room for newer
    ones, per peer and in all."""

    max_peers: int = MAX_PEERS
    addrs: OrderedDict[PeerID, list[Multiaddr]] = field(default_factory=OrderedDict)
    pinned: dict[PeerID, list[Multiaddr]] = field(default_factory=dict)

    def add(self, peer_id: PeerID, addrs: Iterable[Multiaddr], *, pin: bool = False) -> None:
        book = self.pinned if pin else self.addrs
        known = book.setdefault(peer_id, [])
        for addr in addrs:
            if addr not in known:
                known.append(addr)
        del known[: max(0, len(known) - MAX_ADDRESSES_PER_PEER)]
        if not known:
            del book[peer_id]
        elif not pin:
            self.addrs.move_to_end(peer_id)
            while len(self.addrs) > self.max_peers:
                self.addrs.popitem(last=False)

    def get(self, peer_id: PeerID) -> list[Multiaddr]:
        """Every address we know for ``peer_id``: the user's first."""
        pinned = self.pinned.get(peer_id, [])
        return [*pinned, *(a for a in self.addrs.get(peer_id, ()) if a not in pinned)]

    def remove(self, peer_id: PeerID, addr: Multiaddr) -> None:
        """Forget ``addr`` for ``peer_id`` (it leads to someone else)."""
        for book in (self.pinned, self.addrs):
            known = book.get(peer_id)
            if known is not None and addr in known:
                known.remove(addr)
                if not known:
                    del book[peer_id]

    def __len__(self) -> int:
        return len(self.addrs.keys() | self.pinned.keys())


def expand_wildcard(addr: Multiaddr) -> list[Multiaddr]:
    """A wildcard bind (0.0.0.0, ::) as the concrete addresses others can dial: loopback
    and the addresses of this host's interfaces (as libp2p resolves unspecified listen
    addresses). The interfaces are asked, not the host name: a name that resolves to
    127.0.1.1 (Debian's default) or to another network's address (a container's, seen
    from inside a network namespace) would name nothing others can reach."""
    target = tcp_target(addr)
    if target.host not in ("0.0.0.0", "::"):
        return [addr]
    family = socket.AF_INET if target.host == "0.0.0.0" else socket.AF_INET6
    hosts = {"127.0.0.1" if family == socket.AF_INET else "::1"}
    hosts.update(_interface_addresses(family))
    return [tcp_multiaddr(h, target.port) for h in sorted(hosts)]


def _interface_addresses(family: socket.AddressFamily) -> set[str]:
    found: set[str] = set()
    with contextlib.suppress(OSError):
        for entries in psutil.net_if_addrs().values():
            for entry in entries:
                if entry.family == family and "%" not in entry.address:  # no link-local scope
                    found.add(entry.address)
    return found
