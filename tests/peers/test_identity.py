"""Identity: libp2p peer-id spec vectors, key files, and their failure modes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from peers import IdentityError, KeyPair, KeyType, PeerID, PublicKey
from peers import identity as identity_module

# libp2p specs, peer-ids/peer-ids.md, "Test vectors" (hex of the protobuf encodings).
SPEC_ED25519_PRIVATE = bytes.fromhex(
    "080112407e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d1ed1e8fae2c4a144"
    "b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
SPEC_ED25519_PUBLIC = bytes.fromhex(
    "080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
SPEC_SECP256K1_PUBLIC = bytes.fromhex(
    "08021221037777e994e452c21604f91de093ce415f5432f701dd8cd1a7a6fea0e630bfca99"
)


def test_spec_vector_ed25519_private_to_public() -> None:
    pair = KeyPair.from_protobuf(SPEC_ED25519_PRIVATE)
    assert pair.public_key.to_protobuf() == SPEC_ED25519_PUBLIC
    assert pair.to_protobuf() == SPEC_ED25519_PRIVATE


def test_spec_vector_ed25519_peer_id_is_identity_multihash() -> None:
    key = PublicKey.from_protobuf(SPEC_ED25519_PUBLIC)
    peer_id = PeerID.from_public_key(key)
    # identity multihash: code 0x00, length 36, then the 36-byte protobuf.
    assert peer_id.to_bytes() == b"\x00\x24" + SPEC_ED25519_PUBLIC
    assert peer_id.to_base58() == "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"
    assert PeerID.from_base58(peer_id.to_base58()) == peer_id
    assert peer_id.inline_public_key() == key


def test_spec_vector_secp256k1_public_key_parses() -> None:
    key = PublicKey.from_protobuf(SPEC_SECP256K1_PUBLIC)
    assert key.key_type is KeyType.SECP256K1
    assert key.to_protobuf() == SPEC_SECP256K1_PUBLIC
    # 37 bytes: still inlined with the identity multihash.
    assert PeerID.from_public_key(key).to_bytes()[0] == 0x00


def test_long_keys_are_hashed_with_sha256() -> None:
    key = PublicKey(KeyType.RSA, b"\x30" * 300)
    raw = PeerID.from_public_key(key).to_bytes()
    assert raw[:2] == b"\x12\x20" and len(raw) == 34
    assert PeerID.from_public_key(key).to_base58().startswith("Qm")


def test_peer_id_matches_hivemind_derivation() -> None:
    hivemind_p2p = pytest.importorskip("hivemind.p2p", reason="hivemind not installed")
    pair = KeyPair.generate()
    theirs = hivemind_p2p.PeerID.from_base58(pair.peer_id.to_base58())
    assert theirs.to_bytes() == pair.peer_id.to_bytes()


def test_sign_and_verify() -> None:
    pair = KeyPair.generate()
    signature = pair.sign(b"message")
    assert pair.public_key.verify(signature, b"message")
    assert not pair.public_key.verify(signature, b"other message")
    assert not KeyPair.generate().public_key.verify(signature, b"message")


def test_a_good_signature_is_checked_once_and_remembered_for_that_key_and_data_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks: list[bytes] = []
    real_check = PublicKey._check

    def counting(self: PublicKey, signature: bytes, data: bytes) -> bool:
        checks.append(data)
        return real_check(self, signature, data)

    monkeypatch.setattr(PublicKey, "_check", counting)
    pair, other = KeyPair.generate(), KeyPair.generate()
    signature = pair.sign(b"record")
    assert pair.public_key.verify(signature, b"record", remember=True)
    assert pair.public_key.verify(signature, b"record", remember=True)
    assert checks == [b"record"]  # the second answer came from the cache
    # What was remembered vouches for nothing else: another key, message or signature.
    assert not other.public_key.verify(signature, b"record", remember=True)
    assert not pair.public_key.verify(signature, b"recorc", remember=True)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    assert not pair.public_key.verify(forged, b"record", remember=True)
    assert not pair.public_key.verify(forged, b"record", remember=True)  # refused again, not cached
    assert len(checks) == 5
    assert not pair.public_key.verify("not bytes", b"record", remember=True)  # type: ignore[arg-type]
    handshake = pair.sign(b"handshake")
    assert pair.public_key.verify(handshake, b"handshake")
    assert pair.public_key.verify(handshake, b"handshake")
    assert checks[-2:] == [b"handshake", b"handshake"]  # not asked to remember: checked each time


def test_the_signature_cache_is_bounded_and_forgets_the_oldest() -> None:
    cache = identity_module._VerifiedSignatures(2)
    for digest in (b"a", b"b", b"c"):
        cache.add(digest)
    assert b"a" not in cache and b"b" in cache and b"c" in cache
    assert b"b" in cache  # a hit makes it the newest
    cache.add(b"d")
    assert b"c" not in cache and b"b" in cache


def test_key_file_round_trip_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    pair = KeyPair.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes() == pair.to_protobuf()
    assert KeyPair.load(path).peer_id == pair.peer_id
    assert KeyPair.load_or_create(path).peer_id == pair.peer_id


def test_key_file_matches_go_libp2p_format(tmp_path: Path) -> None:
    path = tmp_path / "spec.key"
    path.write_bytes(SPEC_ED25519_PRIVATE)
    assert str(KeyPair.load(path).peer_id) == "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "lacks its Type or Data"),
        (b"\xff\xff\xff", "malformed"),
        (b"not a key at all, just text\n", "malformed"),
        (SPEC_ED25519_PRIVATE[:-5], "malformed"),
        (
            bytes.fromhex(
                "0802122053DADF1D5A164D6B4ACDB15E24AA4C5B1D3461BDBD42ABEDB0A4404D56CED8FB"
            ),
            "SECP256K1",
        ),
        (SPEC_ED25519_PRIVATE[:-1] + b"\x00", "does not match"),
    ],
)
def test_corrupt_or_wrong_type_key_file_is_a_clear_error(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(IdentityError, match=message) as info:
        KeyPair.load(path)
    assert str(path) in str(info.value)


def test_missing_key_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="cannot read identity file"):
        KeyPair.load(tmp_path / "absent.key")


def test_saving_into_a_missing_directory_names_the_path_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    path = tmp_path / "no such dir" / "peer.key"
    with pytest.raises(IdentityError, match="cannot write identity file") as info:
        KeyPair.generate().save(path)
    assert str(path) in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", ["", "0OIl", "12D3KooW", "z" * 60])
def test_bad_peer_id_strings(text: str) -> None:
    with pytest.raises(IdentityError):
        PeerID.from_base58(text)
