"""The ``/noise`` secure channel: libp2p's Noise XX handshake and framed transport.

Pure state machines (CONTRIBUTING.md, "Protocols are pure state machines"), per the
libp2p noise spec (r2+: no padding in payloads) and the Noise Protocol Framework rev 34
("Noise §x"): ``Noise_XX_25519_ChaChaPoly_SHA256``, empty prologue, every message
behind a 2-byte big-endian length. Messages 2 and 3 carry a ``NoiseHandshakePayload``:
the sender's libp2p public key and its signature of ``"noise-libp2p-static-key:" || s``,
binding the Noise static key ``s`` to the PeerID.

The same handshake with the AESGCM cipher function (Noise §12.4,
``Noise_XX_25519_AESGCM_SHA256``) is offered under our own protocol id, ``AESGCM_NOISE``:
on CPUs with AES instructions it costs a fifth of ChaChaPoly's CPU per byte, and bulk
transfers between our peers are bound by that CPU. The handshake is the libp2p spec's;
our id adds two rules. Transport frames carry up to 2 MiB behind 4-byte length prefixes
(Noise §3's 65535-byte cap is a framing rule; AES-GCM takes far longer messages): bulk
data pays the per-frame work 32 times less, and an all-reduce chunk travels as one
frame, encrypted and decrypted in pieces where it lies (GCM's streaming interface), so
no layer joins or copies it. And each direction rekeys (Noise §11.3, with Noise's
default REKEY) after every 2^17 transport frames, at most 256 GiB per key, so a
long-lived connection stays inside AES-GCM's per-key data limits (RFC 8446 §5.5 puts
the 2^-57 safety margin at about 2^38 bytes). libp2p's ``/noise`` never rekeys.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import AEADDecryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from peers.errors import HandshakeError, IdentityError, LocalProtocolError, PeerIDMismatch
from peers.identity import KeyPair, PeerID, PublicKey
from peers.protobuf import ProtobufError, decode_fields, encode_fields, first_bytes

NOISE_PROTOCOL_ID = "/noise"
#: Noise §3: "The maximum length of a Noise message is 65535 bytes" (= the prefix's limit).
MAX_NOISE_FRAME_BYTES = 65535
#: ChaChaPoly authentication tag (Noise §12.3).
TAG_BYTES = 16
MAX_PLAINTEXT_PER_FRAME = MAX_NOISE_FRAME_BYTES - TAG_BYTES
#: X25519 public keys and shared secrets: Noise's DHLEN (Noise §12.1).
DH_BYTES = 32
#: libp2p noise spec, "Static Key Authentication": what the identity key signs before ``s``.
STATIC_KEY_SIGNATURE_PREFIX = b"noise-libp2p-static-key:"
#: Shortest messages 1, 2, 3 (keys, tags, empty payload); anything shorter is truncated.
_MIN_MESSAGE_BYTES = (DH_BYTES, 2 * DH_BYTES + 2 * TAG_BYTES, DH_BYTES + 2 * TAG_BYTES)
#: Noise §5.1: nonce 2^64-1 is reserved, so a CipherState stops before it.
_MAX_NONCE = 2**64 - 1
_LENGTH = struct.Struct(">H")
#: update_into wants this many bytes of room past its input (a cipher block less one).
_BLOCK_SLACK = 15
#: Messages shorter than this are joined and encrypted in one call, even with AES-GCM.
_STREAM_MIN_BYTES = 16 * 1024
#: Noise §5.2: the hash's output length; shorter protocol names are padded to it.
_HASH_BYTES = 32
_Bytes = bytes | bytearray | memoryview
_BAD_MAC = "MAC check failed: tampered, replayed or reordered message"


@dataclass(frozen=True, slots=True)
class NoiseCipher:
    """A Noise cipher function (Noise §12) and the multistream id that selects it."""

    name: str
    """The cipher's name in the Noise protocol name, and in ``PeerConfig.noise_ciphers``."""
    protocol_id: str
    """What the dialer proposes with multistream-select to use this cipher."""
    protocol_name: bytes
    """The full Noise protocol name, which seeds the handshake hash."""
    aead: Callable[[bytes], ChaCha20Poly1305 | AESGCM]
    """The AEAD, from a 32-byte key."""
    nonce: struct.Struct
    """How a 64-bit nonce becomes the AEAD's 96-bit one."""
    rekey_every: int | None = None
    """Messages after which each direction's key is replaced by REKEY(key); None: never."""
    frame_prefix: struct.Struct = _LENGTH
    """The length prefix of a transport frame (handshake messages always have 2 bytes)."""
    max_frame_bytes: int = MAX_NOISE_FRAME_BYTES
    """The longest transport frame, tag included."""
    streams: bool = False
    """AES-GCM: a frame is encrypted and decrypted in pieces, never joined or collected."""


#: libp2p's ``/noise``: ChaChaPoly, nonce = 32 bits of zeros, then 64 bits little-endian
#: (Noise §12.3). What go-libp2p, rust-libp2p and py-libp2p speak.
CHACHAPOLY_NOISE = NoiseCipher(
    name="ChaChaPoly",
    protocol_id=NOISE_PROTOCOL_ID,
    protocol_name=b"Noise_XX_25519_ChaChaPoly_SHA256",
    aead=ChaCha20Poly1305,
    nonce=struct.Struct("<4xQ"),
)
#: AES-256-GCM, nonce = 32 bits of zeros, then 64 bits big-endian (Noise §12.4); ours.
#: Transport frames of up to 2 MiB behind 4-byte prefixes, rekeyed every 2^17 frames
#: (at most 256 GiB per key).
AESGCM_NOISE = NoiseCipher(
    name="AESGCM",
    protocol_id="/swarmtrain/noise-aesgcm/2.0.0",
    protocol_name=b"Noise_XX_25519_AESGCM_SHA256",
    aead=AESGCM,
    nonce=struct.Struct(">4xQ"),
    rekey_every=1 << 17,
    frame_prefix=struct.Struct(">I"),
    max_frame_bytes=1 << 21,
    streams=True,
)
#: By name, in the default order of preference.
NOISE_CIPHERS = {cipher.name: cipher for cipher in (AESGCM_NOISE, CHACHAPOLY_NOISE)}


def fresh_buffer(num_bytes: int) -> memoryview:
    """A writable byte buffer that nothing else refers to, not zeroed first:
    ``bytearray(n)`` writes n zeros, which costs as much as the decryption that then
    overwrites them."""
    return memoryview(np.empty(num_bytes, np.uint8).data)


class NoiseError(HandshakeError):
    """The remote broke Noise: bad MAC, bad signature, malformed payload or wrong length."""


def _hkdf2(chaining_key: bytes, input_key_material: bytes) -> tuple[bytes, bytes]:
    """HKDF with two outputs, as Noise §4.3 builds it from HMAC-SHA256."""
    temp_key = hmac.digest(chaining_key, input_key_material, "sha256")
    output1 = hmac.digest(temp_key, b"\x01", "sha256")
    return output1, hmac.digest(temp_key, output1 + b"\x02", "sha256")


def _dh(private_key: X25519PrivateKey, public_key: bytes) -> bytes:
    try:
        return private_key.exchange(X25519PublicKey.from_public_bytes(public_key))
    except ValueError as e:  # all-zero shared secret: the remote sent a low-order point
        raise NoiseError(f"remote sent an unusable X25519 public key: {e}") from e


class CipherState:
    """Noise §5.1, always keyed: keyless is ``None`` in SymmetricState, never a transport."""

    __slots__ = ("_aead", "_key", "_pack_nonce", "_rekey_at", "cipher", "nonce")

    def __init__(self, key: bytes, cipher: NoiseCipher = CHACHAPOLY_NOISE) -> None:
        self.cipher = cipher
        self._key = key
        self._aead = cipher.aead(key)
        self._pack_nonce = cipher.nonce.pack
        self.nonce = 0
        self._rekey_at = cipher.rekey_every or _MAX_NONCE  # the nonce that gets a new key

    def encrypt_with_ad(self, ad: bytes | None, plaintext: _Bytes) -> bytes:
        """Encrypt, advance the nonce; LocalProtocolError when the nonces run out."""
        ciphertext = self._aead.encrypt(self._pack_nonce(self._send_nonce()), plaintext, ad)
        self._advance()
        return ciphertext

    def encrypt_pieces(self, pieces: list[_Bytes], size: int) -> list[_Bytes]:
        """One transport message (no associated data) whose plaintext is ``pieces``
        concatenated (``size`` bytes): the ciphertext as buffers, tag last. AES-GCM
        encrypts large messages piece by piece; otherwise the pieces are joined."""
        nonce = self._pack_nonce(self._send_nonce())
        out: list[_Bytes]
        if len(pieces) > 1 and self.cipher.streams and size >= _STREAM_MIN_BYTES:
            encryptor = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
            out = [encryptor.update(piece) for piece in pieces]
            encryptor.finalize()
            out.append(encryptor.tag)
        else:
            plaintext = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            out = [self._aead.encrypt(nonce, plaintext, None)]
        self._advance()
        return out

    def _send_nonce(self) -> int:
        if self.nonce >= _MAX_NONCE:
            raise LocalProtocolError("Noise nonce space exhausted; close the connection")
        return self.nonce

    def _advance(self) -> None:
        self.nonce = n = self.nonce + 1
        if n == self._rekey_at:
            self._rekey()

    def _rekey(self) -> None:
        """Noise §4.2's default REKEY(k): the first 32 bytes of ENCRYPT(k, maxnonce,
        zerolen, zeros). The nonce runs on (Noise §11.3)."""
        self._key = self._aead.encrypt(self._pack_nonce(_MAX_NONCE), bytes(32), b"")[:32]
        self._aead = self.cipher.aead(self._key)
        self._rekey_at += self.cipher.rekey_every or _MAX_NONCE

    def decrypt_with_ad(self, ad: bytes | None, ciphertext: _Bytes) -> bytes:
        """Decrypt, advance the nonce; on failure NoiseError, nonce unchanged (Noise §5.1)."""
        try:
            plaintext = self._aead.decrypt(self._pack_nonce(self._receive_nonce()), ciphertext, ad)
        except InvalidTag as e:
            raise NoiseError(_BAD_MAC) from e
        self._advance()
        return plaintext

    def decrypt_to_buffer(self, ciphertext: _Bytes) -> memoryview:
        """As :meth:`decrypt_with_ad` without associated data, into a fresh writable
        buffer (see :func:`fresh_buffer`)."""
        nonce = self._pack_nonce(self._receive_nonce())
        plaintext = fresh_buffer(len(ciphertext) - TAG_BYTES)
        try:
            self._aead.decrypt_into(nonce, ciphertext, None, plaintext)
        except InvalidTag as e:
            raise NoiseError(_BAD_MAC) from e
        self._advance()
        return plaintext

    def decryptor(self) -> AEADDecryptionContext | None:
        """For AES-GCM, a streaming decryption of the next message (hand it to
        :meth:`finish_decryptor` with the tag); None for ciphers without one."""
        if not self.cipher.streams:
            return None
        nonce = self._pack_nonce(self._receive_nonce())
        return Cipher(algorithms.AES(self._key), modes.GCM(nonce)).decryptor()

    def finish_decryptor(self, decryptor: AEADDecryptionContext, tag: bytes) -> None:
        """Check the tag of a :meth:`decryptor`'s message and advance the nonce; on
        failure NoiseError, nonce unchanged."""
        try:
            decryptor.finalize_with_tag(tag)
        except InvalidTag as e:
            raise NoiseError(_BAD_MAC) from e
        self._advance()

    def _receive_nonce(self) -> int:
        if self.nonce >= _MAX_NONCE:
            raise NoiseError("remote sent more messages than the Noise nonce space allows")
        return self.nonce


class SymmetricState:
    """Noise §5.2: chaining key ``ck``, handshake hash ``h`` and the current CipherState."""

    __slots__ = ("chaining_key", "cipher", "cipher_function", "handshake_hash")

    def __init__(self, prologue: bytes, cipher_function: NoiseCipher) -> None:
        # InitializeSymmetric(): a name of at most HASHLEN bytes is padded with zeros to
        # HASHLEN, a longer one hashed (none of ours is).
        name = cipher_function.protocol_name
        if len(name) > _HASH_BYTES:
            name = hashlib.sha256(name).digest()
        self.handshake_hash = self.chaining_key = name.ljust(_HASH_BYTES, b"\0")
        self.cipher_function = cipher_function
        self.cipher: CipherState | None = None  # no key before the first MixKey()
        self.mix_hash(prologue)  # Noise §5.3 Initialize()

    def mix_key(self, input_key_material: bytes) -> None:
        self.chaining_key, temp_key = _hkdf2(self.chaining_key, input_key_material)
        self.cipher = CipherState(temp_key, self.cipher_function)

    def mix_hash(self, data: bytes) -> None:
        self.handshake_hash = hashlib.sha256(self.handshake_hash + data).digest()

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        cipher, h = self.cipher, self.handshake_hash
        ciphertext = cipher.encrypt_with_ad(h, plaintext) if cipher is not None else plaintext
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        cipher, h = self.cipher, self.handshake_hash
        plaintext = cipher.decrypt_with_ad(h, ciphertext) if cipher is not None else ciphertext
        self.mix_hash(ciphertext)
        return plaintext


class XXHandshakeState:
    """Noise §5.3 HandshakeState for the XX pattern (Noise §7.5): opaque payloads, no
    length prefixes. After an error it is unusable (the handshake must be abandoned)."""

    def __init__(
        self,
        *,
        initiator: bool,
        s: X25519PrivateKey,
        e: X25519PrivateKey,
        prologue: bytes = b"",
        cipher: NoiseCipher = CHACHAPOLY_NOISE,
    ) -> None:
        self.initiator = initiator
        self._s, self._e = s, e
        self.static_public = s.public_key().public_bytes_raw()
        self.remote_static: bytes | None = None  # rs, once message 2 or 3 is read
        self._re = b""
        self._symmetric = SymmetricState(prologue, cipher)
        self.message_index = 0  # which of the three messages comes next; 3 when done
        self.failed = False  # set by a failed read, or by a failed check above Noise

    @property
    def our_turn(self) -> bool:
        """True when the next message is ours to write (the initiator writes 1 and 3)."""
        index = self.message_index
        return not self.failed and index < 3 and (index % 2 == 0) == self.initiator

    @property
    def is_complete(self) -> bool:
        return not self.failed and self.message_index == 3

    @property
    def handshake_hash(self) -> bytes:
        return self._symmetric.handshake_hash

    def _check_turn(self, writing: bool) -> None:
        if self.our_turn != writing or self.failed or self.message_index >= 3:
            done = "it is complete" if self.message_index >= 3 else "it is the other side's turn"
            why = "it failed" if self.failed else done
            raise LocalProtocolError(f"cannot {'write' if writing else 'read'} Noise: {why}")

    def write_message(self, payload: bytes) -> bytes:
        """The next message, without length prefix; :class:`LocalProtocolError` if not ours,
        :class:`NoiseError` if the remote's ephemeral key is a low-order point."""
        self._check_turn(writing=True)
        if len(payload) > MAX_NOISE_FRAME_BYTES - _MIN_MESSAGE_BYTES[1]:  # before any change
            raise LocalProtocolError(f"handshake payload of {len(payload)} bytes is too long")
        self.failed = True  # until the message is written (a DH with the remote's e can fail)
        sym, parts = self._symmetric, []
        if self.message_index < 2:  # -> e  |  <- e, ee, s, es
            e_public = self._e.public_key().public_bytes_raw()
            sym.mix_hash(e_public)
            parts.append(e_public)
            if self.message_index == 1:
                sym.mix_key(_dh(self._e, self._re))
                parts.append(sym.encrypt_and_hash(self.static_public))
                sym.mix_key(_dh(self._s, self._re))
        else:  # -> s, se
            parts.append(sym.encrypt_and_hash(self.static_public))
            sym.mix_key(_dh(self._s, self._re))
        parts.append(sym.encrypt_and_hash(payload))
        self.message_index += 1
        self.failed = False
        return b"".join(parts)

    def read_message(self, message: bytes) -> bytes:
        """The payload of the remote's message (no length prefix). Raises :class:`NoiseError`
        for a bad length or MAC, :class:`LocalProtocolError` if it is not the remote's turn."""
        self._check_turn(writing=False)
        self.failed = True  # until the whole message has checked out
        index, sym = self.message_index, self._symmetric
        if not _MIN_MESSAGE_BYTES[index] <= len(message) <= MAX_NOISE_FRAME_BYTES:
            raise NoiseError(f"handshake message {index + 1} has a bad length {len(message)}")
        offset = 0
        if index < 2:  # e [, ee]
            self._re, offset = bytes(message[:DH_BYTES]), DH_BYTES
            sym.mix_hash(self._re)
            if index == 1:
                sym.mix_key(_dh(self._e, self._re))
        if index > 0:  # s, then es (the initiator reading) or se (the responder reading)
            end = offset + DH_BYTES + TAG_BYTES
            self.remote_static = sym.decrypt_and_hash(bytes(message[offset:end]))
            sym.mix_key(_dh(self._e, self.remote_static))
            offset = end
        payload = sym.decrypt_and_hash(bytes(message[offset:]))
        self.message_index += 1
        self.failed = False
        return payload

    def split(self) -> tuple[CipherState, CipherState]:
        """Noise §5.2 Split(): the initiator's and the responder's sending CipherStates."""
        if not self.is_complete:
            raise LocalProtocolError("the Noise handshake is not complete")
        key1, key2 = _hkdf2(self._symmetric.chaining_key, b"")
        cipher = self._symmetric.cipher_function
        return CipherState(key1, cipher), CipherState(key2, cipher)


def _x25519_key(raw: bytes | None) -> X25519PrivateKey:
    if raw is None:
        return X25519PrivateKey.generate()
    if len(raw) != DH_BYTES:
        raise IdentityError(f"an X25519 private key has 32 bytes, got {len(raw)}")
    return X25519PrivateKey.from_private_bytes(raw)


@dataclass(frozen=True, eq=False)
class NoiseStaticKey:
    """A peer's Noise static key with its identity payload (the public identity key and
    its signature of ``"noise-libp2p-static-key:" || s``), made once and used for every
    handshake. Without one, each handshake makes and signs a fresh static key: an X25519
    key generation and an Ed25519 signature that anyone can make us spend by opening a
    TCP connection and sending 32 bytes. Forward secrecy comes from the ephemeral keys,
    which stay fresh per handshake (Noise §7.5: ``s`` is long-term)."""

    private_key: X25519PrivateKey
    payload: bytes
    peer_id: PeerID
    """Whose identity the payload proves."""

    @classmethod
    def create(cls, identity: KeyPair, private_key: bytes | None = None) -> NoiseStaticKey:
        """A static key for ``identity``: fresh, or the raw 32 bytes (deterministic tests)."""
        key = _x25519_key(private_key)
        public = key.public_key().public_bytes_raw()
        signature = identity.sign(STATIC_KEY_SIGNATURE_PREFIX + public)
        payload = encode_fields([(1, identity.public_key.to_protobuf()), (2, signature)])
        return cls(key, payload, identity.peer_id)


class NoiseHandshake:
    """libp2p's Noise XX handshake: the Noise state machine plus the identity payloads.

    The caller moves the bytes: while :attr:`our_turn`, send :meth:`write_message`;
    otherwise read one length-prefixed message and pass its body to :meth:`read_message`.
    Any error ends the handshake; later calls raise :class:`LocalProtocolError`.
    """

    def __init__(
        self,
        *,
        initiator: bool,
        identity: KeyPair,
        expected_peer_id: PeerID | None = None,
        cipher: NoiseCipher = CHACHAPOLY_NOISE,
        static: NoiseStaticKey | None = None,
        static_private_key: bytes | None = None,
        ephemeral_private_key: bytes | None = None,
    ) -> None:
        """``cipher`` is the one multistream-select agreed on. ``static``: ``identity``'s
        long-term static key (:meth:`NoiseStaticKey.create`); without it, a fresh one,
        or the raw 32 bytes of ``static_private_key``. The raw X25519 keys are for
        deterministic tests. Raises :class:`IdentityError` for a key of the wrong length,
        :class:`ValueError` for both ``static`` and ``static_private_key``."""
        if static is None:
            static = NoiseStaticKey.create(identity, static_private_key)
        elif static_private_key is not None:
            raise ValueError("give static or static_private_key, not both")
        elif static.peer_id != identity.peer_id:
            raise ValueError("the static key was made for another identity")
        self._state = XXHandshakeState(
            initiator=initiator,
            s=static.private_key,
            e=_x25519_key(ephemeral_private_key),
            cipher=cipher,
        )
        self._payload = static.payload
        self._expected_peer_id = expected_peer_id
        self._remote_public_key: PublicKey | None = None
        self._remote_peer_id: PeerID | None = None
        self._transport_taken = False

    @property
    def our_turn(self) -> bool:
        return self._state.our_turn

    @property
    def is_complete(self) -> bool:
        return self._state.is_complete and self._remote_peer_id is not None

    @property
    def remote_peer_id(self) -> PeerID:
        """The remote's authenticated PeerID; :class:`LocalProtocolError` before that."""
        if self._remote_peer_id is None:
            raise LocalProtocolError("the remote's identity is not authenticated yet")
        return self._remote_peer_id

    @property
    def remote_public_key(self) -> PublicKey:
        """The remote's authenticated identity key; :class:`LocalProtocolError` before that."""
        if self._remote_public_key is None:
            raise LocalProtocolError("the remote's identity is not authenticated yet")
        return self._remote_public_key

    def write_message(self) -> bytes:
        """Our next handshake message, length-prefixed; LocalProtocolError if not our turn."""
        state = self._state
        # messages 2 and 3 identify us; message 1's payload is empty
        payload = self._payload if state.our_turn and state.message_index > 0 else b""
        message = state.write_message(payload)
        return _LENGTH.pack(len(message)) + message

    def read_message(self, message: bytes) -> None:
        """Process one handshake message from the remote, without its length prefix.

        Raises :class:`NoiseError` (malformed, bad MAC or identity signature),
        :class:`PeerIDMismatch` (not ``expected_peer_id``), :class:`LocalProtocolError`
        (not the remote's turn)."""
        payload = self._state.read_message(message)
        if self._state.message_index == 1:
            return  # message 1's payload is empty by spec, and unauthenticated: ignore it
        try:
            self._accept_identity(payload)
        except Exception:
            self._state.failed = True
            raise

    def _accept_identity(self, payload: bytes) -> None:
        # Fields 3 (the old early data) and 4 (extensions) are not used here: ignored.
        try:
            fields = decode_fields(payload)
            key_bytes, signature = first_bytes(fields, 1), first_bytes(fields, 2)
            if key_bytes is None or signature is None:
                raise NoiseError("handshake payload lacks identity_key or identity_sig")
            public_key = PublicKey.from_protobuf(key_bytes)
        except (ProtobufError, IdentityError) as e:
            raise NoiseError(f"malformed handshake payload: {e}") from e
        remote_static = self._state.remote_static
        assert remote_static is not None  # read just before the payload
        if not public_key.verify(signature, STATIC_KEY_SIGNATURE_PREFIX + remote_static):
            raise NoiseError("identity_sig is not the identity key's signature of the static key")
        peer_id = PeerID.from_public_key(public_key)
        if self._expected_peer_id is not None and peer_id != self._expected_peer_id:
            raise PeerIDMismatch(f"dialed {self._expected_peer_id}, but the remote is {peer_id}")
        self._remote_public_key, self._remote_peer_id = public_key, peer_id

    def to_transport(self) -> NoiseTransport:
        """The transport, once, after a complete handshake; raises
        :class:`LocalProtocolError` otherwise (two transports would reuse nonces)."""
        if not self.is_complete or self._transport_taken:
            raise LocalProtocolError("the handshake is not complete or already handed over")
        self._transport_taken = True
        initiator_sends, responder_sends = self._state.split()  # Noise §5.2 Split()
        if self._state.initiator:
            return NoiseTransport(send=initiator_sends, receive=responder_sends)
        return NoiseTransport(send=responder_sends, receive=initiator_sends)


class NoiseTransport:
    """Noise transport messages behind length prefixes, in both directions.

    The prefix and the largest frame are the cipher's: libp2p's ``/noise`` has 2-byte
    prefixes and frames of at most 65535 bytes (Noise §3); ours has 4-byte prefixes and
    frames of up to 2 MiB, so a bulk transfer pays the per-frame work 32 times less.

    Bounded by construction (CONTRIBUTING.md, "Bound everything a peer controls"):
    every complete frame is decrypted as soon as it arrives, so the receive side holds
    at most one partial frame (at most its cipher's ``max_frame_bytes``, which a prefix
    announcing more never gets to allocate). Every plaintext comes back as a fresh
    writable buffer that the caller owns.
    """

    __slots__ = (
        "_head",
        "_max_frame",
        "_partial",
        "_prefix",
        "_receive",
        "_receive_failed",
        "_send",
        "max_plaintext",
    )

    def __init__(self, *, send: CipherState, receive: CipherState) -> None:
        if send.cipher is not receive.cipher:
            raise ValueError("both directions of a Noise transport use one cipher")
        self._send, self._receive = send, receive
        cipher = send.cipher
        self._prefix, self._max_frame = cipher.frame_prefix, cipher.max_frame_bytes
        self.max_plaintext = cipher.max_frame_bytes - TAG_BYTES
        """The most plaintext bytes one frame carries."""
        self._head = bytearray()  # an incomplete length prefix
        self._partial: _PartialFrame | None = None
        self._receive_failed = False

    def encrypt(self, data: _Bytes) -> bytes:
        """Wire bytes for ``data``: length-prefixed frames of at most ``max_plaintext``
        plaintext bytes each. Empty ``data`` gives ``b""``: no empty frame is sent."""
        view = memoryview(data).cast("B")  # byte lengths, without copying ``data``
        return b"".join(self.encrypt_frames([view] if view else []))

    def encrypt_frames(self, messages: Sequence[_Bytes | tuple[_Bytes, ...]]) -> list[_Bytes]:
        """Wire buffers for ``messages`` sent in order: consecutive messages share a Noise
        frame while they fit in one; a message longer than a frame is split.

        A message may be a tuple of buffers, sent as if concatenated (a yamux header and
        the pieces of its payload): with AES-GCM they are encrypted where they lie, never
        joined. Returns the length prefixes and ciphertexts as separate buffers for
        ``writelines``, so no buffer larger than one frame is ever built.
        """
        limit = self.max_plaintext
        out: list[_Bytes] = []
        pending: list[_Bytes] = []
        pending_bytes = 0
        for message in messages:
            pieces = message if isinstance(message, tuple) else (message,)
            size = sum(map(len, pieces)) if len(pieces) > 1 else len(pieces[0])
            if pending_bytes + size > limit and pending:
                self._encrypt_frame(pending, pending_bytes, out)
                pending, pending_bytes = [], 0
            if size <= limit:
                pending += pieces
                pending_bytes += size
                continue
            view = memoryview(b"".join(pieces) if len(pieces) > 1 else pieces[0]).cast("B")
            for start in range(0, size, limit):
                piece = view[start : start + limit]
                self._encrypt_frame([piece], len(piece), out)
        if pending_bytes:
            self._encrypt_frame(pending, pending_bytes, out)
        return out

    def _encrypt_frame(self, pieces: list[_Bytes], size: int, out: list[_Bytes]) -> None:
        out.append(self._prefix.pack(size + TAG_BYTES))
        out += self._send.encrypt_pieces(pieces, size)

    def decrypt_frame(self, frame: _Bytes) -> memoryview:
        """Decrypt the next frame body (no length prefix). :class:`NoiseError` when it is
        shorter than a tag, too long, or fails the MAC (tampered, replayed, reordered)."""
        if not TAG_BYTES <= len(frame) <= self._max_frame:
            raise NoiseError(f"Noise transport frame of {len(frame)} bytes")
        return self._receive.decrypt_to_buffer(frame)

    def receive_data(self, data: _Bytes) -> bytes:
        """Feed wire bytes split anywhere; return the plaintext of every frame completed.

        Raises :class:`NoiseError` on a bad frame; the stream is then unusable and later
        calls raise :class:`LocalProtocolError`.
        """
        return b"".join(self.receive_frames(data))

    def receive_frames(self, data: _Bytes) -> list[memoryview]:
        """As :meth:`receive_data`, but the plaintexts one per frame, not joined, each a
        fresh writable buffer that nothing else refers to."""
        if self._receive_failed:
            raise LocalProtocolError("the Noise receive stream already failed")
        self._receive_failed = True  # until this call has succeeded
        view = memoryview(data).cast("B")
        out: list[memoryview] = []
        prefix, prefix_bytes, max_frame = self._prefix, self._prefix.size, self._max_frame
        if self._partial is not None:  # finish the frame begun in an earlier call
            view = self._continue_partial(view, out)
        elif self._head:  # finish a split length prefix
            take = prefix_bytes - len(self._head)
            self._head += view[:take]
            view = view[take:]
            if len(self._head) == prefix_bytes:
                length = prefix.unpack(self._head)[0]
                self._head.clear()
                self._check_length(length)
                self._partial = _PartialFrame(self._receive, length)
                view = self._continue_partial(view, out)
        # Whole frames straight from the caller's bytes, without copying them first.
        decrypt, unpack_from = self._receive.decrypt_to_buffer, prefix.unpack_from
        offset, end_of_data = 0, len(view)
        while end_of_data - offset >= prefix_bytes:
            length = unpack_from(view, offset)[0]
            if not TAG_BYTES <= length <= max_frame:
                self._check_length(length)
            start = offset + prefix_bytes
            end = start + length
            if end > end_of_data:  # the rest of this frame comes later
                self._partial = _PartialFrame(self._receive, length)
                self._continue_partial(view[start:], out)
                offset = end_of_data
                break
            out.append(decrypt(view[start:end]))
            offset = end
        if offset < end_of_data:
            self._head += view[offset:]
        self._receive_failed = False
        return out

    def _check_length(self, length: int) -> None:
        if not TAG_BYTES <= length <= self._max_frame:
            raise NoiseError(f"Noise transport frame of {length} bytes (at most {self._max_frame})")

    def _continue_partial(self, view: memoryview, out: list[memoryview]) -> memoryview:
        """Feed the partial frame; return what follows it in ``view``."""
        partial = self._partial
        assert partial is not None
        take = min(len(view), partial.remaining)
        partial.feed(view[:take])
        if not partial.remaining:
            self._partial = None
            out.append(partial.finish())
        return view[take:]


class _PartialFrame:
    """A frame whose bytes arrive over several reads. With AES-GCM each piece is
    decrypted as it comes (GCM's streaming interface; the plaintext is released only
    after the tag checks out); otherwise the ciphertext is collected, then decrypted."""

    __slots__ = ("_collected", "_decryptor", "_plain", "_receive", "_tag", "_written", "remaining")

    def __init__(self, receive: CipherState, length: int) -> None:
        self._receive, self.remaining = receive, length
        self._written = 0
        self._tag = bytearray()
        self._decryptor = receive.decryptor()
        self._collected = bytearray()
        # update_into wants room for a cipher block more than each input: cut off after.
        self._plain = fresh_buffer(length - TAG_BYTES + _BLOCK_SLACK) if self._decryptor else None

    def feed(self, piece: memoryview) -> None:
        before = self.remaining
        self.remaining -= len(piece)
        if self._decryptor is None or self._plain is None:
            self._collected += piece
            return
        # The tag is the frame's last TAG_BYTES: which of them this piece holds.
        tag_bytes = max(0, TAG_BYTES - self.remaining) - max(0, TAG_BYTES - before)
        body = len(piece) - tag_bytes
        if body > 0:
            self._written += self._decryptor.update_into(piece[:body], self._plain[self._written :])
            piece = piece[body:]
        self._tag += piece

    def finish(self) -> memoryview:
        if self._decryptor is None or self._plain is None:
            return self._receive.decrypt_to_buffer(self._collected)
        plaintext_bytes = len(self._plain) - _BLOCK_SLACK
        self._receive.finish_decryptor(self._decryptor, bytes(self._tag))
        if self._written != plaintext_bytes:  # GCM writes as it reads; never seen
            raise NoiseError("AES-GCM decryption left bytes behind")
        return self._plain[:plaintext_bytes]
