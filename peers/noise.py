"""The ``/noise`` secure channel: libp2p's Noise XX handshake and framed transport.

Pure state machines (STYLE.md 1), per the libp2p noise spec (r2+: no padding in payloads)
and the Noise Protocol Framework rev 34 ("Noise §x"): ``Noise_XX_25519_ChaChaPoly_SHA256``,
empty prologue, every message behind a 2-byte big-endian length. Messages 2 and 3 carry a
``NoiseHandshakePayload``: the sender's libp2p public key and its signature of
``"noise-libp2p-static-key:" || s``, binding the Noise static key ``s`` to the PeerID.

The same handshake with the AESGCM cipher function (Noise §12.4,
``Noise_XX_25519_AESGCM_SHA256``) is offered under our own protocol id, ``AESGCM_NOISE``:
on CPUs with AES instructions it costs a fifth of ChaChaPoly's CPU per byte, and bulk
transfers between our peers are bound by that CPU. Everything else is the libp2p spec,
plus one rule our id adds: each direction rekeys (Noise §11.3, with Noise's default
REKEY) after every 2^20 transport messages, at most 64 GiB per key, so a long-lived
connection stays far inside AES-GCM's per-key data limits (RFC 8446 §5.5 puts the
2^-57 safety margin at about 2^38 bytes). libp2p's ``/noise`` never rekeys.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
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
#: Noise §5.2: the hash's output length; shorter protocol names are padded to it.
_HASH_BYTES = 32
_Bytes = bytes | bytearray | memoryview


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
AESGCM_NOISE = NoiseCipher(
    name="AESGCM",
    protocol_id="/swarmtrain/noise-aesgcm/1.0.0",
    protocol_name=b"Noise_XX_25519_AESGCM_SHA256",
    aead=AESGCM,
    nonce=struct.Struct(">4xQ"),
    rekey_every=1 << 20,
)
#: By name, in the default order of preference.
NOISE_CIPHERS = {cipher.name: cipher for cipher in (AESGCM_NOISE, CHACHAPOLY_NOISE)}


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

    __slots__ = ("_aead", "_cipher", "_pack_nonce", "_rekey_at", "nonce")

    def __init__(self, key: bytes, cipher: NoiseCipher = CHACHAPOLY_NOISE) -> None:
        self._cipher = cipher
        self._aead = cipher.aead(key)
        self._pack_nonce = cipher.nonce.pack
        self.nonce = 0
        self._rekey_at = cipher.rekey_every or _MAX_NONCE  # the nonce that gets a new key

    def encrypt_with_ad(self, ad: bytes | None, plaintext: _Bytes) -> bytes:
        """Encrypt, advance the nonce; LocalProtocolError when the nonces run out."""
        n = self.nonce
        if n >= _MAX_NONCE:
            raise LocalProtocolError("Noise nonce space exhausted; close the connection")
        ciphertext = self._aead.encrypt(self._pack_nonce(n), plaintext, ad)
        self.nonce = n = n + 1
        if n == self._rekey_at:
            self._rekey()
        return ciphertext

    def _rekey(self) -> None:
        """Noise §4.2's default REKEY(k): the first 32 bytes of ENCRYPT(k, maxnonce,
        zerolen, zeros). The nonce runs on (Noise §11.3)."""
        key = self._aead.encrypt(self._pack_nonce(_MAX_NONCE), bytes(32), b"")[:32]
        self._aead = self._cipher.aead(key)
        self._rekey_at += self._cipher.rekey_every or _MAX_NONCE

    def decrypt_with_ad(self, ad: bytes | None, ciphertext: _Bytes) -> bytes:
        """Decrypt, advance the nonce; on failure NoiseError, nonce unchanged (Noise §5.1)."""
        n = self.nonce
        if n >= _MAX_NONCE:
            raise NoiseError("remote sent more messages than the Noise nonce space allows")
        try:
            plaintext = self._aead.decrypt(self._pack_nonce(n), ciphertext, ad)
        except InvalidTag as e:
            raise NoiseError("MAC check failed: tampered, replayed or reordered message") from e
        self.nonce = n = n + 1
        if n == self._rekey_at:
            self._rekey()
        return plaintext


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
        static_private_key: bytes | None = None,
        ephemeral_private_key: bytes | None = None,
    ) -> None:
        """``cipher`` is the one multistream-select agreed on. The raw 32-byte X25519 keys
        are for deterministic tests; by default they are fresh. Raises
        :class:`IdentityError` for a key of the wrong length."""
        self._state = XXHandshakeState(
            initiator=initiator,
            s=_x25519_key(static_private_key),
            e=_x25519_key(ephemeral_private_key),
            cipher=cipher,
        )
        self._identity = identity
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
        state, payload = self._state, b""
        if state.our_turn and state.message_index > 0:  # messages 2 and 3 identify us
            signature = self._identity.sign(STATIC_KEY_SIGNATURE_PREFIX + state.static_public)
            payload = encode_fields([(1, self._identity.public_key.to_protobuf()), (2, signature)])
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
    """Noise transport messages behind 2-byte length prefixes, in both directions.

    Bounded by construction (STYLE.md 7): every complete frame is decrypted as soon as it
    arrives, so the receive buffer holds at most one partial frame (< 65537 bytes).
    """

    __slots__ = ("_buffer", "_receive", "_receive_failed", "_send")

    def __init__(self, *, send: CipherState, receive: CipherState) -> None:
        self._send, self._receive = send, receive
        self._buffer = bytearray()
        self._receive_failed = False

    def encrypt(self, data: _Bytes) -> bytes:
        """Wire bytes for ``data``: length-prefixed frames of at most MAX_PLAINTEXT_PER_FRAME
        plaintext bytes each. Empty ``data`` gives ``b""``: no empty frame is sent."""
        view = memoryview(data).cast("B")
        encrypt, pack = self._send.encrypt_with_ad, _LENGTH.pack
        parts: list[bytes] = []
        for start in range(0, len(view), MAX_PLAINTEXT_PER_FRAME):
            ciphertext = encrypt(None, view[start : start + MAX_PLAINTEXT_PER_FRAME])
            parts.append(pack(len(ciphertext)))
            parts.append(ciphertext)
        return b"".join(parts)

    def encrypt_frames(self, messages: list[bytes]) -> list[bytes]:
        """Wire buffers for ``messages`` sent in order: small consecutive messages share a
        Noise frame, each large one gets its own (split only past the frame limit).

        Returns the length prefixes and ciphertexts as separate buffers for
        ``writelines``, so no buffer larger than one frame is ever built.
        """
        encrypt, pack = self._send.encrypt_with_ad, _LENGTH.pack
        out: list[bytes] = []
        pending: list[bytes] = []
        pending_bytes = 0
        for message in messages:
            if pending_bytes + len(message) > MAX_PLAINTEXT_PER_FRAME and pending:
                ciphertext = encrypt(None, b"".join(pending))
                out += (pack(len(ciphertext)), ciphertext)
                pending, pending_bytes = [], 0
            if len(message) > MAX_PLAINTEXT_PER_FRAME:
                view = memoryview(message)
                for start in range(0, len(view), MAX_PLAINTEXT_PER_FRAME):
                    ciphertext = encrypt(None, view[start : start + MAX_PLAINTEXT_PER_FRAME])
                    out += (pack(len(ciphertext)), ciphertext)
            elif message:
                pending.append(message)
                pending_bytes += len(message)
        if pending:
            ciphertext = encrypt(None, pending[0] if len(pending) == 1 else b"".join(pending))
            out += (pack(len(ciphertext)), ciphertext)
        return out

    def decrypt_frame(self, frame: _Bytes) -> bytes:
        """Decrypt the next frame body (no length prefix). :class:`NoiseError` when it is
        shorter than a tag, too long, or fails the MAC (tampered, replayed, reordered)."""
        if not TAG_BYTES <= len(frame) <= MAX_NOISE_FRAME_BYTES:
            raise NoiseError(f"Noise transport frame of {len(frame)} bytes")
        return self._receive.decrypt_with_ad(None, frame)

    def receive_data(self, data: _Bytes) -> bytes:
        """Feed wire bytes split anywhere; return the plaintext of every frame completed.

        Raises :class:`NoiseError` on a bad frame; the stream is then unusable and later
        calls raise :class:`LocalProtocolError`.
        """
        return b"".join(self.receive_frames(data))

    def receive_frames(self, data: _Bytes) -> list[bytes]:
        """As :meth:`receive_data`, but the plaintexts one per frame, not joined."""
        if self._receive_failed:
            raise LocalProtocolError("the Noise receive stream already failed")
        self._receive_failed = True  # until this call has succeeded
        view, buffer = memoryview(data).cast("B"), self._buffer
        out: list[bytes] = []
        if buffer:  # finish the frame split across calls, copying only its own bytes
            if len(buffer) < 2:
                buffer += view[:1]
                view = view[1:]
            if len(buffer) >= 2:  # else ``view`` was empty
                take = 2 + (buffer[0] << 8 | buffer[1]) - len(buffer)
                buffer += view[:take]
                if len(view) >= take:
                    with memoryview(buffer) as body:
                        out.append(self.decrypt_frame(body[2:]))
                    buffer.clear()
                view = view[take:]  # empty when the frame is still incomplete
        # Whole frames straight from the caller's bytes, without copying them first.
        decrypt, offset, end_of_data = self.decrypt_frame, 0, len(view)
        while end_of_data - offset >= 2:
            end = offset + 2 + (view[offset] << 8 | view[offset + 1])
            if end > end_of_data:
                break
            out.append(decrypt(view[offset + 2 : end]))
            offset = end
        if offset < end_of_data:
            buffer += view[offset:]
        self._receive_failed = False
        return out
