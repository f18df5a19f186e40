"""A run key: states signed by the run's operator, so one donor suffices and no quorum of
strangers can substitute another state.

Without a run key a newcomer loads a state only when donors on enough distinct networks
offer identical manifests (:mod:`averaging.state.sync`); identities on many networks can
still meet that. With one, the operator's peers (those holding the key) sign every
manifest they serve, and peers that trust the key load only manifests it signed: from
one donor, whoever relays it, and nothing else. The signature is Ed25519 over a domain
tag, the run's state prefix (so a signed state of one run is worth nothing in another),
and the sha256 of the manifest without its signature fields; the manifest in turn
commits to the version, the metadata, every chunk's sha256 and the whole state's
checksum, so the signature covers every byte that is loaded.

A run key is a libp2p key file like ``--identity``'s, and is named by its PeerID (the
Ed25519 public key is inside it).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from averaging.state.manifest import DonorError, Manifest
from peers.errors import IdentityError
from peers.identity import KeyPair, PeerID
from peers.serialization import pack
from peers.wire import to_wire

STATE_SIGNATURE_DOMAIN = b"swarmtrain-state-manifest-v1\0"


def manifest_digest(manifest: Manifest) -> bytes:
    """sha256 of ``manifest`` without its signer and signature."""
    unsigned = replace(manifest, signer=b"", signature=b"")
    return hashlib.sha256(pack(to_wire(unsigned))).digest()


def _message(prefix: str, manifest: Manifest) -> bytes:
    return STATE_SIGNATURE_DOMAIN + prefix.encode() + b"\0" + manifest_digest(manifest)


def sign_manifest(key: KeyPair, prefix: str, manifest: Manifest) -> Manifest:
    """``manifest`` signed with the run key ``key`` for the run whose states live under
    ``prefix``."""
    signature = key.sign(_message(prefix, manifest))
    return replace(manifest, signer=key.peer_id.to_bytes(), signature=signature)


def check_signed(prefix: str, manifest: Manifest, trusted: frozenset[PeerID]) -> PeerID:
    """The run key among ``trusted`` that signed ``manifest`` for ``prefix``; raises
    :class:`DonorError` (the donor is dropped) if it is unsigned, signed by another key,
    or its signature does not verify."""
    if not manifest.signer:
        raise DonorError("its state is not signed, and this run loads only signed states")
    try:
        signer = PeerID(manifest.signer)
    except (IdentityError, ValueError, TypeError) as e:
        raise DonorError(f"its manifest's signer is not a peer ID: {e}") from e
    if signer not in trusted:
        raise DonorError(f"its state is signed by {signer}, not by a run key we trust")
    key = signer.inline_public_key()
    if key is None or not key.verify(manifest.signature, _message(prefix, manifest)):
        raise DonorError(f"its manifest's signature by {signer} does not verify")
    return signer
