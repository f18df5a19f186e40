"""Relay reservation vouchers: go-libp2p's wire form (raw 03 02 payload type), and every
voucher a client must refuse."""

from __future__ import annotations

import pytest

from peers.envelope import open_envelope, seal
from peers.identity import KeyPair
from peers.protobuf import encode_fields
from peers.relay import (
    VOUCHER_DOMAIN,
    VOUCHER_PAYLOAD_TYPE,
    RelayProtocolError,
    Status,
    Voucher,
    VoucherError,
    decode_voucher,
    make_voucher,
    verify_voucher,
)

RELAY = KeyPair.from_seed(b"r" * 32)
PEER = KeyPair.from_seed(b"p" * 32).peer_id
STRANGER = KeyPair.from_seed(b"s" * 32)
EXPIRATION = 1_700_003_600
NOW = 1_700_000_000.0


def _payload(relay: bytes, peer: bytes, expiration: int | None) -> bytes:
    fields: list[tuple[int, int | bytes]] = [(1, relay), (2, peer)]
    if expiration is not None:
        fields.append((3, expiration))
    return encode_fields(fields)


def test_constants_are_go_libp2ps() -> None:
    assert VOUCHER_DOMAIN == "libp2p-relay-rsvp"
    # go: RecordCodec = []byte{0x03, 0x02}; not the varint of 0x0302, which is 82 06.
    assert VOUCHER_PAYLOAD_TYPE == b"\x03\x02"


def test_voucher_wire_form() -> None:
    data = make_voucher(RELAY, PEER, EXPIRATION)
    opened = open_envelope(data, VOUCHER_DOMAIN)
    assert opened.payload_type == b"\x03\x02"
    relay_id, peer_id = RELAY.peer_id.to_bytes(), PEER.to_bytes()
    # ReservationVoucher{relay = 1, peer = 2, expiration = 3}, in field order.
    expiration = bytes.fromhex("90fecfaa06")  # 1700003600 as a varint
    assert opened.payload == (
        b"\x0a" + bytes([len(relay_id)]) + relay_id
        + b"\x12" + bytes([len(peer_id)]) + peer_id
        + b"\x18" + expiration
    )  # fmt: skip


def test_round_trip() -> None:
    voucher = verify_voucher(
        make_voucher(RELAY, PEER, EXPIRATION), relay=RELAY.peer_id, peer=PEER, now=NOW
    )
    assert voucher == Voucher(RELAY.peer_id, PEER, EXPIRATION)


def test_varint_payload_type_is_accepted_too() -> None:
    payload = _payload(RELAY.peer_id.to_bytes(), PEER.to_bytes(), EXPIRATION)
    data = seal(RELAY, VOUCHER_DOMAIN, b"\x82\x06", payload)
    assert decode_voucher(data) == Voucher(RELAY.peer_id, PEER, EXPIRATION)


def test_voucher_errors_answer_malformed_message() -> None:
    with pytest.raises(RelayProtocolError) as info:
        decode_voucher(b"junk")
    assert isinstance(info.value, VoucherError)
    assert info.value.status is Status.MALFORMED_MESSAGE


def test_signed_by_another_key() -> None:
    # A stranger's envelope naming RELAY as the relay: the signer is not the relay.
    payload = _payload(RELAY.peer_id.to_bytes(), PEER.to_bytes(), EXPIRATION)
    data = seal(STRANGER, VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload)
    with pytest.raises(VoucherError, match="signed it"):
        verify_voucher(data, relay=RELAY.peer_id, peer=PEER, now=NOW)


def test_by_another_relay() -> None:
    data = make_voucher(STRANGER, PEER, EXPIRATION)  # well formed, by the stranger
    with pytest.raises(VoucherError, match="by relay"):
        verify_voucher(data, relay=RELAY.peer_id, peer=PEER, now=NOW)


def test_for_another_peer() -> None:
    data = make_voucher(RELAY, STRANGER.peer_id, EXPIRATION)
    with pytest.raises(VoucherError, match="for peer"):
        verify_voucher(data, relay=RELAY.peer_id, peer=PEER, now=NOW)


def test_expired() -> None:
    data = make_voucher(RELAY, PEER, EXPIRATION)
    verify_voucher(data, relay=RELAY.peer_id, peer=PEER, now=EXPIRATION - 0.5)
    with pytest.raises(VoucherError, match="expired"):
        verify_voucher(data, relay=RELAY.peer_id, peer=PEER, now=EXPIRATION)


@pytest.mark.parametrize(
    "payload_type, payload, reason",
    [
        (b"\x03\x01", None, "not a voucher"),  # a peer record's payload type
        (VOUCHER_PAYLOAD_TYPE, _payload(b"", b"\x00\x01x", EXPIRATION), "relay id is not a PeerID"),
        (VOUCHER_PAYLOAD_TYPE, encode_fields([(2, b"\x00\x01x"), (3, 5)]), "no relay id"),
        (VOUCHER_PAYLOAD_TYPE, encode_fields([(1, b"\x00\x01x"), (3, 5)]), "no peer id"),
        (VOUCHER_PAYLOAD_TYPE, b"\x0a\x05ab", "malformed"),
    ],
)
def test_malformed_vouchers(payload_type: bytes, payload: bytes | None, reason: str) -> None:
    if payload is None:
        payload = _payload(RELAY.peer_id.to_bytes(), PEER.to_bytes(), EXPIRATION)
    with pytest.raises(VoucherError, match=reason):
        decode_voucher(seal(RELAY, VOUCHER_DOMAIN, payload_type, payload))


def test_without_expiration() -> None:
    payload = _payload(RELAY.peer_id.to_bytes(), PEER.to_bytes(), None)
    with pytest.raises(VoucherError, match="no expiration"):
        decode_voucher(seal(RELAY, VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))


def test_duplicate_relay_field_is_refused() -> None:
    """Two relay ids: go would take the last, a first-wins reader the first. Refused."""
    relay_id = RELAY.peer_id.to_bytes()
    payload = _payload(relay_id, PEER.to_bytes(), EXPIRATION) + encode_fields([(1, relay_id)])
    with pytest.raises(VoucherError, match="appears 2 times"):
        decode_voucher(seal(RELAY, VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload))


def test_other_domain_is_refused() -> None:
    payload = _payload(RELAY.peer_id.to_bytes(), PEER.to_bytes(), EXPIRATION)
    data = seal(RELAY, "libp2p-routing-record", VOUCHER_PAYLOAD_TYPE, payload)
    with pytest.raises(VoucherError, match="envelope"):
        decode_voucher(data)
