"""DHT records: size bounds, expiration bounds, ownership markers, signatures."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import msgpack
import pytest

from peers.dht.records import (
    MAX_CLOCK_SKEW_SECONDS,
    MAX_KEY_BYTES,
    MAX_SIGNATURE_BYTES,
    MAX_SUBKEY_BYTES,
    MAX_SUBKEYS_PER_KEY,
    MAX_TTL_SECONDS,
    MAX_VALUE_BYTES,
    Record,
    RecordError,
    RecordErrorReason,
    owner_marker,
    owner_of,
    validate,
)
from peers.identity import KeyPair, KeyType, PeerID, PublicKey
from peers.serialization import MAX_FRAME_BYTES, pack

NOW = 1_000_000.0
ALICE = KeyPair.from_seed(b"a" * 32)
BOB = KeyPair.from_seed(b"b" * 32)


def reason_of(record: Record, now: float = NOW) -> RecordErrorReason:
    with pytest.raises(RecordError) as info:
        validate(record, now)
    return info.value.reason


def test_unowned_record_is_valid_without_signature() -> None:
    record = Record(b"open", None, pack({"x": 1}), NOW + 60)
    assert validate(record, NOW) == record


def test_signature_on_unowned_key_is_dropped() -> None:
    record = Record(b"open", b"sub", pack(1), NOW + 60).sign(ALICE)
    assert validate(record, NOW).signature == b""


def test_integer_expiration_is_normalised_and_signs_the_same() -> None:
    key = b"k" + owner_marker(ALICE.peer_id)
    as_int = Record(key, None, pack(1), int(NOW) + 60)
    as_float = replace(as_int, expiration_time=NOW + 60)
    assert as_int.signing_payload() == as_float.signing_payload()
    checked = validate(as_int.sign(ALICE), NOW)
    assert isinstance(checked.expiration_time, float)
    assert checked == as_float.sign(ALICE)


def test_signing_payload_is_domain_separated_and_covers_every_field() -> None:
    record = Record(b"k", b"s", b"v", NOW)
    assert msgpack.unpackb(record.signing_payload()) == [
        b"swarmtrain-dht-record",
        b"k",
        b"s",
        b"v",
        NOW,
    ]
    variants = [
        replace(record, key=b"K"),
        replace(record, subkey=None),
        replace(record, value=b"V"),
        replace(record, expiration_time=NOW + 1),
    ]
    assert len({r.signing_payload() for r in [record, *variants]}) == 5


@pytest.mark.parametrize(
    ("key", "subkey", "value", "signature"),
    [
        (b"k" * (MAX_KEY_BYTES + 1), None, b"", b""),
        (b"k", b"s" * (MAX_SUBKEY_BYTES + 1), b"", b""),
        (b"k", None, b"v" * (MAX_VALUE_BYTES + 1), b""),
        (b"k", None, b"", b"x" * (MAX_SIGNATURE_BYTES + 1)),
    ],
)
def test_oversized_fields_are_refused(
    key: bytes, subkey: bytes | None, value: bytes, signature: bytes
) -> None:
    assert reason_of(Record(key, subkey, value, NOW + 1, signature)) is RecordErrorReason.TOO_LARGE


def test_fields_at_their_limits_are_accepted() -> None:
    record = Record(b"k" * MAX_KEY_BYTES, b"s" * MAX_SUBKEY_BYTES, b"v" * MAX_VALUE_BYTES, NOW + 1)
    assert validate(record, NOW) == record


@pytest.mark.parametrize(
    "record",
    [
        Record(b"", None, b"v", NOW + 1),
        Record("text", None, b"v", NOW + 1),  # type: ignore[arg-type]
        Record(b"k", 7, b"v", NOW + 1),  # type: ignore[arg-type]
        Record(b"k", None, ["not", "bytes"], NOW + 1),  # type: ignore[arg-type]
        Record(b"k", None, b"v", True),
        Record(b"k", None, b"v", "soon"),  # type: ignore[arg-type]
        Record(b"k", None, b"v", math.nan),
        Record(b"k", None, b"v", math.inf),
        Record(b"k", None, b"v", 10**400),
    ],
)
def test_malformed_records_are_refused(record: Record) -> None:
    assert reason_of(record) is RecordErrorReason.MALFORMED


def test_expired_records_are_refused() -> None:
    assert reason_of(Record(b"k", None, b"v", NOW)) is RecordErrorReason.EXPIRED
    assert reason_of(Record(b"k", None, b"v", NOW - 5)) is RecordErrorReason.EXPIRED


def test_expiration_beyond_max_ttl_is_refused_not_clamped() -> None:
    latest = NOW + MAX_TTL_SECONDS + MAX_CLOCK_SKEW_SECONDS
    assert validate(Record(b"k", None, b"v", latest), NOW).expiration_time == latest
    for far in (latest + 1e-3, NOW + 100 * MAX_TTL_SECONDS, 1e300):
        assert reason_of(Record(b"k", None, b"v", far)) is RecordErrorReason.TOO_FAR_IN_FUTURE


def test_owner_marker_in_key_or_subkey() -> None:
    alice = owner_marker(ALICE.peer_id)
    assert alice == b"[owner:" + str(ALICE.peer_id).encode() + b"]"
    assert owner_of(b"plain", None) is None
    assert owner_of(b"plain", b"sub") is None
    assert owner_of(b"profile" + alice, None) == ALICE.peer_id
    assert owner_of(b"peers", alice) == ALICE.peer_id
    assert owner_of(alice + b"x", b"y" + alice) == ALICE.peer_id
    assert owner_of(b"[owner:unterminated", None) is None


def test_two_different_owners_are_refused() -> None:
    key = b"k" + owner_marker(ALICE.peer_id)
    with pytest.raises(RecordError) as info:
        owner_of(key, owner_marker(BOB.peer_id))
    assert info.value.reason is RecordErrorReason.BAD_OWNER
    with pytest.raises(RecordError):
        owner_of(key + owner_marker(BOB.peer_id), None)


def test_markers_that_cannot_name_a_verifiable_owner_are_refused() -> None:
    hashed = PeerID(bytes([0x12, 32]) + hashlib.sha256(b"an RSA key").digest())
    secp = PeerID.from_public_key(PublicKey(KeyType.SECP256K1, b"\x02" + b"\x01" * 32))
    assert secp.inline_public_key() is not None  # inlined, but not Ed25519
    for key in (
        b"[owner:not-base58!]",
        b"[owner:]",
        b"[owner:\xff\xfe]",
        b"[owner:" + b"1" * 40 + b"]",
        owner_marker(hashed),
        owner_marker(secp),
    ):
        with pytest.raises(RecordError) as info:
            owner_of(key, None)
        assert info.value.reason is RecordErrorReason.BAD_OWNER, key
        assert reason_of(Record(key, None, b"v", NOW + 1)) is RecordErrorReason.BAD_OWNER


def test_owned_record_signed_by_owner_is_valid() -> None:
    for key, subkey in [
        (b"k" + owner_marker(ALICE.peer_id), None),
        (b"k" + owner_marker(ALICE.peer_id), b"s"),
        (b"shared", owner_marker(ALICE.peer_id)),
    ]:
        record = Record(key, subkey, pack([1, 2]), NOW + 60).sign(ALICE)
        assert validate(record, NOW) == record


def test_owned_record_without_signature_is_refused() -> None:
    record = Record(b"shared", owner_marker(ALICE.peer_id), b"v", NOW + 60)
    assert reason_of(record) is RecordErrorReason.MISSING_SIGNATURE


def test_owned_record_signed_by_someone_else_is_refused() -> None:
    record = Record(b"shared", owner_marker(ALICE.peer_id), b"v", NOW + 60)
    assert reason_of(record.sign(BOB)) is RecordErrorReason.BAD_SIGNATURE


def test_tampered_or_forged_signatures_are_refused() -> None:
    signed = Record(b"k" + owner_marker(ALICE.peer_id), None, b"v", NOW + 60).sign(ALICE)
    forged = [
        replace(signed, value=b"w"),
        replace(signed, expiration_time=signed.expiration_time + 1),
        replace(signed, subkey=b"s"),
        replace(signed, signature=bytes(64)),
        replace(signed, signature=signed.signature[:-1] + bytes([signed.signature[-1] ^ 1])),
        replace(signed, signature=signed.signature[:32]),
    ]
    for record in forged:
        assert reason_of(record) is RecordErrorReason.BAD_SIGNATURE


def test_a_signature_cannot_be_moved_to_another_key() -> None:
    marker = owner_marker(ALICE.peer_id)
    signed = Record(b"a" + marker, None, b"v", NOW + 60).sign(ALICE)
    assert reason_of(replace(signed, key=b"b" + marker)) is RecordErrorReason.BAD_SIGNATURE


def test_a_full_key_fits_one_rpc_frame() -> None:
    """The size constants are chosen so a reply carrying a whole key fits one frame."""
    entry = [b"k" * MAX_KEY_BYTES, b"s" * MAX_SUBKEY_BYTES, b"v" * MAX_VALUE_BYTES, NOW, b"x" * 64]
    reply = pack([entry] * (MAX_SUBKEYS_PER_KEY + 1))
    assert len(reply) < MAX_FRAME_BYTES * 0.75
