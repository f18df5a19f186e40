"""A Kademlia DHT over ``peers``: node ids derived from PeerIDs, signed records,
per-source quotas, client mode. Start with :class:`DHT` (async) or
:class:`BlockingDHT` (for scripts that are not async)."""

from peers.dht.facade import BlockingDHT
from peers.dht.ids import Contact, key_id, node_id_of
from peers.dht.node import DHT, DHTConfig, DHTError, DHTStatistics, ValueWithExpiration, dht_time
from peers.dht.records import Record, RecordError, owner_marker, owner_of

__all__ = [
    "DHT",
    "BlockingDHT",
    "Contact",
    "DHTConfig",
    "DHTError",
    "DHTStatistics",
    "Record",
    "RecordError",
    "ValueWithExpiration",
    "dht_time",
    "key_id",
    "node_id_of",
    "owner_marker",
    "owner_of",
]
