"""Property tests (hypothesis) for the relay, AutoNAT, DCUtR and envelope decoders: on any
bytes they return a message or raise their own protocol error, nothing else; and every
message they can represent survives a round trip. Hypothesis prints the failing input,
shrunk, and how to reproduce it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("hypothesis", reason="hypothesis not installed")

from hypothesis import given, settings
from hypothesis import strategies as st
from multiaddr import Multiaddr

from peers.autonat import (
    AutoNATProtocolError,
    Dial,
    DialResponse,
    ResponseStatus,
    decode_autonat_message,
    encode_autonat_message,
)
from peers.dcutr import (
    HolePunch,
    HolePunchProtocolError,
    HolePunchType,
    decode_hole_punch,
    encode_hole_punch,
)
from peers.envelope import EnvelopeError, open_envelope
from peers.identity import KeyPair
from peers.protobuf import encode_fields
from peers.relay import (
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayProtocolError,
    Reservation,
    Status,
    StopMessage,
    StopType,
    VoucherError,
    decode_hop_message,
    decode_stop_message,
    decode_voucher,
    encode_hop_message,
    encode_stop_message,
    make_voucher,
)

FUZZ = settings(max_examples=200, deadline=None)

DECODERS: list[tuple[Callable[[bytes], object], type[Exception]]] = [
    (decode_hop_message, RelayProtocolError),
    (decode_stop_message, RelayProtocolError),
    (decode_autonat_message, AutoNATProtocolError),
    (decode_hole_punch, HolePunchProtocolError),
    (lambda data: open_envelope(data, "libp2p-testing"), EnvelopeError),
    (decode_voucher, VoucherError),
]

PEERS = [KeyPair.from_seed(bytes([i]) * 32).peer_id for i in range(3)]
ADDRS = [
    Multiaddr("/ip4/1.2.3.4/tcp/4001"),
    Multiaddr("/ip6/2001:db8::1/udp/4001/quic-v1"),
    Multiaddr(f"/ip4/5.6.7.8/tcp/1/p2p/{PEERS[0]}/p2p-circuit"),
]

# Protobuf-shaped inputs reach further than uniform bytes: small field numbers, enum-ish
# varints, peer-id-ish and multiaddr-ish bytes, and nested messages of the same kind.
_leaf = st.one_of(
    st.binary(max_size=48),
    st.sampled_from([p.to_bytes() for p in PEERS] + [a.to_bytes() for a in ADDRS]),
)
_varint = st.one_of(
    st.sampled_from([0, 1, 2, 100, 101, 200, 204, 300, 400, 401]),
    st.integers(min_value=0, max_value=(1 << 63) - 1),
)
_fields = st.recursive(
    _leaf,
    lambda inner: st.lists(
        st.tuples(st.integers(min_value=1, max_value=6), st.one_of(_varint, inner)), max_size=8
    ).map(encode_fields),
    max_leaves=24,
)
# Most messages start with a valid type, so decoding gets past the first check.
_message = st.tuples(st.sampled_from([0, 1, 2, 100, 300]), _fields).map(
    lambda parts: encode_fields([(1, parts[0])]) + parts[1]
)


_addrs = st.lists(st.sampled_from(ADDRS), max_size=4).map(tuple)
_peer_info = st.builds(PeerInfo, st.sampled_from(PEERS), _addrs)
_limit = st.builds(Limit, st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 63) - 1))
_reservation = st.builds(
    Reservation, st.integers(0, (1 << 63) - 1), _addrs, st.none() | st.binary(max_size=200)
)
_hop = st.builds(
    HopMessage,
    type=st.sampled_from(HopType),
    peer=_peer_info,
    reservation=st.none() | _reservation,
    limit=st.none() | _limit,
    status=st.sampled_from(Status),
)
_stop = st.builds(
    StopMessage,
    type=st.sampled_from(StopType),
    peer=_peer_info,
    limit=st.none() | _limit,
    status=st.sampled_from(Status),
)
_autonat = st.one_of(
    st.builds(Dial, st.none() | st.sampled_from(PEERS), _addrs),
    st.builds(
        DialResponse,
        st.sampled_from(ResponseStatus),
        st.text(max_size=60),
        st.none() | st.sampled_from(ADDRS),
    ),
)
_punch = st.builds(HolePunch, st.sampled_from(HolePunchType), _addrs)
_voucher = st.builds(
    make_voucher,
    st.just(KeyPair.from_seed(b"r" * 32)),
    st.sampled_from(PEERS),
    st.integers(0, 2**40),
)


@pytest.mark.parametrize("decode, error", DECODERS)
@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_raise_only_protocol_errors(
    decode: Callable[[bytes], object], error: type[Exception], data: bytes
) -> None:
    try:
        decode(data)
    except error:
        pass


@pytest.mark.parametrize("decode, error", DECODERS)
@FUZZ
@given(data=_message)
def test_protobuf_shaped_bytes_raise_only_protocol_errors(
    decode: Callable[[bytes], object], error: type[Exception], data: bytes
) -> None:
    try:
        decode(data)
    except error:
        pass


@st.composite
def _mutated(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding with a few bytes replaced, inserted or cut: near misses reach the
    checks deep inside a message that random bytes never get to."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        at = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        edit = draw(st.sampled_from(["replace", "insert", "cut"]))
        if edit == "cut":
            del data[at:]
        elif edit == "insert" or not data:
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
        else:
            data[at] = draw(st.integers(min_value=0, max_value=255))
    return bytes(data)


@pytest.mark.parametrize(
    "valid, decode, error",
    [
        (_hop.map(encode_hop_message), decode_hop_message, RelayProtocolError),
        (_stop.map(encode_stop_message), decode_stop_message, RelayProtocolError),
        (_autonat.map(encode_autonat_message), decode_autonat_message, AutoNATProtocolError),
        (_punch.map(encode_hole_punch), decode_hole_punch, HolePunchProtocolError),
        (_voucher, decode_voucher, VoucherError),
    ],
    ids=["hop", "stop", "autonat", "dcutr", "voucher"],
)
@FUZZ
@given(data=st.data())
def test_near_misses_raise_only_protocol_errors(
    valid: st.SearchStrategy[bytes],
    decode: Callable[[bytes], object],
    error: type[Exception],
    data: st.DataObject,
) -> None:
    try:
        decode(data.draw(_mutated(valid)))
    except error:
        pass


@FUZZ
@given(_hop)
def test_hop_round_trip(msg: HopMessage) -> None:
    assert decode_hop_message(encode_hop_message(msg)) == msg


@FUZZ
@given(_stop)
def test_stop_round_trip(msg: StopMessage) -> None:
    assert decode_stop_message(encode_stop_message(msg)) == msg


@FUZZ
@given(_autonat)
def test_autonat_round_trip(msg: Dial | DialResponse) -> None:
    assert decode_autonat_message(encode_autonat_message(msg)) == msg


@FUZZ
@given(_punch)
def test_hole_punch_round_trip(msg: HolePunch) -> None:
    assert decode_hole_punch(encode_hole_punch(msg)) == msg
