"""Identity: Ed25519 key pairs and libp2p PeerIDs.

Follows the libp2p peer-ids spec: keys are serialised as the protobuf
``PublicKey``/``PrivateKey`` messages (``Type = 1`` enum, ``Data = 2`` bytes, written in
field order), and a PeerID is the multihash of the serialised public key: the identity
multihash when that is at most 42 bytes (every Ed25519 key), sha2-256 otherwise;
printed as base58btc (``12D3KooW...`` for Ed25519).

We create only Ed25519 identities, but verify the signatures of every key type the
spec defines (RSA, Ed25519, secp256k1, ECDSA), because a go-libp2p peer may use any.
"""

from __future__ import annotations

import enum
import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from peers.errors import IdentityError
from peers.protobuf import ProtobufError, decode_fields, encode_fields, first_bytes, first_int

#: peer-ids spec: keys whose serialisation is at most 42 bytes are inlined with the
#: identity multihash; longer ones are hashed with sha2-256.
MAX_INLINE_KEY_LENGTH = 42
_MULTIHASH_IDENTITY = 0x00
_MULTIHASH_SHA256 = 0x12
#: Longest public key protobuf we accept from a peer (a 4096-bit RSA key is ~550 bytes);
#: bounds the work a remote can make us do.
MAX_PUBLIC_KEY_BYTES = 1024
#: Signatures remembered as good (a 32-byte digest each). Peers read the same signed
#: records again and again (every progress poll returns every peer's record from every
#: replica), and an Ed25519 check costs far more than hashing what it covers.
VERIFIED_CACHE_SIZE = 8192


class _VerifiedSignatures:
    """A bounded, thread-safe set of digests of (key, signature, data) that verified.
    Only good signatures are remembered: a forged one is checked (and refused) each time,
    and cannot evict good ones faster than good ones arrive."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._digests: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def digest(key: PublicKey, signature: bytes, data: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=32)
        for part in (bytes([key.key_type]), key.raw, signature, data):
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            if digest not in self._digests:
                return False
            self._digests.move_to_end(digest)
            return True

    def add(self, digest: bytes) -> None:
        with self._lock:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
            while len(self._digests) > self._size:
                self._digests.popitem(last=False)


_VERIFIED = _VerifiedSignatures(VERIFIED_CACHE_SIZE)


class KeyType(enum.IntEnum):
    """The ``KeyType`` enum of the peer-ids spec."""

    RSA = 0
    ED25519 = 1
    SECP256K1 = 2
    ECDSA = 3


class PeerID:
    """A libp2p PeerID: the multihash bytes, printed as base58btc."""

    __slots__ = ("_bytes", "_hash")

    def __init__(self, multihash: bytes) -> None:
        if len(multihash) < 2 or multihash[0] not in (_MULTIHASH_IDENTITY, _MULTIHASH_SHA256):
            raise IdentityError("a PeerID must be an identity or sha2-256 multihash")
        if multihash[1] != len(multihash) - 2:
            raise IdentityError("PeerID multihash length does not match its digest")
        self._bytes = bytes(multihash)
        self._hash = hash(self._bytes)

    @classmethod
    def from_base58(cls, text: str) -> PeerID:
        """Parse a ``12D3KooW...``/``Qm...`` string; raises :class:`IdentityError`."""
        try:
            raw = base58.b58decode(text)
        except ValueError as e:
            raise IdentityError(f"not a base58 PeerID: {text!r}") from e
        return cls(raw)

    @classmethod
    def from_public_key(cls, key: PublicKey) -> PeerID:
        encoded = key.to_protobuf()
        if len(encoded) <= MAX_INLINE_KEY_LENGTH:
            return cls(bytes([_MULTIHASH_IDENTITY, len(encoded)]) + encoded)
        return cls(bytes([_MULTIHASH_SHA256, 32]) + hashlib.sha256(encoded).digest())

    def to_bytes(self) -> bytes:
        return self._bytes

    def to_base58(self) -> str:
        return base58.b58encode(self._bytes).decode("ascii")

    def inline_public_key(self) -> PublicKey | None:
        """The public key carried inside an identity-multihash PeerID, if any."""
        if self._bytes[0] != _MULTIHASH_IDENTITY:
            return None
        return PublicKey.from_protobuf(self._bytes[2:])

    def matches(self, key: PublicKey) -> bool:
        return PeerID.from_public_key(key) == self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PeerID) and other._bytes == self._bytes

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: PeerID) -> bool:
        return self._bytes < other._bytes

    def __str__(self) -> str:
        return self.to_base58()

    def __repr__(self) -> str:
        return f"PeerID({self.to_base58()})"


class PublicKey:
    """A public key of any libp2p key type, able to verify signatures."""

    __slots__ = ("_der_or_raw", "key_type")

    def __init__(self, key_type: KeyType, data: bytes) -> None:
        self.key_type = key_type
        self._der_or_raw = bytes(data)

    @classmethod
    def from_protobuf(cls, encoded: bytes) -> PublicKey:
        """Parse the spec's ``PublicKey`` protobuf; raises :class:`IdentityError`."""
        if len(encoded) > MAX_PUBLIC_KEY_BYTES:
            raise IdentityError(f"public key of {len(encoded)} bytes is too long")
        try:
            fields = decode_fields(encoded)
            type_number = first_int(fields, 1)
            data = first_bytes(fields, 2)
        except ProtobufError as e:
            raise IdentityError(f"malformed public key: {e}") from e
        if type_number is None or data is None:
            raise IdentityError("public key lacks its Type or Data field")
        try:
            key_type = KeyType(type_number)
        except ValueError as e:
            raise IdentityError(f"unknown key type {type_number}") from e
        if key_type is KeyType.ED25519 and len(data) != 32:
            raise IdentityError("an Ed25519 public key has 32 bytes")
        return cls(key_type, data)

    def to_protobuf(self) -> bytes:
        return encode_fields([(1, int(self.key_type)), (2, self._der_or_raw)])

    @property
    def raw(self) -> bytes:
        """The key bytes inside the protobuf (32 bytes for Ed25519)."""
        return self._der_or_raw

    def verify(self, signature: bytes, data: bytes, *, remember: bool = False) -> bool:
        """True if ``signature`` is this key's signature of ``data`` (per the peer-ids spec).
        ``remember``: for signatures that come back again and again (DHT records), a good
        one is remembered by a digest and not checked again; handshakes, whose signatures
        never repeat, do not fill the memory."""
        if not remember:
            return self._check(signature, data)
        try:
            digest = _VerifiedSignatures.digest(self, signature, data)
        except TypeError:  # not bytes-like: nothing anyone signed
            return False
        if digest in _VERIFIED:
            return True
        if not self._check(signature, data):
            return False
        _VERIFIED.add(digest)
        return True

    def _check(self, signature: bytes, data: bytes) -> bool:
        try:
            if self.key_type is KeyType.ED25519:
                ed25519.Ed25519PublicKey.from_public_bytes(self._der_or_raw).verify(signature, data)
            elif self.key_type is KeyType.SECP256K1:
                ec.EllipticCurvePublicKey.from_encoded_point(
                    ec.SECP256K1(), self._der_or_raw
                ).verify(signature, data, ec.ECDSA(hashes.SHA256()))
            elif self.key_type is KeyType.ECDSA:
                key = serialization.load_der_public_key(self._der_or_raw)
                if not isinstance(key, ec.EllipticCurvePublicKey):
                    return False
                key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
            else:
                key = serialization.load_der_public_key(self._der_or_raw)
                if not isinstance(key, rsa.RSAPublicKey):
                    return False
                key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        except (InvalidSignature, UnsupportedAlgorithm, ValueError, TypeError):
            # UnsupportedAlgorithm: a key on a curve cryptography does not know is a key
            # nobody can have signed with, not our error.
            return False
        return True

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PublicKey)
            and other.key_type == self.key_type
            and other._der_or_raw == self._der_or_raw
        )

    def __hash__(self) -> int:
        return hash((self.key_type, self._der_or_raw))


class KeyPair:
    """An Ed25519 identity: signs, and knows its PublicKey and PeerID."""

    __slots__ = ("_private", "peer_id", "public_key")

    def __init__(self, private_key: ed25519.Ed25519PrivateKey) -> None:
        self._private = private_key
        raw_public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_key = PublicKey(KeyType.ED25519, raw_public)
        self.peer_id = PeerID.from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        """Deterministic key pair from a 32-byte seed (tests, reproducible swarms)."""
        if len(seed) != 32:
            raise IdentityError("an Ed25519 seed has 32 bytes")
        return cls(ed25519.Ed25519PrivateKey.from_private_bytes(seed))

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def to_protobuf(self) -> bytes:
        """The spec's ``PrivateKey`` protobuf: Ed25519 data is seed || public key (64 bytes)."""
        seed = self._private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return encode_fields([(1, int(KeyType.ED25519)), (2, seed + self.public_key.raw)])

    @classmethod
    def from_protobuf(cls, encoded: bytes) -> KeyPair:
        """Parse a ``PrivateKey`` protobuf; raises :class:`IdentityError` if it is malformed,
        not Ed25519, or its public half does not match its seed."""
        try:
            fields = decode_fields(encoded)
            type_number = first_int(fields, 1)
            data = first_bytes(fields, 2)
        except ProtobufError as e:
            raise IdentityError(f"malformed private key: {e}") from e
        if type_number is None or data is None:
            raise IdentityError("private key lacks its Type or Data field")
        if type_number != KeyType.ED25519:
            name = (
                KeyType(type_number).name
                if type_number in KeyType._value2member_map_
                else type_number
            )
            raise IdentityError(f"only Ed25519 identities are supported, this key is {name}")
        if len(data) not in (32, 64):
            raise IdentityError(f"an Ed25519 private key has 64 bytes, got {len(data)}")
        pair = cls.from_seed(data[:32])
        if len(data) == 64 and data[32:] != pair.public_key.raw:
            raise IdentityError("private key's public half does not match its seed")
        return pair

    # --- key files -----------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyPair:
        """Read a key file (the ``PrivateKey`` protobuf, as go-libp2p and hivemind write it).

        Raises :class:`IdentityError` naming the file when it is unreadable or invalid.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise IdentityError(f"cannot read identity file {path}: {e.strerror or e}") from e
        try:
            return cls.from_protobuf(data)
        except IdentityError as e:
            raise IdentityError(f"identity file {path} is not a valid libp2p key: {e}") from e

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the key file atomically with mode 0600 (never world-readable, even briefly)."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_protobuf())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:
            raise IdentityError(f"cannot write identity file {path}: {e.strerror or e}") from e
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> KeyPair:
        """Load the key at ``path``, or create one there (mode 0600) if there is none."""
        if Path(path).exists():
            return cls.load(path)
        pair = cls.generate()
        pair.save(path)
        return pair
