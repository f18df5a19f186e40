"""AutoNAT v1: message vectors from autonat.proto, refusals, the server's dial-back
address policy (never a third party's address) and its rate limiter."""

from __future__ import annotations

import random

import pytest
from multiaddr import Multiaddr

from peers.autonat import (
    MAX_AUTONAT_MESSAGE_BYTES,
    MAX_DIAL_BACK_ADDRS,
    AutoNATProtocolError,
    Dial,
    DialRateLimiter,
    DialResponse,
    ResponseStatus,
    check_dial_request,
    decode_autonat_message,
    dial_back_addresses,
    encode_autonat_message,
)
from peers.autonat.messages import MAX_DIAL_REQUEST_ADDRS, MAX_STATUS_TEXT_BYTES
from peers.errors import LocalProtocolError
from peers.identity import KeyPair, PeerID
from peers.protobuf import encode_fields

PEER = KeyPair.from_seed(bytes(32)).peer_id
OTHER = KeyPair.from_seed(bytes([1]) * 32).peer_id
ADDR = Multiaddr("/ip4/203.0.113.9/tcp/4001")
ADDR_BYTES = bytes.fromhex("04cb007109060fa1")
OBSERVED = "203.0.113.9"


def _bad_request(data: bytes) -> str:
    with pytest.raises(AutoNATProtocolError) as info:
        decode_autonat_message(data)
    assert info.value.status is ResponseStatus.E_BAD_REQUEST
    return str(info.value)


# --- vectors -------------------------------------------------------------------------


def test_response_status_codes_are_the_specs() -> None:
    assert {s.name: s.value for s in ResponseStatus} == {
        "OK": 0,
        "E_DIAL_ERROR": 100,
        "E_DIAL_REFUSED": 101,
        "E_BAD_REQUEST": 200,
        "E_INTERNAL_ERROR": 300,
    }


def test_dial_vector() -> None:
    # Message{type = 1: DIAL, dial = 2: Dial{peer = 1: PeerInfo{id = 1, addrs = 2}}}
    peer_info = b"\x0a\x26" + PEER.to_bytes() + b"\x12\x08" + ADDR_BYTES
    dial = b"\x0a" + bytes([len(peer_info)]) + peer_info
    wire = b"\x08\x00\x12" + bytes([len(dial)]) + dial
    msg = Dial(PEER, (ADDR,))
    assert encode_autonat_message(msg) == wire
    assert decode_autonat_message(wire) == msg


def test_ok_response_vector() -> None:
    # as go's newDialResponseOK: status = 1: OK, addr = 3; no statusText
    wire = b"\x08\x01\x1a\x0c" + b"\x08\x00" + b"\x1a\x08" + ADDR_BYTES
    msg = DialResponse(ResponseStatus.OK, addr=ADDR)
    assert encode_autonat_message(msg) == wire
    assert decode_autonat_message(wire) == msg


def test_error_response_vector() -> None:
    # as go's newDialResponseError(E_DIAL_REFUSED, "too many dials")
    wire = b"\x08\x01\x1a\x12" + b"\x08\x65" + b"\x12\x0etoo many dials"
    msg = DialResponse(ResponseStatus.E_DIAL_REFUSED, "too many dials")
    assert encode_autonat_message(msg) == wire
    assert decode_autonat_message(wire) == msg


@pytest.mark.parametrize(
    "msg",
    [
        Dial(None),
        Dial(None, (ADDR,)),
        Dial(OTHER, tuple([ADDR] * MAX_DIAL_REQUEST_ADDRS)),
        DialResponse(ResponseStatus.E_INTERNAL_ERROR, "é" * (MAX_STATUS_TEXT_BYTES // 2)),
        DialResponse(ResponseStatus.E_DIAL_ERROR),
    ],
)
def test_round_trip(msg: Dial | DialResponse) -> None:
    assert decode_autonat_message(encode_autonat_message(msg)) == msg


def test_unreadable_addresses_are_dropped() -> None:
    peer_info = encode_fields([(2, b"\x04\x01"), (2, ADDR_BYTES), (2, b"\xff\xff\xff\x0f")])
    wire = encode_fields([(1, 0), (2, encode_fields([(1, peer_info)]))])
    assert decode_autonat_message(wire) == Dial(None, (ADDR,))
    response = encode_fields([(1, 1), (3, encode_fields([(1, 0), (3, b"\x04\x01")]))])
    assert decode_autonat_message(response) == DialResponse(ResponseStatus.OK, addr=None)


def test_invalid_utf8_status_text_is_replaced() -> None:
    wire = encode_fields([(1, 1), (3, encode_fields([(1, 100), (2, b"bad \xff")]))])
    msg = decode_autonat_message(wire)
    assert isinstance(msg, DialResponse) and msg.status_text == "bad \ufffd"


# --- refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "wire, reason",
    [
        (b"", "no type"),
        (b"\x08\x02", "unknown AutoNAT message type"),
        (b"\x08\x00", "no peer info"),
        (b"\x08\x00\x12\x00", "no peer info"),
        (b"\x08\x00\x12\x04\x0a\x02\x0a\x00", "not a PeerID"),
        (b"\x08\x01", "no dialResponse"),
        # proto2 default would read this as OK; it says nothing, so it is refused
        (b"\x08\x01\x1a\x00", "no status"),
        (b"\x08\x01\x1a\x02\x08\x01", "unknown response status 1"),
        (b"\x08\x00\x08\x00\x12\x02\x0a\x00", "appears 2 times"),
        (b"\x12\x02\x0a\x00", "no type"),  # go's getter would take the missing type as DIAL
        (b"\x08\x00\x12\x05\x0a", "runs past the end"),
    ],
)
def test_malformed_messages(wire: bytes, reason: str) -> None:
    assert reason in _bad_request(wire)


def test_too_many_addresses() -> None:
    peer_info = encode_fields([(2, ADDR_BYTES)] * (MAX_DIAL_REQUEST_ADDRS + 1))
    wire = encode_fields([(1, 0), (2, encode_fields([(1, peer_info)]))])
    assert len(wire) <= MAX_AUTONAT_MESSAGE_BYTES
    assert "at most 64" in _bad_request(wire)


def test_overlong_status_text_and_oversized_message() -> None:
    text = b"x" * (MAX_STATUS_TEXT_BYTES + 1)
    assert "too long" in _bad_request(
        encode_fields([(1, 1), (3, encode_fields([(1, 100), (2, text)]))])
    )
    assert "exceeds" in _bad_request(b"\x08\x00" + b"\x00" * MAX_AUTONAT_MESSAGE_BYTES)


@pytest.mark.parametrize(
    "msg",
    [
        Dial(PEER, tuple([ADDR] * (MAX_DIAL_REQUEST_ADDRS + 1))),
        DialResponse(ResponseStatus.E_DIAL_ERROR, "x" * (MAX_STATUS_TEXT_BYTES + 1)),
    ],
)
def test_encoding_refuses_what_peers_would_refuse(msg: Dial | DialResponse) -> None:
    with pytest.raises(LocalProtocolError):
        encode_autonat_message(msg)


def test_mutated_messages_raise_only_protocol_errors() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    valid = [
        encode_autonat_message(Dial(PEER, (ADDR, Multiaddr("/ip6/2001:db8::1/udp/1/quic-v1")))),
        encode_autonat_message(DialResponse(ResponseStatus.E_DIAL_ERROR, "dial failed")),
    ]
    for _ in range(3000):
        data = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode_autonat_message(bytes(data))
        except AutoNATProtocolError:
            pass
        except Exception as e:  # pragma: no cover - the failure being tested for
            pytest.fail(f"seed {seed}: {bytes(data).hex()} raised {e!r}")


# --- the server's policy -------------------------------------------------------------


def test_check_dial_request() -> None:
    check_dial_request(Dial(None, (ADDR,)), PEER)
    check_dial_request(Dial(PEER, (ADDR,)), PEER)
    with pytest.raises(AutoNATProtocolError, match="names peer") as info:
        check_dial_request(Dial(OTHER, (ADDR,)), PEER)
    assert info.value.status is ResponseStatus.E_BAD_REQUEST


def _ma(text: str) -> Multiaddr:
    return Multiaddr(text)


def test_only_the_observed_ip_is_dialed_back() -> None:
    requested = [
        _ma("/ip4/203.0.113.9/tcp/4001"),
        _ma("/ip4/198.51.100.1/tcp/4001"),  # a third party: the amplification attack
        _ma("/ip4/10.0.0.5/tcp/4001"),  # its private address: another IP
        _ma("/ip4/203.0.113.9/udp/4001/quic-v1"),
    ]
    assert dial_back_addresses(requested, OBSERVED) == [requested[0], requested[3]]


def test_relayed_dns_and_unreadable_addresses_are_dropped() -> None:
    relay = f"/ip4/203.0.113.9/tcp/4001/p2p/{OTHER}/p2p-circuit"
    requested: list[Multiaddr | bytes] = [
        _ma(relay),
        _ma(f"{relay}/p2p/{PEER}"),
        _ma("/dns4/example.com/tcp/4001"),
        b"\x04\x01",  # truncated /ip4
        b"\xff\xff\xff\x0f",
        _ma(f"/ip4/203.0.113.9/tcp/1/p2p/{OTHER}/ip4/203.0.113.9/tcp/2"),  # an inner /p2p
        ADDR_BYTES,
    ]
    assert dial_back_addresses(requested, OBSERVED) == [ADDR]


def test_trailing_peer_id_is_stripped_and_duplicates_dropped() -> None:
    requested = [_ma(f"/ip4/203.0.113.9/tcp/4001/p2p/{OTHER}"), ADDR, ADDR]
    assert dial_back_addresses(requested, OBSERVED) == [ADDR]


def test_ipv6_and_ipv4_mapped_observations() -> None:
    assert dial_back_addresses([ADDR], "::ffff:203.0.113.9") == [ADDR]
    v6 = _ma("/ip6/2001:db8::7/tcp/4001")
    assert dial_back_addresses([v6, ADDR], "2001:db8:0:0::7") == [v6]
    assert dial_back_addresses([_ma("/ip6/2001:db8::8/tcp/4001")], "2001:db8::7") == []


def test_dial_back_is_bounded() -> None:
    requested = [_ma(f"/ip4/203.0.113.9/tcp/{port}") for port in range(1000, 1100)]
    assert dial_back_addresses(requested, OBSERVED) == requested[:MAX_DIAL_BACK_ADDRS]
    assert len(dial_back_addresses(requested, OBSERVED, max_addrs=3)) == 3


def test_substituting_the_observed_ip_keeps_ports_and_transports() -> None:
    requested = [
        _ma("/ip4/10.0.0.5/tcp/4001"),
        _ma("/ip6/fd00::5/udp/4002/quic-v1"),
        _ma("/ip4/203.0.113.9/tcp/4001"),  # the same as the first, once rewritten
        _ma("/dns4/example.com/tcp/4001"),  # still never resolved
    ]
    assert dial_back_addresses(requested, OBSERVED, substitute_observed_ip=True) == [
        ADDR,
        _ma("/ip4/203.0.113.9/udp/4002/quic-v1"),
    ]


def test_observed_ip_must_be_an_ip() -> None:
    with pytest.raises(ValueError):
        dial_back_addresses([ADDR], "example.com")


def test_rate_limiter_per_peer() -> None:
    limiter = DialRateLimiter(max_per_peer=3, max_global=30, window_seconds=60)
    assert [limiter.allow(PEER, t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert limiter.allow(OTHER, 3)
    assert not limiter.allow(PEER, 59.9)
    assert limiter.allow(PEER, 60.0)  # the first request left the window
    assert limiter.num_refused == 2


def test_rate_limiter_global_and_bounded_memory() -> None:
    limiter = DialRateLimiter(max_per_peer=3, max_global=5, window_seconds=10)
    peers = [KeyPair.from_seed(i.to_bytes(32, "big")).peer_id for i in range(100)]
    admitted = [limiter.allow(peer, 1.0) for peer in peers]
    assert admitted.count(True) == 5 and limiter.num_in_window == 5
    assert limiter.allow(peers[50], 11.0)  # the window slid past all of them
    assert limiter.num_in_window == 1


def test_rate_limiter_refusals_do_not_count() -> None:
    limiter = DialRateLimiter(max_per_peer=1, max_global=10, window_seconds=10)
    assert limiter.allow(PEER, 0)
    for t in range(1, 10):
        assert not limiter.allow(PEER, t)
    assert limiter.allow(PEER, 10)  # a steady stream of refused requests does not extend it


def test_rate_limiter_config_is_validated() -> None:
    with pytest.raises(ValueError):
        DialRateLimiter(max_per_peer=0)
    with pytest.raises(ValueError):
        DialRateLimiter(window_seconds=0)


def test_peer_ids_in_dials_are_peer_ids() -> None:
    msg = decode_autonat_message(encode_autonat_message(Dial(PEER)))
    assert isinstance(msg, Dial) and isinstance(msg.peer_id, PeerID)


def test_path_protocols_survive_the_rewrite() -> None:
    """Addresses are cut in binary: a path value (``/unix``) would not survive text."""
    odd = _ma("/ip4/10.0.0.5/unix/tmp/sock")
    assert dial_back_addresses([odd], OBSERVED, substitute_observed_ip=True) == [
        _ma("/ip4/203.0.113.9/unix/tmp/sock")
    ]
    certhash = "/certhash/uEiDDq4_xNyDorZBH3TlGazyJdOWSwvo4PUo5YHFMrvDE8g"
    webtransport = _ma(f"/ip4/203.0.113.9/udp/4001/quic-v1/webtransport{certhash}/p2p/{PEER}")
    assert dial_back_addresses([webtransport], OBSERVED) == [
        _ma(f"/ip4/203.0.113.9/udp/4001/quic-v1/webtransport{certhash}")
    ]
