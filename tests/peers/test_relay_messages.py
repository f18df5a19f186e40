"""Circuit relay v2 hop and stop messages: byte vectors derived from circuit.proto, round
trips, and every malformed input refused with the status the spec answers it with."""

from __future__ import annotations

import random

import pytest
from multiaddr import Multiaddr

from peers.errors import LocalProtocolError, RemoteProtocolError
from peers.identity import KeyPair, PeerID
from peers.protobuf import encode_fields
from peers.relay import (
    MAX_ADDRS_PER_PEER,
    MAX_CIRCUIT_MESSAGE_BYTES,
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayProtocolError,
    Reservation,
    Status,
    StopMessage,
    StopType,
    decode_hop_message,
    decode_stop_message,
    encode_hop_message,
    encode_stop_message,
)

PEER = KeyPair.from_seed(bytes(32)).peer_id
OTHER = KeyPair.from_seed(bytes([1]) * 32).peer_id
PEER_BYTES = PEER.to_bytes()  # 38 bytes: identity multihash 00 24 + the key protobuf
TCP = Multiaddr("/ip4/1.2.3.4/tcp/4001")  # 04 01020304 06 0fa1
QUIC = Multiaddr("/ip6/2001:db8::1/udp/4001/quic-v1")
TCP_BYTES = bytes.fromhex("0401020304060fa1")


def _malformed(data: bytes, *, stop: bool = False) -> RelayProtocolError:
    decode = decode_stop_message if stop else decode_hop_message
    with pytest.raises(RelayProtocolError) as info:
        decode(data)
    assert info.value.status is Status.MALFORMED_MESSAGE
    return info.value


# --- vectors: tag = field_number << 3 | wire_type (0 varint, 2 length-delimited) -------


def test_status_codes_are_the_specs() -> None:
    assert {s.name: s.value for s in Status} == {
        "OK": 100,
        "RESERVATION_REFUSED": 200,
        "RESOURCE_LIMIT_EXCEEDED": 201,
        "PERMISSION_DENIED": 202,
        "CONNECTION_FAILED": 203,
        "NO_RESERVATION": 204,
        "MALFORMED_MESSAGE": 400,
        "UNEXPECTED_MESSAGE": 401,
    }


def test_reserve_vector() -> None:
    # type = 1, varint 0: the RESERVE zero value is written explicitly (optional field).
    assert encode_hop_message(HopMessage(type=HopType.RESERVE)) == b"\x08\x00"
    assert decode_hop_message(b"\x08\x00") == HopMessage(type=HopType.RESERVE)


def test_hop_connect_vector() -> None:
    peer = b"\x0a\x26" + PEER_BYTES + b"\x12\x08" + TCP_BYTES  # Peer{id = 1, addrs = 2}
    wire = b"\x08\x01" + b"\x12" + bytes([len(peer)]) + peer
    msg = HopMessage(type=HopType.CONNECT, peer=PeerInfo(PEER, (TCP,)))
    assert encode_hop_message(msg) == wire
    assert decode_hop_message(wire) == msg


def test_reservation_ok_vector() -> None:
    voucher = b"\xaa" * 5
    # Reservation{expire = 1: 1700000000, addrs = 2, voucher = 3}
    reservation = (
        b"\x08" + bytes.fromhex("80e2cfaa06") + b"\x12\x08" + TCP_BYTES + b"\x1a\x05" + voucher
    )
    # Limit{duration = 1: 3600 (90 1c), data = 2: 2**30 (80 80 80 80 04)}
    limit = b"\x08\x90\x1c\x10\x80\x80\x80\x80\x04"
    wire = (
        b"\x08\x02"
        + b"\x1a" + bytes([len(reservation)]) + reservation
        + b"\x22" + bytes([len(limit)]) + limit
        + b"\x28\x64"  # status = 5: OK (100)
    )  # fmt: skip
    msg = HopMessage(
        type=HopType.STATUS,
        reservation=Reservation(1_700_000_000, (TCP,), voucher),
        limit=Limit(3600, 1 << 30),
        status=Status.OK,
    )
    assert encode_hop_message(msg) == wire
    assert decode_hop_message(wire) == msg


def test_refusal_vector() -> None:
    wire = b"\x08\x02\x28\xcc\x01"  # STATUS, status = 204 NO_RESERVATION
    assert decode_hop_message(wire) == HopMessage(type=HopType.STATUS, status=Status.NO_RESERVATION)
    assert encode_hop_message(decode_hop_message(wire)) == wire


def test_stop_connect_vector() -> None:
    peer = b"\x0a\x26" + PEER_BYTES
    limit = b"\x08\x78\x10\x80\x80\x08"  # duration 120, data 131072 (go's defaults)
    wire = b"\x08\x00\x12" + bytes([len(peer)]) + peer + b"\x1a" + bytes([len(limit)]) + limit
    msg = StopMessage(type=StopType.CONNECT, peer=PeerInfo(PEER), limit=Limit(120, 131072))
    assert encode_stop_message(msg) == wire
    assert decode_stop_message(wire) == msg


def test_stop_status_vector() -> None:
    assert (
        encode_stop_message(StopMessage(type=StopType.STATUS, status=Status.OK))
        == b"\x08\x01\x20\x64"
    )
    assert decode_stop_message(b"\x08\x01\x20\x64").status is Status.OK


def test_limit_fields_absent_read_as_no_limit() -> None:
    # An empty Limit message (tag 0x22, length 0): present, so the connection is limited,
    # but each absent field means "no limit" (spec: "if 0, there is no limit applied").
    msg = decode_hop_message(b"\x08\x02\x22\x00\x28\x64")
    assert msg.limit == Limit(0, 0)


# --- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        HopMessage(type=HopType.RESERVE),
        HopMessage(type=HopType.CONNECT, peer=PeerInfo(OTHER)),
        HopMessage(type=HopType.CONNECT, peer=PeerInfo(OTHER, (TCP, QUIC))),
        HopMessage(type=HopType.STATUS, status=Status.RESERVATION_REFUSED),
        HopMessage(type=HopType.STATUS, status=Status.OK, limit=Limit()),
        HopMessage(
            type=HopType.STATUS,
            status=Status.OK,
            reservation=Reservation(2**40, tuple([TCP] * MAX_ADDRS_PER_PEER)),
            limit=Limit(2**32 - 1, 2**62),
        ),
    ],
)
def test_hop_round_trip(msg: HopMessage) -> None:
    assert decode_hop_message(encode_hop_message(msg)) == msg


@pytest.mark.parametrize(
    "msg",
    [
        StopMessage(type=StopType.CONNECT, peer=PeerInfo(PEER, (QUIC,))),
        StopMessage(type=StopType.CONNECT, peer=PeerInfo(PEER), limit=Limit(60, 0)),
        StopMessage(type=StopType.STATUS, status=Status.CONNECTION_FAILED),
    ],
)
def test_stop_round_trip(msg: StopMessage) -> None:
    assert decode_stop_message(encode_stop_message(msg)) == msg


def test_unknown_fields_are_skipped() -> None:
    # A newer peer's field 15 (varint) and field 9 (bytes) do not make the message invalid.
    wire = b"\x08\x00" + b"\x78\x05" + b"\x4a\x02hi"
    assert decode_hop_message(wire) == HopMessage(type=HopType.RESERVE)


def test_unreadable_addresses_are_dropped_one_by_one() -> None:
    peer = encode_fields(
        [
            (1, PEER_BYTES),
            (2, b"\x04\x01"),  # truncated /ip4: the multiaddr package would pad it
            (2, TCP_BYTES),
            (2, b"\xff\xff\xff\x0f"),  # no such protocol
            (2, b""),
        ]
    )
    msg = decode_hop_message(encode_fields([(1, 1), (2, peer)]))
    assert msg.peer == PeerInfo(PEER, (TCP,))


# --- refusals --------------------------------------------------------------------------


def test_protocol_error_carries_malformed_status_and_is_remote() -> None:
    error = _malformed(b"")
    assert isinstance(error, RemoteProtocolError)
    assert "no type" in str(error)


@pytest.mark.parametrize(
    "wire, reason",
    [
        (b"\x08\x03", "unknown hop message type"),
        (b"\x08\x01", "CONNECT without a target peer"),
        (b"\x08\x02", "STATUS without a status"),
        (b"\x08\x02\x28\x00", "unknown status code 0"),  # UNUSED is no status
        (b"\x08\x02\x28\xe7\x07", "unknown status code 999"),
        (b"\x08\x02\x08\x02\x28\x64", "appears 2 times"),
        (b"\x0a\x00", "should be a varint"),  # type sent length-delimited
        (b"\x08\x02\x28", "truncated"),
        (b"\x08\x02\x22\x05\x08", "runs past the end"),
        (b"\x08\x01\x12\x00", "Peer has no id"),
        (b"\x08\x01\x12\x04\x0a\x02\x01\x00", "not a PeerID"),  # multihash code 1
        (b"\x08\x01\x12\x05\x0a\x03\x00\x05a", "not a PeerID"),  # length mismatch
        (b"\x08\x02\x1a\x00\x28\x64", "no expire"),
        (b"\x08\x02\x22\x06\x08\x80\x80\x80\x80\x10\x28\x64", "uint32"),  # duration 2**32
        (b"\x08" + b"\xff" * 9 + b"\x01", "varint"),  # a negative enum: 10-byte varint
    ],
)
def test_malformed_hop_messages(wire: bytes, reason: str) -> None:
    assert reason in str(_malformed(wire))


@pytest.mark.parametrize(
    "wire, reason",
    [
        (b"", "no type"),
        (b"\x08\x02", "unknown stop message type"),
        (b"\x08\x00", "CONNECT without the initiating peer"),
        (b"\x08\x01", "STATUS without a status"),
        (b"\x08\x01\x20\x01", "unknown status"),
        (b"\x08\x00\x12\x02\x0a\x00", "not a PeerID"),
    ],
)
def test_malformed_stop_messages(wire: bytes, reason: str) -> None:
    assert reason in str(_malformed(wire, stop=True))


def test_oversized_message_is_refused_before_parsing() -> None:
    voucher = b"\x00" * MAX_CIRCUIT_MESSAGE_BYTES
    wire = encode_fields([(1, 2), (3, encode_fields([(1, 1), (3, voucher)])), (5, 100)])
    assert "exceeds" in str(_malformed(wire))
    assert "exceeds" in str(
        _malformed(b"\x08\x01" + b"\x00" * MAX_CIRCUIT_MESSAGE_BYTES, stop=True)
    )


def test_too_many_addresses_are_refused() -> None:
    addrs = [(2, TCP_BYTES)] * (MAX_ADDRS_PER_PEER + 1)
    wire = encode_fields([(1, 1), (2, encode_fields([(1, PEER_BYTES), *addrs]))])
    assert len(wire) <= MAX_CIRCUIT_MESSAGE_BYTES  # it is the count, not the size
    assert "at most 64" in str(_malformed(wire))
    reservation = encode_fields([(1, 5), *addrs])
    assert "at most 64" in str(_malformed(encode_fields([(1, 2), (3, reservation), (5, 100)])))


# --- what we refuse to send -----------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        HopMessage(type=HopType.CONNECT),
        HopMessage(type=HopType.STATUS),
        HopMessage(type=HopType.CONNECT, peer=PeerInfo(PEER, tuple([TCP] * 65))),
        HopMessage(type=HopType.STATUS, status=Status.OK, limit=Limit(2**32, 0)),
        HopMessage(type=HopType.STATUS, status=Status.OK, limit=Limit(0, -1)),
        HopMessage(type=HopType.STATUS, status=Status.OK, reservation=Reservation(-1)),
        HopMessage(
            type=HopType.STATUS, status=Status.OK, reservation=Reservation(1, (), b"\x00" * 4096)
        ),
    ],
)
def test_encoding_refuses_what_peers_would_refuse(msg: HopMessage) -> None:
    with pytest.raises(LocalProtocolError):
        encode_hop_message(msg)


@pytest.mark.parametrize(
    "msg", [StopMessage(type=StopType.CONNECT), StopMessage(type=StopType.STATUS)]
)
def test_stop_encoding_refuses_incomplete_messages(msg: StopMessage) -> None:
    with pytest.raises(LocalProtocolError):
        encode_stop_message(msg)


def test_mutated_messages_raise_only_protocol_errors() -> None:
    """Seeded mutation fuzz (runs without hypothesis; see test_control_fuzz.py for more)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    valid = [
        encode_hop_message(
            HopMessage(
                type=HopType.STATUS,
                status=Status.OK,
                reservation=Reservation(10**9, (TCP, QUIC), b"v" * 40),
                limit=Limit(3600, 1 << 30),
            )
        ),
        encode_hop_message(HopMessage(type=HopType.CONNECT, peer=PeerInfo(PEER, (TCP,)))),
        encode_stop_message(
            StopMessage(type=StopType.CONNECT, peer=PeerInfo(OTHER), limit=Limit())
        ),
    ]
    for _ in range(3000):
        data = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        for decode in (decode_hop_message, decode_stop_message):
            try:
                decode(bytes(data))
            except RelayProtocolError:
                pass
            except Exception as e:  # pragma: no cover - the failure being tested for
                pytest.fail(f"seed {seed}: {bytes(data).hex()} raised {e!r}")


def test_peer_ids_decode_to_peer_ids() -> None:
    msg = decode_hop_message(
        encode_hop_message(HopMessage(type=HopType.CONNECT, peer=PeerInfo(PEER)))
    )
    assert msg.peer is not None and isinstance(msg.peer.peer_id, PeerID)
    assert msg.peer.peer_id == PEER
