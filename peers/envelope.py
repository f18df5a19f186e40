"""Signed envelopes (libp2p specs, RFC 0002): a payload, its type, the signer's public key
and a signature that is valid only in one *domain*.

Wire form, the protobuf ``Envelope``: ``public_key = 1`` (the peer-id spec's
``PublicKey`` message), ``payload_type = 2``, ``payload = 3``, ``signature = 5``; we
write them in that order, as go-libp2p does. The signature covers, per RFC 0002
"Signature Production / Verification", ``uvarint(len(domain)) domain
uvarint(len(payload_type)) payload_type uvarint(len(payload)) payload`` (the domain as
UTF-8). The domain itself never travels: the reader names the domain it expects, so a
signature made for one purpose (a relay voucher) cannot pass for another (a peer record).

Pure functions, no I/O. Used by :mod:`peers.relay.voucher`; routing records (RFC 0003)
use the same envelope.
"""

from __future__ import annotations

from typing import NamedTuple

from peers.errors import IdentityError, LocalProtocolError, RemoteProtocolError
from peers.identity import KeyPair, PeerID, PublicKey
from peers.protobuf import ProtobufError, encode_fields
from peers.protofields import Fields
from peers.varint import encode_uvarint

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "EnvelopeError",
    "OpenedEnvelope",
    "open_envelope",
    "seal",
    "signed_bytes",
]

#: Largest envelope we open. The biggest in use is a signed peer record (RFC 0003), which
#: rides in identify; identify messages are bounded at 64 KiB (``limits.MAX_IDENTIFY_BYTES``),
#: so no honest envelope is larger. A relay voucher is about 150 bytes.
MAX_ENVELOPE_BYTES = 64 * 1024

_PUBLIC_KEY = 1
_PAYLOAD_TYPE = 2
_PAYLOAD = 3
_SIGNATURE = 5


class EnvelopeError(RemoteProtocolError):
    """An envelope is malformed, too large, or its signature is not valid in the domain."""


class OpenedEnvelope(NamedTuple):
    """What a verified envelope holds; ``signer`` is the PeerID of ``public_key``."""

    public_key: PublicKey
    payload_type: bytes
    payload: bytes

    @property
    def signer(self) -> PeerID:
        return PeerID.from_public_key(self.public_key)


def signed_bytes(domain: str, payload_type: bytes, payload: bytes) -> bytes:
    """The buffer RFC 0002 signs: each of domain, payload type and payload, prefixed with
    its length as an unsigned varint."""
    out = bytearray()
    for part in (domain.encode("utf-8"), payload_type, payload):
        out += encode_uvarint(len(part))
        out += part
    return bytes(out)


def seal(keypair: KeyPair, domain: str, payload_type: bytes, payload: bytes) -> bytes:
    """Sign ``payload`` in ``domain`` and return the serialised envelope.

    Raises :class:`LocalProtocolError` for an empty domain or payload type (go-libp2p's
    ``record.Seal`` refuses both too) or an envelope over :data:`MAX_ENVELOPE_BYTES`.
    """
    if not domain:
        raise LocalProtocolError("an envelope domain must not be empty")
    if not payload_type:
        raise LocalProtocolError("an envelope payload type must not be empty")
    signature = keypair.sign(signed_bytes(domain, payload_type, payload))
    encoded = encode_fields(
        [
            (_PUBLIC_KEY, keypair.public_key.to_protobuf()),
            (_PAYLOAD_TYPE, payload_type),
            (_PAYLOAD, payload),
            (_SIGNATURE, signature),
        ]
    )
    if len(encoded) > MAX_ENVELOPE_BYTES:
        raise LocalProtocolError(
            f"envelope of {len(encoded)} bytes exceeds the limit of {MAX_ENVELOPE_BYTES}"
        )
    return encoded


def open_envelope(data: bytes, domain: str) -> OpenedEnvelope:
    """Parse an envelope and verify its signature in ``domain``.

    Raises :class:`EnvelopeError` if it is larger than :data:`MAX_ENVELOPE_BYTES`,
    malformed, lacks its public key or signature, carries a key we cannot read, or its
    signature does not verify (tampered, or signed for another domain), and
    :class:`LocalProtocolError` for an empty ``domain``. The payload is returned
    unparsed: what it means depends on ``payload_type``, which the caller checks.
    """
    if not domain:
        raise LocalProtocolError("an envelope domain must not be empty")
    if len(data) > MAX_ENVELOPE_BYTES:
        raise EnvelopeError(
            f"envelope of {len(data)} bytes exceeds the limit of {MAX_ENVELOPE_BYTES}"
        )
    try:
        fields = Fields(data)
        key_bytes = fields.optional_bytes(_PUBLIC_KEY)
        payload_type = fields.optional_bytes(_PAYLOAD_TYPE) or b""
        payload = fields.optional_bytes(_PAYLOAD) or b""
        signature = fields.optional_bytes(_SIGNATURE)
    except ProtobufError as e:
        raise EnvelopeError(f"malformed envelope: {e}") from e
    if key_bytes is None:
        raise EnvelopeError("envelope has no public key")
    if not signature:
        raise EnvelopeError("envelope has no signature")
    try:
        public_key = PublicKey.from_protobuf(key_bytes)
    except IdentityError as e:
        raise EnvelopeError(f"envelope public key is unreadable: {e}") from e
    # A key nobody can verify with (an ECDSA curve cryptography does not know) verifies
    # nothing: ``PublicKey.verify`` says False, and the envelope is refused.
    valid = public_key.verify(signature, signed_bytes(domain, payload_type, payload))
    if not valid:
        raise EnvelopeError(f"envelope signature is not valid in domain {domain!r}")
    return OpenedEnvelope(public_key, payload_type, payload)
