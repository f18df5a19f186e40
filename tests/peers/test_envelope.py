"""Signed envelopes (RFC 0002): a vector built by hand from the RFC, other key types,
and every way an envelope fails to open."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from peers.envelope import (
    MAX_ENVELOPE_BYTES,
    EnvelopeError,
    OpenedEnvelope,
    open_envelope,
    seal,
    signed_bytes,
)
from peers.errors import LocalProtocolError, RemoteProtocolError
from peers.identity import KeyPair, KeyType, PublicKey
from peers.protobuf import encode_fields

# The peer-ids spec's Ed25519 test key (its seed is the first half of the private data).
SEED = bytes.fromhex("7e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d")
PUBLIC_PROTOBUF = bytes.fromhex(
    "080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
# go-libp2p's envelope_test.go uses this domain and payload type.
DOMAIN = "libp2p-testing"
PAYLOAD_TYPE = b"/libp2p/testdata"
PAYLOAD = b"hello world!"


def test_signed_bytes_follow_rfc_0002() -> None:
    # "The length of the domain ... the domain ... the length of payload_type ..."
    assert signed_bytes(DOMAIN, PAYLOAD_TYPE, PAYLOAD) == (
        b"\x0e" + b"libp2p-testing" + b"\x10" + b"/libp2p/testdata" + b"\x0c" + b"hello world!"
    )
    long = b"x" * 200  # a length of 200 takes two varint bytes: c8 01
    assert signed_bytes("d", b"", long) == b"\x01d" + b"\x00" + b"\xc8\x01" + long


def test_vector_built_by_hand() -> None:
    pair = KeyPair.from_seed(SEED)
    assert pair.public_key.to_protobuf() == PUBLIC_PROTOBUF
    unsigned = b"\x0e" + DOMAIN.encode() + b"\x10" + PAYLOAD_TYPE + b"\x0c" + PAYLOAD
    # Ed25519 signatures are deterministic: sign with the raw key, outside our code.
    signature = ed25519.Ed25519PrivateKey.from_private_bytes(SEED).sign(unsigned)
    expected = (
        b"\x0a\x24" + PUBLIC_PROTOBUF  # public_key = 1
        + b"\x12\x10" + PAYLOAD_TYPE  # payload_type = 2
        + b"\x1a\x0c" + PAYLOAD  # payload = 3
        + b"\x2a\x40" + signature  # signature = 5
    )  # fmt: skip
    assert seal(pair, DOMAIN, PAYLOAD_TYPE, PAYLOAD) == expected
    opened = open_envelope(expected, DOMAIN)
    assert opened == OpenedEnvelope(pair.public_key, PAYLOAD_TYPE, PAYLOAD)
    assert opened.signer == pair.peer_id
    public_key, payload_type, payload = opened  # also a plain triple
    assert (public_key.key_type, payload_type, payload) == (KeyType.ED25519, PAYLOAD_TYPE, PAYLOAD)


def test_secp256k1_envelope_opens() -> None:
    """go peers may sign with secp256k1: the libp2p signature is ECDSA over SHA-256, DER."""
    private = ec.generate_private_key(ec.SECP256K1())
    compressed = private.public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint
    )
    key = PublicKey(KeyType.SECP256K1, compressed)
    signature = private.sign(signed_bytes(DOMAIN, PAYLOAD_TYPE, PAYLOAD), ec.ECDSA(hashes.SHA256()))
    data = encode_fields([(1, key.to_protobuf()), (2, PAYLOAD_TYPE), (3, PAYLOAD), (5, signature)])
    assert open_envelope(data, DOMAIN) == OpenedEnvelope(key, PAYLOAD_TYPE, PAYLOAD)


def _envelope(**overrides: bytes | None) -> bytes:
    pair = KeyPair.from_seed(SEED)
    fields: dict[str, bytes | None] = {
        "key": pair.public_key.to_protobuf(),
        "type": PAYLOAD_TYPE,
        "payload": PAYLOAD,
        "signature": pair.sign(signed_bytes(DOMAIN, PAYLOAD_TYPE, PAYLOAD)),
    }
    fields.update(overrides)
    numbers = {"key": 1, "type": 2, "payload": 3, "signature": 5}
    return encode_fields([(numbers[k], v) for k, v in fields.items() if v is not None])


def test_envelope_error_is_the_remotes_fault() -> None:
    assert issubclass(EnvelopeError, RemoteProtocolError)


def test_field_order_does_not_matter_to_the_reader() -> None:
    pair = KeyPair.from_seed(SEED)
    signature = pair.sign(signed_bytes(DOMAIN, PAYLOAD_TYPE, PAYLOAD))
    data = encode_fields(
        [(5, signature), (3, PAYLOAD), (2, PAYLOAD_TYPE), (1, pair.public_key.to_protobuf())]
    )
    assert open_envelope(data, DOMAIN).payload == PAYLOAD


def test_unknown_fields_are_skipped() -> None:
    assert open_envelope(_envelope() + b"\x20\x07", DOMAIN).payload == PAYLOAD  # field 4


@pytest.mark.parametrize(
    "data, reason",
    [
        (_envelope(payload=b"hello world?"), "not valid"),
        (_envelope(type=b"/libp2p/other"), "not valid"),
        (_envelope(signature=b"\x00" * 64), "not valid"),
        (_envelope(key=KeyPair.from_seed(bytes(32)).public_key.to_protobuf()), "not valid"),
        (_envelope(key=None), "no public key"),
        (_envelope(signature=None), "no signature"),
        (_envelope(signature=b""), "no signature"),
        (_envelope(key=b"\x08\x01\x12\x03abc"), "unreadable"),  # an Ed25519 key of 3 bytes
        (_envelope() + b"\x1a\x01x", "appears 2 times"),  # a second payload
        (b"\x0a\x05ab", "malformed"),
        (b"\xff", "malformed"),
    ],
)
def test_envelopes_that_do_not_open(data: bytes, reason: str) -> None:
    with pytest.raises(EnvelopeError, match=reason):
        open_envelope(data, DOMAIN)


def test_signature_is_bound_to_its_domain() -> None:
    data = seal(KeyPair.from_seed(SEED), DOMAIN, PAYLOAD_TYPE, PAYLOAD)
    with pytest.raises(EnvelopeError, match="not valid in domain 'libp2p-routing-record'"):
        open_envelope(data, "libp2p-routing-record")


def test_key_on_an_unknown_curve_is_refused_not_leaked() -> None:
    """An ECDSA key whose curve OID cryptography does not know makes cryptography raise
    UnsupportedAlgorithm, which is no protocol error; the key verifies nothing, and the
    envelope is refused as any badly signed one is."""
    der = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    unknown_curve = der.replace(
        bytes.fromhex("2a8648ce3d030107"), bytes.fromhex("2a8648ce3d030109")
    )
    assert not PublicKey(KeyType.ECDSA, unknown_curve).verify(b"sig", b"data")
    key = PublicKey(KeyType.ECDSA, unknown_curve).to_protobuf()
    with pytest.raises(EnvelopeError, match="not valid"):
        open_envelope(_envelope(key=key), DOMAIN)


def test_oversized_envelope_is_refused() -> None:
    with pytest.raises(EnvelopeError, match="exceeds"):
        open_envelope(_envelope(payload=b"x" * MAX_ENVELOPE_BYTES), DOMAIN)
    with pytest.raises(LocalProtocolError, match="exceeds"):
        seal(KeyPair.from_seed(SEED), DOMAIN, PAYLOAD_TYPE, b"x" * MAX_ENVELOPE_BYTES)


def test_empty_domain_or_payload_type_is_a_local_mistake() -> None:
    pair = KeyPair.from_seed(SEED)
    with pytest.raises(LocalProtocolError):
        seal(pair, "", PAYLOAD_TYPE, PAYLOAD)
    with pytest.raises(LocalProtocolError):
        seal(pair, DOMAIN, b"", PAYLOAD)
    with pytest.raises(LocalProtocolError):
        open_envelope(seal(pair, DOMAIN, PAYLOAD_TYPE, PAYLOAD), "")


def test_empty_payload_and_payload_type_from_a_peer_are_valid() -> None:
    # RFC 0002: the payload type "may be left empty without invalidating the envelope".
    pair = KeyPair.from_seed(SEED)
    data = encode_fields(
        [(1, pair.public_key.to_protobuf()), (5, pair.sign(signed_bytes(DOMAIN, b"", b"")))]
    )
    assert open_envelope(data, DOMAIN) == OpenedEnvelope(pair.public_key, b"", b"")
