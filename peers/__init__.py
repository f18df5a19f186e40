"""peers: libp2p-compatible networking in-process (identity, Noise, yamux, RPC).

No daemon, no extra binary, no torch. Start with :class:`Peer` (async) or
:class:`BlockingPeer` (for scripts that are not async).
"""

from peers.addresses import Multiaddr, parse_multiaddr, split_peer_id, with_peer_id
from peers.config import PeerConfig, PeerStatistics
from peers.connection import Stream
from peers.errors import (
    AddressError,
    ConnectionClosed,
    DialError,
    HandshakeError,
    IdentityError,
    LimitExceeded,
    LocalProtocolError,
    PeerIDMismatch,
    PeerNotAllowed,
    PeersError,
    ProtocolNotSupported,
    RemoteError,
    RemoteProtocolError,
    StreamReset,
)
from peers.facade import BlockingPeer
from peers.host import Peer
from peers.identify import IdentifyInfo
from peers.identity import KeyPair, KeyType, PeerID, PublicKey
from peers.rpc import CallContext
from peers.runtime import run

__all__ = [
    "AddressError",
    "BlockingPeer",
    "CallContext",
    "ConnectionClosed",
    "DialError",
    "HandshakeError",
    "IdentifyInfo",
    "IdentityError",
    "KeyPair",
    "KeyType",
    "LimitExceeded",
    "LocalProtocolError",
    "Multiaddr",
    "Peer",
    "PeerConfig",
    "PeerID",
    "PeerIDMismatch",
    "PeerNotAllowed",
    "PeerStatistics",
    "PeersError",
    "ProtocolNotSupported",
    "PublicKey",
    "RemoteError",
    "RemoteProtocolError",
    "Stream",
    "StreamReset",
    "parse_multiaddr",
    "run",
    "split_peer_id",
    "with_peer_id",
]
