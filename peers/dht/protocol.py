"""DHT wire messages: typed, versioned by protocol id, validated at the edge.

Kademlia's four RPCs (§2.3) as four protocol ids. No message carries a node id: the
callee derives the caller's node id from the PeerID its connection authenticated, and
the ids of contacts it hears about from their PeerIDs (which a dial then authenticates),
so no peer can choose or fake its place in the id space.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peers.dht.ids import Contact
from peers.dht.records import Record
from peers.errors import IdentityError
from peers.identity import PeerID
from peers.wire import WireError

PING_PROTOCOL = "/swarmtrain/dht/ping/1.0.0"
FIND_NODE_PROTOCOL = "/swarmtrain/dht/find-node/1.0.0"
FIND_VALUE_PROTOCOL = "/swarmtrain/dht/find-value/1.0.0"
STORE_PROTOCOL = "/swarmtrain/dht/store/1.0.0"

#: Addresses we keep per contact: a peer has a handful (IPv4, IPv6, a relay or two).
MAX_CONTACT_ADDRS = 8
#: Length of one address string; real multiaddrs are well under 200 characters.
MAX_ADDR_CHARS = 256
#: Contacts one response may carry (k of them is the protocol; more is the remote's fault).
MAX_CONTACTS_PER_RESPONSE = 32
#: Records one store request or one find-value response may carry: one key's subkeys
#: (announcements of many peers under one key) or a batch of stores.
MAX_RECORDS_PER_MESSAGE = 1024
#: Bytes of records one find-value reply carries (it always carries one, if any is
#: left): a key holding more is read in pages. A whole key may hold 1024 values of 8 KiB;
#: replying with all of it to a 100-byte request was an 80,000x amplification, and a
#: caller withholding its window kept 8 MiB per stream waiting in our memory.
MAX_REPLY_RECORD_BYTES = 256 * 1024
#: Pages one read of a key may take from one peer: 8 MiB of records at the page size.
MAX_FIND_VALUE_PAGES = 32
#: Largest frame of any DHT message, either way. Every DHT message is small by design:
#: a find-value reply holds at most MAX_REPLY_RECORD_BYTES of records plus one (8.5 KiB)
#: and 32 contacts (64 KiB at most), a store request at most MAX_STORE_REQUEST_BYTES of
#: records. The RPC layer's 16 MiB frame is for tensors; here it would let any peer make
#: us buffer and decode 16 MiB (of empty containers, if it likes) per DHT stream.
MAX_DHT_FRAME_BYTES = 1 << 20
#: msgpack items (containers and their elements) one DHT frame may hold. A store of
#: 1024 records is about 6,200 (a record is a 5-field array), a reply of 32 contacts with
#: 8 addresses each about 350: 16,384 leaves room. The RPC layer's 262,144 would let one
#: 1 MiB frame of empty lists become some 17 MB of Python objects; this bound, 1 MB.
MAX_DHT_VALUE_ITEMS = 1 << 14
#: Bytes of records (as storage counts them) one store request carries; a larger batch
#: goes in several requests, so a request stays well inside MAX_DHT_FRAME_BYTES.
MAX_STORE_REQUEST_BYTES = 512 * 1024


@dataclass(frozen=True)
class SenderInfo:
    """Who is calling: the addresses it can be dialed at, and whether it serves at all."""

    addrs: list[str] = field(default_factory=list)
    client_mode: bool = False


@dataclass(frozen=True)
class WireContact:
    peer_id: bytes
    addrs: list[str]


@dataclass(frozen=True)
class WireRecord:
    key: bytes
    subkey: bytes | None
    value: bytes
    expiration_time: float
    signature: bytes = b""


@dataclass(frozen=True)
class PingRequest:
    sender: SenderInfo


@dataclass(frozen=True)
class PingResponse:
    pass


@dataclass(frozen=True)
class FindNodeRequest:
    sender: SenderInfo
    target: bytes  # 32 bytes: a node id or key id


@dataclass(frozen=True)
class FindNodeResponse:
    contacts: list[WireContact]


@dataclass(frozen=True)
class FindValueRequest:
    sender: SenderInfo
    key: bytes
    after: bytes | None = None
    """A later page: the records whose subkey sorts after this one (``None``: the
    first page, the plain value first). Older peers ignore it and send everything."""


@dataclass(frozen=True)
class FindValueResponse:
    records: list[WireRecord]
    contacts: list[WireContact]
    more: bool = False
    """Records are left after these (ask again ``after`` the last one's subkey)."""


def record_wire_bytes(record: Record) -> int:
    """About what ``record`` takes in a reply (its fields and their framing)."""
    return (
        len(record.key) + len(record.subkey or b"") + len(record.value) + len(record.signature) + 32
    )


@dataclass(frozen=True)
class StoreRequest:
    sender: SenderInfo
    records: list[WireRecord]


@dataclass(frozen=True)
class StoreResponse:
    accepted: list[bool]


# --- conversions at the edge ----------------------------------------------------------


def contact_to_wire(contact: Contact) -> WireContact:
    return WireContact(contact.peer_id.to_bytes(), list(contact.addrs))


def contacts_from_wire(wire: list[WireContact]) -> list[Contact]:
    """Decode contacts, bounded; raises :class:`WireError` on a malformed PeerID.

    Addresses are kept as strings (bounded in count and length) and parsed only when
    dialed, so one bad address costs only itself.
    """
    if len(wire) > MAX_CONTACTS_PER_RESPONSE:
        raise WireError(
            f"{len(wire)} contacts in one response, at most {MAX_CONTACTS_PER_RESPONSE}"
        )
    out = []
    for item in wire:
        try:
            peer_id = PeerID(item.peer_id)
        except IdentityError as e:
            raise WireError(f"malformed PeerID in a contact: {e}") from e
        addrs = tuple(a for a in item.addrs[:MAX_CONTACT_ADDRS] if len(a) <= MAX_ADDR_CHARS)
        out.append(Contact(peer_id, addrs))
    return out


def record_to_wire(record: Record) -> WireRecord:
    return WireRecord(
        record.key, record.subkey, record.value, record.expiration_time, record.signature
    )


def record_from_wire(wire: WireRecord) -> Record:
    return Record(
        key=wire.key,
        subkey=wire.subkey,
        value=wire.value,
        expiration_time=wire.expiration_time,
        signature=wire.signature,
    )


def sender_addrs(sender: SenderInfo) -> tuple[str, ...]:
    return tuple(a for a in sender.addrs[:MAX_CONTACT_ADDRS] if len(a) <= MAX_ADDR_CHARS)
