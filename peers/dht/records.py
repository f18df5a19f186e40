"""DHT records: a value under ``(key, subkey)`` with an expiration time, signed when owned.

Policies (docs/design/dht.md, "Records"):

- *Expiration is capped by rejection, not clamping.* A record expiring later than
  ``now + MAX_TTL_SECONDS + MAX_CLOCK_SKEW_SECONDS`` is refused. Clamping would change a
  signed record into one its owner never signed (so we could not hand it on), or keep a
  private expiry that differs from node to node (so replicas would disagree on which of
  two records is newer). Refusal is the same on every honest node, and the sender learns
  at once. An unsigned key can thus be held against later writers for at most one TTL.
- *Ownership.* A key or subkey names an owner when it contains ``[owner:<base58 PeerID>]``
  (:func:`owner_marker`). Every record under a named owner must carry that owner's Ed25519
  signature of :meth:`Record.signing_payload`. If key and subkey name different owners,
  or a marker does not hold an Ed25519 PeerID with an inline key, the record is invalid.
  Unowned keys stay open: a signature on them is ignored and dropped.
- *Values are opaque here.* ``value`` is the already serialized value
  (:func:`peers.serialization.pack`); it is decoded by its reader, at the edge, never by
  the store (decoding could import torch, which ``peers`` must not).

Which of two valid records under one ``(key, subkey)`` wins (the later expiration) is
the store's rule: see :mod:`peers.dht.storage`.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, replace

import msgpack

from peers.dht.status import MAX_STATUS_BYTES, STATUS_KEY, StatusError, parse_status
from peers.errors import IdentityError, RemoteProtocolError
from peers.identity import KeyPair, KeyType, PeerID, PublicKey

#: Largest serialized value. DHT values are announcements (a PeerID, a few multiaddrs,
#: some numbers: well under 1 KiB); bulk data goes through state sync, not the DHT. 8 KiB
#: leaves room, and keeps a full key (MAX_SUBKEYS_PER_KEY of them, ~8.5 MiB) inside one
#: RPC frame (peers.serialization.MAX_FRAME_BYTES = 16 MiB), as a test checks.
MAX_VALUE_BYTES = 8 * 1024
#: Longest key. Room for a name plus an owner marker (a 52-character Ed25519 PeerID and 8
#: bytes of brackets), several times over; keys are names, not payloads.
MAX_KEY_BYTES = 256
#: Longest subkey; the same reasoning as MAX_KEY_BYTES.
MAX_SUBKEY_BYTES = 256
#: Most subkeys one key holds (the plain value under subkey None is not counted): how many
#: peers can announce under one key. A thousand covers the swarms we target (hundreds of
#: peers) and bounds one reply to ~8.5 MiB (see MAX_VALUE_BYTES).
MAX_SUBKEYS_PER_KEY = 1024
#: Longest record lifetime. Announcements live seconds to minutes; long-lived publishers
#: (a bootstrap operator) republish, as Kademlia's original publisher does every hour
#: (Maymounkov & Mazieres 2002, section 2.5). One hour is also the longest an unsigned key
#: can be held by one store against honest writers, so shorter is safer.
MAX_TTL_SECONDS = 3600.0
#: How far a sender's clock may run ahead of ours before its maximal-TTL records are
#: refused. Synchronised clocks agree within a second; a laptop may be a few minutes off.
MAX_CLOCK_SKEW_SECONDS = 300.0
#: An Ed25519 signature is 64 bytes; anything longer is garbage we need not store.
MAX_SIGNATURE_BYTES = 64

_OWNER_MARKER = re.compile(rb"\[owner:([^\]]*)\]")
#: Domain separation: a record signature can never be mistaken for another signed message.
_SIGNING_DOMAIN = b"swarmtrain-dht-record"


class RecordErrorReason(enum.Enum):
    MALFORMED = "malformed"
    TOO_LARGE = "too large"
    EXPIRED = "expired"
    TOO_FAR_IN_FUTURE = "expires too far in the future"
    BAD_OWNER = "names an invalid owner"
    MISSING_SIGNATURE = "is not signed by its owner"
    BAD_SIGNATURE = "has a bad signature"


class RecordError(RemoteProtocolError):
    """A record breaks the rules; the fault of whoever made it (usually the remote)."""

    def __init__(self, reason: RecordErrorReason, detail: str) -> None:
        super().__init__(f"DHT record {reason.value}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Record:
    """A value under ``key`` (and ``subkey``, None for a plain value) until ``expiration_time``.

    ``value`` is the serialized value; ``expiration_time`` is absolute (seconds, the same
    clock as every ``now``); ``signature`` is the owner's, or empty for an unowned key.
    """

    key: bytes
    subkey: bytes | None
    value: bytes
    expiration_time: float
    signature: bytes = b""

    def signing_payload(self) -> bytes:
        """The canonical bytes an owner signs (the expiration always as a msgpack float64)."""
        fields = [_SIGNING_DOMAIN, self.key, self.subkey, self.value, float(self.expiration_time)]
        payload: bytes = msgpack.packb(fields, use_bin_type=True)
        return payload

    def sign(self, identity: KeyPair) -> Record:
        """A copy signed by ``identity`` (which should be the owner the key names)."""
        return replace(self, signature=identity.sign(self.signing_payload()))


def owner_marker(peer_id: PeerID) -> bytes:
    """The text that makes a key or subkey owned by ``peer_id``."""
    return b"[owner:" + peer_id.to_base58().encode("ascii") + b"]"


def _owner_key(key: bytes, subkey: bytes | None) -> tuple[PeerID, PublicKey] | None:
    owners: set[PeerID] = set()
    for text in (key, subkey or b""):
        for match in _OWNER_MARKER.finditer(text):
            try:
                owners.add(PeerID.from_base58(match.group(1).decode("ascii")))
            except (IdentityError, UnicodeDecodeError) as e:
                raise RecordError(
                    RecordErrorReason.BAD_OWNER, f"{match.group(0)!r} does not hold a PeerID"
                ) from e
    if not owners:
        return None
    if len(owners) > 1:
        names = ", ".join(sorted(str(o) for o in owners))
        raise RecordError(RecordErrorReason.BAD_OWNER, f"key and subkey name owners {names}")
    (owner,) = owners
    try:
        public_key = owner.inline_public_key()
    except IdentityError as e:
        raise RecordError(RecordErrorReason.BAD_OWNER, f"owner {owner}: {e}") from e
    if public_key is None or public_key.key_type is not KeyType.ED25519:
        raise RecordError(
            RecordErrorReason.BAD_OWNER, f"owner {owner} does not carry an Ed25519 key to verify"
        )
    return owner, public_key


def owner_of(key: bytes, subkey: bytes | None) -> PeerID | None:
    """The owner that key or subkey names, or None if unowned.

    Raises :class:`RecordError` (BAD_OWNER) if they name two owners, a marker holds no
    PeerID, or the owner's PeerID does not inline an Ed25519 key (so nobody could verify).
    """
    found = _owner_key(key, subkey)
    return None if found is None else found[0]


def _size_check(name: str, data: bytes, limit: int) -> None:
    if len(data) > limit:
        raise RecordError(
            RecordErrorReason.TOO_LARGE, f"{name} has {len(data)} bytes, the limit is {limit}"
        )


def _check_status(record: Record, now: float) -> None:
    """A status record (:mod:`peers.dht.status`) is owned, parses, and is not from the
    future: every replica checks the schema, so readers never see a broken one."""
    if record.subkey is None or _OWNER_MARKER.search(record.subkey) is None:
        raise RecordError(RecordErrorReason.MALFORMED, "a status record needs its owner's subkey")
    if len(record.value) > MAX_STATUS_BYTES:
        raise RecordError(
            RecordErrorReason.TOO_LARGE,
            f"status record has {len(record.value)} bytes, the limit is {MAX_STATUS_BYTES}",
        )
    try:
        status = parse_status(record.value)
    except StatusError as e:
        raise RecordError(RecordErrorReason.MALFORMED, f"status record: {e}") from e
    if status.time > now + MAX_CLOCK_SKEW_SECONDS:
        raise RecordError(
            RecordErrorReason.TOO_FAR_IN_FUTURE, f"status record dated {status.time}, now is {now}"
        )


def validate(record: Record, now: float) -> Record:
    """Check ``record`` against every rule at time ``now``; return it normalised.

    The result has a float expiration and, for an unowned key, no signature. Raises
    :class:`RecordError` saying which rule was broken.
    """
    if not (
        isinstance(record.key, bytes)
        and (record.subkey is None or isinstance(record.subkey, bytes))
        and isinstance(record.value, bytes)
        and isinstance(record.signature, bytes)
        and isinstance(record.expiration_time, int | float)
        and not isinstance(record.expiration_time, bool)
    ):
        raise RecordError(RecordErrorReason.MALFORMED, "a field has the wrong type")
    if not record.key:
        raise RecordError(RecordErrorReason.MALFORMED, "the key is empty")
    _size_check("key", record.key, MAX_KEY_BYTES)
    _size_check("subkey", record.subkey or b"", MAX_SUBKEY_BYTES)
    _size_check("value", record.value, MAX_VALUE_BYTES)
    _size_check("signature", record.signature, MAX_SIGNATURE_BYTES)
    try:
        expiration = float(record.expiration_time)
    except OverflowError as e:
        raise RecordError(RecordErrorReason.MALFORMED, "expiration time overflows") from e
    if not math.isfinite(expiration):
        raise RecordError(RecordErrorReason.MALFORMED, f"expiration time is {expiration}")
    if expiration <= now:
        raise RecordError(RecordErrorReason.EXPIRED, f"expired at {expiration}, now is {now}")
    latest = now + MAX_TTL_SECONDS + MAX_CLOCK_SKEW_SECONDS
    if expiration > latest:
        raise RecordError(
            RecordErrorReason.TOO_FAR_IN_FUTURE,
            f"expires at {expiration}, past the maximum TTL (latest {latest})",
        )
    if record.key == STATUS_KEY:
        _check_status(record, now)
    found = _owner_key(record.key, record.subkey)
    if found is None:
        return replace(record, expiration_time=expiration, signature=b"")
    owner, public_key = found
    record = replace(record, expiration_time=expiration)
    if not record.signature:
        raise RecordError(RecordErrorReason.MISSING_SIGNATURE, f"the owner is {owner}")
    if not public_key.verify(record.signature, record.signing_payload(), remember=True):
        raise RecordError(RecordErrorReason.BAD_SIGNATURE, f"not signed by its owner {owner}")
    return record
