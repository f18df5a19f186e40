"""Private networks (``PeerConfig.swarm_key``, :mod:`peers.pnet`), over real loopback
connections: peers sharing a key talk, directly and through a relay; a peer with
another key or none cannot complete a handshake either way and costs the members
nothing; the bytes on the wire are libp2p pnet's (a nonce, then XSalsa20), checked
by a client written here from the spec."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hashlib
import os
import stat
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from peers import Peer, PeerConfig, PeersError
from peers.connection import Stream
from peers.echo import ECHO_PROTOCOL_ID, install_echo
from peers.identity import PeerID
from peers.multistream import MULTISTREAM_PROTOCOL_ID
from peers.pnet import (
    NONCE_BYTES,
    SwarmKeyError,
    XSalsa20,
    format_swarm_key,
    load_swarm_key,
    new_swarm_key,
    parse_swarm_key,
    write_swarm_key,
)
from tests.peers.test_relay import reserved, wait_for

WAIT_SECONDS = 10.0

Run = Callable[[Coroutine[Any, Any, Any]], Any]

# NaCl's XSalsa20 test key and nonce ("firstkey", "nonce" of its tests/stream*.c).
FIRSTKEY = bytes.fromhex("1b27556473e985d462cd51197a9a46c76009549eac6474f206c4ee0844f68389")
NONCE = bytes.fromhex("69696ee955b62b73cd62bda875fc73d68219e0036b7a0b37")
# The first 32 bytes of that stream (NaCl's tests/stream3.out), and the SHA-256 of its
# first 4194 bytes as libsodium's crypto_stream_xsalsa20 gives them.
STREAM_HEAD = bytes.fromhex("eea6a7251c1e72916d11c2cb214d3c252539121d8e234e652d651fa4c8cff880")
STREAM_4194_SHA256 = "f6f2c8b07b8d8c3773192c13247bf882ae04c85e936d26d3af2db66d6bdf8f7a"


def test_xsalsa20_matches_nacl_in_any_pieces() -> None:
    whole = XSalsa20(FIRSTKEY, NONCE).xor(bytes(4194))
    assert whole[:32] == STREAM_HEAD
    assert hashlib.sha256(whole).hexdigest() == STREAM_4194_SHA256
    pieced = XSalsa20(FIRSTKEY, NONCE)
    out = b"".join(pieced.xor(bytes(n)) for n in (1, 63, 64, 65, 1000, 3001))
    assert out == whole
    buffer = bytearray(4194)
    XSalsa20(FIRSTKEY, NONCE).xor_into(buffer, buffer)
    assert bytes(buffer) == whole


def test_xsalsa20_matches_libsodium_for_random_keys() -> None:
    name = ctypes.util.find_library("sodium")
    if name is None:
        pytest.skip("libsodium is not installed")
    sodium = ctypes.CDLL(name)
    assert sodium.sodium_init() >= 0
    for _ in range(20):
        key, nonce = os.urandom(32), os.urandom(24)
        size = 1 + int.from_bytes(os.urandom(2), "big")
        out = ctypes.create_string_buffer(size)
        sodium.crypto_stream_xsalsa20(out, ctypes.c_ulonglong(size), nonce, key)
        assert XSalsa20(key, nonce).xor(bytes(size)) == out.raw


def test_key_file_round_trip_and_encodings(tmp_path: Path) -> None:
    key = new_swarm_key()
    path = tmp_path / "swarm.key"
    write_swarm_key(path, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_swarm_key(path) == key
    assert path.read_text().splitlines() == ["/key/swarm/psk/1.0.0/", "/base16/", key.hex()]
    with pytest.raises(SwarmKeyError, match="cannot create"):
        write_swarm_key(path, new_swarm_key())  # never overwrites a key
    assert load_swarm_key(path) == key
    import base64

    b64 = f"/key/swarm/psk/1.0.0/\n/base64/\n{base64.b64encode(key).decode()}\n".encode()
    assert parse_swarm_key(b64) == key
    assert parse_swarm_key(b"/key/swarm/psk/1.0.0/\n/bin/\n" + key) == key
    assert parse_swarm_key(format_swarm_key(key).encode()) == key


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "starts with the line"),
        (b"/key/swarm/psk/2.0.0/\n/base16/\n" + b"00" * 32, "starts with the line"),
        (b"/key/swarm/psk/1.0.0/\n/base32/\nAAAA", "unknown key encoding"),
        (b"/key/swarm/psk/1.0.0/\n/base16/\nzz", "not valid base16"),
        (b"/key/swarm/psk/1.0.0/\n/base64/\n!!!!", "not valid base64"),
        (b"/key/swarm/psk/1.0.0/\n/base16/\n" + b"00" * 31, "32 bytes, not 31"),
        (b"/key/swarm/psk/1.0.0/\n/bin/\n" + b"\x00" * 33, "32 bytes, not 33"),
    ],
    ids=["empty", "version", "encoding", "base16", "base64", "short", "long"],
)
def test_bad_key_files_are_refused_with_the_reason(data: bytes, message: str) -> None:
    with pytest.raises(SwarmKeyError, match=message):
        parse_swarm_key(data)


def test_missing_or_huge_key_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SwarmKeyError, match="cannot read swarm key"):
        load_swarm_key(tmp_path / "absent.key")
    huge = tmp_path / "huge.key"
    huge.write_bytes(b"/key/swarm/psk/1.0.0/\n/bin/\n" + b"\x00" * 10_000)
    with pytest.raises(SwarmKeyError, match="too large"):
        load_swarm_key(huge)


@pytest.mark.parametrize("key", [b"short", "0" * 32, bytes(33)], ids=["short", "str", "long"])
def test_config_refuses_a_bad_key(key: object) -> None:
    with pytest.raises(ValueError, match="swarm_key"):
        PeerConfig(swarm_key=key)  # type: ignore[arg-type]


def test_config_does_not_print_the_key() -> None:
    key = new_swarm_key()
    assert key.hex() not in repr(PeerConfig(swarm_key=key))
    assert repr(key) not in repr(PeerConfig(swarm_key=key))


async def _echo(dialer: Peer, listener: PeerID, payload: str = "hello") -> str:
    async with asyncio.timeout(WAIT_SECONDS):
        return await dialer.call_unary(listener, ECHO_PROTOCOL_ID, payload, str)


async def _bulk_echo(stream: Stream) -> None:
    while data := await stream.read():
        await stream.write(data)
    await stream.close()


async def _round_trip(dialer: Peer, listener: PeerID, payload: bytes) -> bytes:
    async with asyncio.timeout(WAIT_SECONDS):
        stream = await dialer.new_stream(listener, "/test/bulk-echo")

        async def send() -> None:
            await stream.write(payload)
            await stream.close()

        sending = asyncio.create_task(send())  # read while writing: the echo's windows
        received = bytearray()
        while data := await stream.read():
            received += data
        await sending
        return bytes(received)


def test_members_talk_and_outsiders_cannot_handshake_either_way(arun: Run) -> None:
    arun(_test_members_talk_and_outsiders_cannot_handshake_either_way())


async def _test_members_talk_and_outsiders_cannot_handshake_either_way() -> None:
    key = new_swarm_key()
    async with (
        Peer(PeerConfig(swarm_key=key)) as a,
        Peer(PeerConfig(swarm_key=key)) as b,
        Peer(PeerConfig(swarm_key=new_swarm_key())) as other_swarm,
        Peer() as open_peer,
    ):
        for peer in (a, b, other_swarm, open_peer):
            install_echo(peer)
        a.set_stream_handler("/test/bulk-echo", _bulk_echo)
        await b.connect(a.listen_addrs[0])
        assert await _echo(b, a.peer_id) == "hello"
        # 8 MiB both ways: many reads, each decrypted into the diverted reader's buffer.
        payload = os.urandom(8 << 20)
        assert await _round_trip(b, a.peer_id, payload) == payload

        failures_before = a.statistics().num_handshake_failures
        for outsider in (other_swarm, open_peer):
            # It dials a member: the member's first bytes are noise to it, and its own
            # are noise to the member; no protocol runs.
            with pytest.raises(PeersError):
                async with asyncio.timeout(WAIT_SECONDS):
                    await outsider.connect(a.listen_addrs[0])
            # A member dials it: the same, from the other side; the error says why.
            with pytest.raises(PeersError, match="swarm key"):
                async with asyncio.timeout(WAIT_SECONDS):
                    await a.connect(outsider.listen_addrs[0])
            assert a.connection_to(outsider.peer_id) is None
            assert outsider.connection_to(a.peer_id) is None
        await wait_for(
            lambda: a.statistics().num_handshake_failures >= failures_before + 2,
            "the outsiders' handshakes counted as failed",
            a,
        )
        # The members kept talking throughout, on their first connection and a new one.
        assert await _echo(a, b.peer_id) == "hello"
        assert await _round_trip(b, a.peer_id, payload[:100_000]) == payload[:100_000]


def test_relayed_connection_in_a_private_network(arun: Run) -> None:
    arun(_test_relayed_connection_in_a_private_network())


async def _test_relayed_connection_in_a_private_network() -> None:
    key = new_swarm_key()
    async with (
        Peer(PeerConfig(reachability="public", swarm_key=key)) as relay,
        Peer(PeerConfig(reachability="private", swarm_key=key)) as private,
        Peer(PeerConfig(swarm_key=key)) as other,
    ):
        private.set_stream_handler("/test/bulk-echo", _bulk_echo)
        addr = await reserved(private, relay)
        assert await other.connect(addr) == private.peer_id
        conn = other.connection_to(private.peer_id)
        assert conn is not None and conn.relayed
        payload = os.urandom(1 << 20)
        assert await _round_trip(other, private.peer_id, payload) == payload


def test_wire_is_pnet_as_the_spec_writes_it(arun: Run) -> None:
    """A client written from the pnet spec, on a raw socket: it sends a nonce and then
    multistream-select encrypted with XSalsa20(key, its nonce); the listener's first 24
    bytes are its nonce, and what follows decrypts to multistream-select."""
    arun(_test_wire_is_pnet_as_the_spec_writes_it())


async def _test_wire_is_pnet_as_the_spec_writes_it() -> None:
    key = new_swarm_key()
    header = f"{MULTISTREAM_PROTOCOL_ID}\n".encode()
    hello = bytes([len(header)]) + header  # a varint length, then the line
    async with Peer(PeerConfig(swarm_key=key)) as listener:
        host, port = (
            listener.bound_addrs()[0].value_for_protocol("ip4"),
            int(listener.bound_addrs()[0].value_for_protocol("tcp")),
        )
        async with asyncio.timeout(WAIT_SECONDS):
            reader, writer = await asyncio.open_connection(host, port)
            ours = os.urandom(NONCE_BYTES)
            writer.write(ours + XSalsa20(key, ours).xor(hello))
            theirs = await reader.readexactly(NONCE_BYTES)
            raw = await reader.readexactly(len(hello))
            writer.close()
        assert hello not in raw  # nothing in the clear
        assert XSalsa20(key, theirs).xor(raw) == hello

        # The same bytes without the key: the listener reads noise (it waits for the
        # rest of a "message" until its handshake deadline), and sends nothing readable.
        async with asyncio.timeout(WAIT_SECONDS):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(hello)
            rest = await reader.readexactly(NONCE_BYTES + len(hello))
            writer.close()
        assert hello not in rest
        assert listener.connected_peers() == []
