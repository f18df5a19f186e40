"""Reservation vouchers (libp2p specs, relay/circuit-v2.md, "Reservation Vouchers"): a
relay's signed statement that it will relay for a peer until a time.

A voucher is a signed envelope (:mod:`peers.envelope`) in domain ``libp2p-relay-rsvp``
whose payload is the canonical protobuf ``ReservationVoucher { relay = 1 (peer id
bytes), peer = 2 (peer id bytes), expiration = 3 (uint64 Unix seconds) }``.

The payload type is multicodec 0x0302. go-libp2p writes it as the two raw bytes
``03 02`` (``RecordCodec = []byte{0x03, 0x02}`` in circuitv2/proto/voucher.go), not as
the unsigned varint ``82 06`` that RFC 0002's "multicodec code" suggests, and it looks
record types up by exact bytes; so we write ``03 02`` and also accept ``82 06``.
"""

from __future__ import annotations

from dataclasses import dataclass

from peers.envelope import EnvelopeError, open_envelope, seal
from peers.errors import IdentityError, LocalProtocolError
from peers.identity import KeyPair, PeerID
from peers.protobuf import ProtobufError, encode_fields
from peers.protofields import Fields
from peers.relay.messages import RelayProtocolError

#: The envelope domain of relay vouchers (spec).
VOUCHER_DOMAIN = "libp2p-relay-rsvp"
#: The payload type we write: multicodec 0x0302 as go-libp2p writes it, two raw bytes.
VOUCHER_PAYLOAD_TYPE = b"\x03\x02"
#: Every payload type we read as a voucher: go's raw form and the varint form.
VOUCHER_PAYLOAD_TYPES = frozenset({VOUCHER_PAYLOAD_TYPE, b"\x82\x06"})


class VoucherError(RelayProtocolError):
    """A reservation voucher is malformed, not signed by the relay, for another peer, or
    expired. Its status is ``MALFORMED_MESSAGE``, as go-libp2p's client reports a bad
    voucher in a reservation answer."""


@dataclass(frozen=True, slots=True)
class Voucher:
    """A verified voucher: ``relay`` will relay for ``peer`` until the expiration."""

    relay: PeerID
    peer: PeerID
    #: Unix time in whole seconds (UTC) the reservation ends.
    expiration_unix_seconds: int


def make_voucher(relay_keypair: KeyPair, peer: PeerID, expiration_unix_seconds: int) -> bytes:
    """The serialised envelope of a voucher by the relay owning ``relay_keypair`` for
    ``peer``; raises :class:`LocalProtocolError` for a negative expiration."""
    if expiration_unix_seconds < 0:
        raise LocalProtocolError("a voucher expiration is a Unix time, not negative")
    payload = encode_fields(
        [
            (1, relay_keypair.peer_id.to_bytes()),
            (2, peer.to_bytes()),
            (3, expiration_unix_seconds),
        ]
    )
    return seal(relay_keypair, VOUCHER_DOMAIN, VOUCHER_PAYLOAD_TYPE, payload)


def _peer_id(fields: Fields, number: int, what: str) -> PeerID:
    raw = fields.optional_bytes(number)
    if raw is None:
        raise VoucherError(f"voucher has no {what} id")
    try:
        return PeerID(raw)
    except IdentityError as e:
        raise VoucherError(f"voucher {what} id is not a PeerID: {e}") from e


def decode_voucher(data: bytes) -> Voucher:
    """Open the envelope and parse the voucher, checking only that the relay signed it
    (not for whom or until when; :func:`verify_voucher` does that).

    Raises :class:`VoucherError` if the envelope does not verify, its payload type is not
    a voucher's, the payload is malformed or lacks a field, or the signer is not the
    relay the voucher names.
    """
    try:
        opened = open_envelope(data, VOUCHER_DOMAIN)
    except EnvelopeError as e:
        raise VoucherError(f"voucher envelope: {e}") from e
    if opened.payload_type not in VOUCHER_PAYLOAD_TYPES:
        raise VoucherError(f"envelope payload type {opened.payload_type.hex()} is not a voucher")
    try:
        fields = Fields(opened.payload)
        relay = _peer_id(fields, 1, "relay")
        peer = _peer_id(fields, 2, "peer")
        expiration = fields.optional_int(3)
    except ProtobufError as e:
        raise VoucherError(f"malformed voucher: {e}") from e
    if expiration is None:
        raise VoucherError("voucher has no expiration")
    if not relay.matches(opened.public_key):
        raise VoucherError(f"voucher names relay {relay} but {opened.signer} signed it")
    return Voucher(relay, peer, expiration)


def verify_voucher(data: bytes, *, relay: PeerID, peer: PeerID, now: float) -> Voucher:
    """The voucher in ``data`` if ``relay`` signed it for ``peer`` and it has not expired
    at ``now`` (Unix seconds; it is valid while ``now`` is before its expiration).

    Raises :class:`VoucherError` naming the problem: everything :func:`decode_voucher`
    refuses, a voucher by another relay, for another peer, or expired.
    """
    voucher = decode_voucher(data)
    if voucher.relay != relay:
        raise VoucherError(f"voucher is by relay {voucher.relay}, expected {relay}")
    if voucher.peer != peer:
        raise VoucherError(f"voucher is for peer {voucher.peer}, expected {peer}")
    if now >= voucher.expiration_unix_seconds:
        raise VoucherError(
            f"voucher expired at {voucher.expiration_unix_seconds}, it is now {now:.0f}"
        )
    return voucher
