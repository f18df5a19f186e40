"""Kademlia identifiers and contacts (Maymounkov & Mazières 2002, "Kademlia", §2.1).

A node id is the sha256 of the peer's PeerID bytes, so a peer cannot choose where it
sits in the id space (the paper draws ids at random; deriving them from the identity
keeps that randomness and makes it verifiable). Record keys are hashed into the same
256-bit space, and closeness is the XOR metric of §2.1.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import TypeAlias

from peers.identity import PeerID

#: Width of node ids and key ids: the output of sha256 (the paper uses 160-bit SHA-1;
#: nothing in §2 depends on the width).
ID_BITS = 256

#: A point of the id space: an int in ``[0, 2**ID_BITS)``.
NodeID: TypeAlias = int


def _sha256_id(data: bytes) -> NodeID:
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


#: Node ids remembered: every contact a DHT reply carries is hashed on arrival, and a
#: busy node hears of the same few thousand peers over and over.
NODE_ID_CACHE_SIZE = 1 << 14


@functools.lru_cache(maxsize=NODE_ID_CACHE_SIZE)
def node_id_of(peer_id: PeerID) -> NodeID:
    """The node id of ``peer_id``: sha256 of its multihash bytes, derived, never chosen."""
    return _sha256_id(peer_id.to_bytes())


def key_id(key: bytes) -> NodeID:
    """The id of a record key, in the same space as node ids."""
    return _sha256_id(key)


def distance(a: NodeID, b: NodeID) -> int:
    """The XOR metric of §2.1: symmetric, zero only for ``a == b``, unidirectional."""
    return a ^ b


@dataclass(frozen=True, slots=True)
class Contact:
    """A peer we can reach: its PeerID and the addresses it was last seen at.

    Equality and hashing go by ``peer_id`` only, so a contact with fresher addresses is
    the same contact. ``node_id`` is derived from ``peer_id`` once, on construction.
    """

    peer_id: PeerID
    addrs: tuple[str, ...] = field(default=(), compare=False)
    node_id: NodeID = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Frozen dataclass: derived fields are set once, here, through object.__setattr__.
        object.__setattr__(self, "addrs", tuple(self.addrs))
        object.__setattr__(self, "node_id", node_id_of(self.peer_id))
