"""DCUtR HolePunch messages: vectors from holepunch.proto, bounds and refusals."""

from __future__ import annotations

import random

import pytest
from multiaddr import Multiaddr

from peers.dcutr import (
    MAX_HOLE_PUNCH_ADDRS,
    MAX_HOLE_PUNCH_MESSAGE_BYTES,
    HolePunch,
    HolePunchProtocolError,
    HolePunchType,
    decode_hole_punch,
    direct_addresses,
    encode_hole_punch,
)
from peers.errors import LocalProtocolError, RemoteProtocolError
from peers.identity import KeyPair
from peers.protobuf import encode_fields

TCP = Multiaddr("/ip4/1.2.3.4/tcp/4001")
TCP_BYTES = bytes.fromhex("0401020304060fa1")
QUIC = Multiaddr("/ip4/1.2.3.4/udp/4001/quic-v1")
RELAY = KeyPair.from_seed(bytes(32)).peer_id


def test_type_values_are_the_specs() -> None:
    assert (HolePunchType.CONNECT, HolePunchType.SYNC) == (100, 300)


def test_connect_vector() -> None:
    # type = 1: 100 (64), ObsAddrs = 2: one binary multiaddr
    wire = b"\x08\x64\x12\x08" + TCP_BYTES
    msg = HolePunch(HolePunchType.CONNECT, (TCP,))
    assert encode_hole_punch(msg) == wire
    assert decode_hole_punch(wire) == msg


def test_sync_vector() -> None:
    assert encode_hole_punch(HolePunch(HolePunchType.SYNC)) == b"\x08\xac\x02"  # 300
    assert decode_hole_punch(b"\x08\xac\x02") == HolePunch(HolePunchType.SYNC)


@pytest.mark.parametrize(
    "msg",
    [
        HolePunch(HolePunchType.CONNECT),
        HolePunch(HolePunchType.CONNECT, (TCP, QUIC)),
        HolePunch(HolePunchType.CONNECT, tuple([TCP] * MAX_HOLE_PUNCH_ADDRS)),
    ],
)
def test_round_trip(msg: HolePunch) -> None:
    assert decode_hole_punch(encode_hole_punch(msg)) == msg


def test_unreadable_addresses_are_dropped_and_unknown_fields_skipped() -> None:
    wire = encode_fields([(1, 100), (2, b"\x04\x01"), (2, TCP_BYTES), (2, b""), (7, 1)])
    assert decode_hole_punch(wire) == HolePunch(HolePunchType.CONNECT, (TCP,))


@pytest.mark.parametrize(
    "wire, reason",
    [
        (b"", "no type"),
        (b"\x12\x08" + TCP_BYTES, "no type"),
        (b"\x08\x00", "unknown DCUtR message type 0"),
        (b"\x08\xc8\x01", "unknown DCUtR message type 200"),
        (b"\x08\x64\x08\x64", "appears 2 times"),
        (b"\x08\x64\x10\x01", "should be length-delimited"),  # ObsAddrs as a varint
        (b"\x0a\x01\x00", "should be a varint"),
        (b"\x08", "truncated"),
    ],
)
def test_malformed(wire: bytes, reason: str) -> None:
    with pytest.raises(HolePunchProtocolError, match=reason):
        decode_hole_punch(wire)


def test_bounds() -> None:
    assert issubclass(HolePunchProtocolError, RemoteProtocolError)
    too_many = encode_fields([(1, 100)] + [(2, TCP_BYTES)] * (MAX_HOLE_PUNCH_ADDRS + 1))
    assert len(too_many) <= MAX_HOLE_PUNCH_MESSAGE_BYTES
    with pytest.raises(HolePunchProtocolError, match="at most 64"):
        decode_hole_punch(too_many)
    with pytest.raises(HolePunchProtocolError, match="exceeds"):
        decode_hole_punch(b"\x08\x64\x12\x80\x20" + b"\x00" * MAX_HOLE_PUNCH_MESSAGE_BYTES)
    with pytest.raises(LocalProtocolError):
        encode_hole_punch(
            HolePunch(HolePunchType.CONNECT, tuple([TCP] * (MAX_HOLE_PUNCH_ADDRS + 1)))
        )
    certhash = "/certhash/uEiDDq4_xNyDorZBH3TlGazyJdOWSwvo4PUo5YHFMrvDE8g" * 2
    big = Multiaddr(f"/ip6/2001:db8::1/udp/4001/quic-v1/webtransport{certhash}")
    with pytest.raises(LocalProtocolError, match="exceeds"):
        encode_hole_punch(HolePunch(HolePunchType.CONNECT, tuple([big] * MAX_HOLE_PUNCH_ADDRS)))


def test_direct_addresses_drop_relayed_ones() -> None:
    relayed = Multiaddr(f"/ip4/5.6.7.8/tcp/4001/p2p/{RELAY}/p2p-circuit")
    assert direct_addresses([TCP, relayed, QUIC]) == [TCP, QUIC]


def test_mutated_messages_raise_only_protocol_errors() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    valid = encode_hole_punch(HolePunch(HolePunchType.CONNECT, (TCP, QUIC)))
    for _ in range(3000):
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode_hole_punch(bytes(data))
        except HolePunchProtocolError:
            pass
        except Exception as e:  # pragma: no cover - the failure being tested for
            pytest.fail(f"seed {seed}: {bytes(data).hex()} raised {e!r}")
