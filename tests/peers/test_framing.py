"""Pure framing pieces: varints, protobuf fields, multistream-select, frames."""

from __future__ import annotations

import random

import pytest

from peers.errors import HandshakeError, LimitExceeded, ProtocolNotSupported
from peers.multistream import (
    MULTISTREAM_PROTOCOL_ID,
    MultistreamDialer,
    MultistreamListener,
    encode_message,
)
from peers.protobuf import ProtobufError, decode_fields, encode_fields
from peers.serialization import FrameDecoder, SerializationError, encode_frame
from peers.varint import VarintError, decode_uvarint, encode_uvarint


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**32, 2**63 - 1])
def test_uvarint_round_trip(value: int) -> None:
    encoded = encode_uvarint(value)
    assert decode_uvarint(encoded) == (value, len(encoded))
    assert decode_uvarint(encoded[:-1]) is None


def test_uvarint_known_bytes() -> None:
    # multiformats unsigned-varint spec examples
    assert encode_uvarint(1) == b"\x01"
    assert encode_uvarint(127) == b"\x7f"
    assert encode_uvarint(128) == b"\x80\x01"
    assert encode_uvarint(255) == b"\xff\x01"
    assert encode_uvarint(300) == b"\xac\x02"
    assert encode_uvarint(16384) == b"\x80\x80\x01"


def test_uvarint_rejects_overlong_and_non_minimal() -> None:
    with pytest.raises(VarintError):
        decode_uvarint(b"\xff" * 10)
    with pytest.raises(VarintError):
        decode_uvarint(b"\x81\x00")
    with pytest.raises(ValueError):
        encode_uvarint(2**63)


def test_protobuf_round_trip_and_unknown_fields() -> None:
    data = encode_fields([(1, 5), (2, b"abc"), (15, b"x" * 200)])
    assert decode_fields(data) == [(1, 5), (2, b"abc"), (15, b"x" * 200)]
    with pytest.raises(ProtobufError):
        decode_fields(data[:-1])
    with pytest.raises(ProtobufError):
        decode_fields(b"\x0b")  # wire type 3 (groups) is not supported


def _run_multistream(dialer: MultistreamDialer, listener: MultistreamListener, chunk: int) -> None:
    to_listener = dialer.initial_bytes()
    to_dialer = listener.initial_bytes()
    for _ in range(100):
        if dialer.selected is not None:
            return
        out = b""
        for i in range(0, len(to_listener), chunk):
            out += listener.receive_data(to_listener[i : i + chunk])
        to_listener = b""
        to_dialer += out
        for i in range(0, len(to_dialer), chunk):
            to_listener += dialer.receive_data(to_dialer[i : i + chunk])
        to_dialer = b""


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_multistream_negotiates_second_choice(chunk: int) -> None:
    dialer = MultistreamDialer(["/tls/1.0.0", "/noise"])
    listener = MultistreamListener({"/noise"})
    _run_multistream(dialer, listener, chunk)
    assert dialer.selected == listener.selected == "/noise"


def test_multistream_wire_bytes_match_spec() -> None:
    # "/multistream/1.0.0\n" is 19 bytes: varint 0x13
    assert encode_message(MULTISTREAM_PROTOCOL_ID) == b"\x13/multistream/1.0.0\n"


def test_multistream_refusal_and_garbage() -> None:
    dialer = MultistreamDialer(["/a"])
    listener = MultistreamListener({"/b"})
    with pytest.raises(ProtocolNotSupported):
        _run_multistream(dialer, listener, 1000)
    with pytest.raises(HandshakeError):
        MultistreamListener({"/b"}).receive_data(b"\x05hello")
    with pytest.raises(HandshakeError):
        MultistreamListener({"/b"}).receive_data(b"\xff\xff\x03")  # 1024+ byte message
    # Where the header belongs, a length other than the header's is refused at once,
    # before the message arrives: noise (a private network's peer) never hangs us.
    for machine in (MultistreamListener({"/b"}), MultistreamDialer(["/b"])):
        with pytest.raises(HandshakeError, match=r"expected the /multistream/1\.0\.0 header"):
            machine.receive_data(b"\x40")


def test_multistream_leftover_is_kept() -> None:
    dialer = MultistreamDialer(["/p"])
    listener = MultistreamListener({"/p"})
    listener.receive_data(dialer.initial_bytes() + b"early data")
    assert listener.selected == "/p" and listener.leftover == b"early data"


def test_frame_decoder_random_splits() -> None:
    seed = random.randrange(2**32)
    print("seed", seed)
    rng = random.Random(seed)
    bodies = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(50)]
    wire = b"".join(encode_frame(b) for b in bodies)
    decoder = FrameDecoder(4096)
    out: list[bytes] = []
    i = 0
    while i < len(wire):
        step = rng.randrange(1, 700)
        out += decoder.feed(wire[i : i + step])
        i += step
    assert out == bodies
    assert decoder.at_frame_boundary()


def test_frame_decoder_returns_a_whole_writable_body_as_a_view() -> None:
    """A body that arrives whole in a writable piece it fills at least half of comes back
    as a view of that piece, not a copy; any other body is joined into a fresh bytearray
    (read-only input, a small body in a big piece, a body split across pieces)."""
    big = bytes(range(256)) * 100
    piece = bytearray(encode_frame(big) + encode_frame(b"small"))
    decoder = FrameDecoder()
    first, second = decoder.feed(piece)
    assert isinstance(first, memoryview) and not first.readonly and first.obj is piece
    assert bytes(first) == big
    assert isinstance(second, bytearray) and second == b"small"
    (copied,) = decoder.feed(encode_frame(big))  # bytes: read-only
    assert isinstance(copied, bytearray) and copied == big
    wire = bytearray(encode_frame(big))
    assert decoder.feed(memoryview(wire)[:1000]) == []
    (joined,) = decoder.feed(memoryview(wire)[1000:])
    assert isinstance(joined, bytearray) and joined == big
    assert decoder.at_frame_boundary()


def test_frame_decoder_refuses_before_buffering() -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(LimitExceeded):
        decoder.feed(encode_uvarint(1025))
    with pytest.raises(LimitExceeded):
        FrameDecoder().feed(encode_uvarint(2**63 - 1))
    with pytest.raises(SerializationError):
        FrameDecoder().feed(b"\xff" * 10)


def test_multistream_listener_answers_na_before_judging_lazy_data() -> None:
    # A lazy dialer sends its proposal and its data at once; when we refuse the
    # protocol, the "na" must go out before the data is parsed (and found garbage).
    dialer = MultistreamDialer(["/unknown"])
    listener = MultistreamListener({"/known"})
    reply = listener.receive_data(dialer.initial_bytes() + b"\x00\x05\x01request")
    assert reply == encode_message("na")
    assert listener.has_pending_input
    with pytest.raises(HandshakeError):
        listener.receive_data(b"")
    with pytest.raises(ProtocolNotSupported):
        dialer.receive_data(listener.initial_bytes() + reply)
