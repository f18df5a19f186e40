"""Wire values: arrays as raw-byte extensions, typed messages validated at the edge."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest

from peers.serialization import EXT_NDARRAY, SerializationError, pack, pack_buffers, unpack
from peers.varint import decode_uvarint, encode_uvarint
from peers.wire import WireError, from_wire, to_wire


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "int8", "uint8", "int64", "bool", "complex64"]
)
def test_array_round_trip(dtype: str) -> None:
    array = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    out = unpack(pack({"a": array}))["a"]
    assert out.dtype == array.dtype and out.shape == array.shape
    assert np.array_equal(out, array)


def test_arrays_travel_as_raw_bytes_not_lists() -> None:
    array = np.arange(1000, dtype=np.float32)
    packed = pack(array)
    assert len(packed) < array.nbytes + 64  # a list of floats would be ~5 bytes each
    assert packed.endswith(array.tobytes())  # the raw section follows the head
    head_len, start = decode_uvarint(packed) or (0, 0)
    ext = msgpack.unpackb(packed[start : start + head_len])
    assert isinstance(ext, msgpack.ExtType) and ext.code == EXT_NDARRAY
    assert msgpack.unpackb(ext.data) == ["float32", [1000]]


def test_contiguous_arrays_are_not_copied_when_packed_or_unpacked() -> None:
    array = np.arange(1 << 16, dtype=np.float64)
    buffers = pack_buffers({"w": array, "b": [array[:10]]})
    raw = [b for b in buffers if isinstance(b, memoryview)]
    assert any(np.shares_memory(np.frombuffer(b, dtype=np.uint8), array) for b in raw)
    wire = b"".join(buffers)
    out = unpack(wire)
    assert np.array_equal(out["w"], array) and np.array_equal(out["b"][0], array[:10])
    assert not out["w"].flags.writeable  # a view of the received bytes
    assert np.shares_memory(out["w"], np.frombuffer(wire, dtype=np.uint8))


def test_big_endian_arrays_arrive_with_their_values() -> None:
    array = (np.arange(10, dtype=np.float32) * 1.5).astype(">f4")
    assert not array.dtype.isnative
    out = unpack(pack(array))
    assert out.dtype == np.float32 and np.array_equal(out, array)


def test_a_frame_the_receiver_owns_unpacks_to_writable_views_of_it() -> None:
    torch = pytest.importorskip("torch")
    frame = bytearray(pack({"a": np.arange(8, dtype=np.float32), "t": torch.ones(4)}))
    out = unpack(frame)
    assert out["a"].flags.writeable and np.shares_memory(
        out["a"], np.frombuffer(frame, dtype=np.uint8)
    )
    out["t"] += 1  # a tensor sharing the frame's memory: no copy was made for it
    assert torch.equal(unpack(frame)["t"], torch.full((4,), 2.0))


def test_non_contiguous_and_empty_arrays() -> None:
    base = np.arange(100, dtype=np.float32).reshape(10, 10)
    assert np.array_equal(unpack(pack(base[:, ::3])), base[:, ::3])
    assert unpack(pack(np.zeros((0, 5), dtype=np.int32))).shape == (0, 5)
    assert unpack(pack(np.float32(2.5))) == 2.5


def test_torch_tensors_round_trip() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        tensor = torch.arange(12).reshape(3, 4).to(dtype)
        out = unpack(pack([tensor]))[0]
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        assert torch.equal(out, tensor)
    out[0, 0] = 5  # decoded tensors are writable


def test_object_arrays_are_refused() -> None:
    with pytest.raises(TypeError):
        pack(np.array([object()], dtype=object))


# In a fresh interpreter in which importing torch fails (a bootstrap peer never imports
# it): decode the frame on stdin, print what that gave or raised.
_DECODE_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # ``import torch`` now raises ModuleNotFoundError
from peers.serialization import unpack
try:
    value = unpack(sys.stdin.buffer.read())
except Exception as e:
    print(f"{type(e).__name__}: {e}")
else:
    print(f"decoded: {type(value).__name__}")
"""


def _decode_without_torch(frame: bytes) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _DECODE_WITHOUT_TORCH],
        input=frame,
        capture_output=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode().strip()


def test_a_peer_without_torch_refuses_a_tensor_with_serialization_error() -> None:
    torch = pytest.importorskip("torch")
    assert _decode_without_torch(pack({"a": np.ones(3, np.float32)})) == "decoded: dict"
    refused = _decode_without_torch(pack({"a": np.ones(3, np.float32), "t": torch.ones(4)}))
    assert refused.startswith("SerializationError: "), refused
    assert "this peer has no torch, so it cannot take tensors" in refused, refused


def _value(head: bytes, raw: bytes = b"") -> bytes:
    return encode_uvarint(len(head)) + head + raw


def _ext(descriptor: object, raw: bytes, code: int = EXT_NDARRAY) -> bytes:
    return _value(msgpack.packb(msgpack.ExtType(code, msgpack.packb(descriptor))), raw)


@pytest.mark.parametrize(
    "payload",
    [
        _ext(["float32", [4]], b"\x00" * 15),  # too few raw bytes
        _ext(["float32", [4]], b"\x00" * 17),  # raw bytes left unclaimed
        _ext(["float32", [2**40, 2**40]], b"\x00" * 16),  # huge shape, tiny body
        _ext(["object", [1]], b"\x00" * 8),  # forbidden dtype
        _ext(["float32", [-1]], b""),  # negative dim
        _ext(["float32", [1] * 40], b"\x00" * 4),  # too many dims
        _ext("nonsense", b""),
        _ext(["bfloat16", [1]], b"\x00\x00"),  # numpy has no bfloat16
        _value(msgpack.packb(msgpack.ExtType(EXT_NDARRAY, b"\xc1"))),  # garbage descriptor
        _value(msgpack.packb(msgpack.ExtType(99, b"abc"))),  # unknown extension
        _value(b"\xc1"),  # never-used msgpack byte
        _value(b"\x92\x01"),  # truncated msgpack array
        b"\x05\x01",  # head longer than the value
        b"\xff" * 10,  # overlong head length
        b"",
    ],
)
def test_malformed_values_raise_serialization_error(payload: bytes) -> None:
    with pytest.raises(SerializationError):
        unpack(payload)


@dataclass(frozen=True)
class Inner:
    name: str
    weight: float


@dataclass(frozen=True)
class Outer:
    key: bytes
    count: int
    inners: list[Inner]
    values: dict[str, int]
    array: np.ndarray
    note: str | None = None
    tags: list[str] = field(default_factory=list)


def test_typed_message_round_trip() -> None:
    message = Outer(b"k", 3, [Inner("a", 1.5)], {"x": 1}, np.ones(3, dtype=np.float32), "n", ["t"])
    decoded = from_wire(Outer, unpack(pack(to_wire(message))))
    assert decoded.key == b"k" and decoded.inners == [Inner("a", 1.5)]
    assert decoded.values == {"x": 1} and decoded.tags == ["t"]
    assert np.array_equal(decoded.array, message.array)


def test_older_peer_fields_default_and_newer_fields_are_ignored() -> None:
    raw = [b"k", 3, [], {}, np.ones(1)]
    assert from_wire(Outer, raw).note is None
    assert from_wire(Outer, [*raw, None, [], "from the future"]).tags == []


@pytest.mark.parametrize(
    "raw",
    [
        [b"k", "three", [], {}, np.ones(1)],
        [b"k", True, [], {}, np.ones(1)],
        [b"k", 3, [["a", "heavy"]], {}, np.ones(1)],
        [b"k", 3, [], {"x": "y"}, np.ones(1)],
        [b"k", 3, [], {}, [1.0, 2.0]],
        [b"k", 3],
        {"key": b"k"},
        "not a message",
    ],
)
def test_mistyped_messages_name_the_field(raw: object) -> None:
    with pytest.raises(WireError, match="Outer"):
        from_wire(Outer, raw)


def test_a_value_of_too_many_items_is_refused_and_a_large_real_one_is_not() -> None:
    """All levels count: 512 lists of 1024 empty lists is under every per-container
    cap and over MAX_VALUE_ITEMS in all."""
    bomb = pack([[[] for _ in range(1024)] for _ in range(512)])
    with pytest.raises(SerializationError, match="more than 262144 items"):
        unpack(bomb)
    many_records = [{"key": i, "value": b"x"} for i in range(50_000)]  # 150k items
    assert unpack(pack(many_records)) == many_records


def test_a_protocol_with_small_messages_passes_a_smaller_item_bound() -> None:
    value = [[], [1, 2], {"a": []}]  # 3 + 0 + 2 + 1 + 0 containers and elements, and more
    assert unpack(pack(value), max_items=16) == value
    with pytest.raises(SerializationError):
        unpack(pack([[]] * 20), max_items=16)
    with pytest.raises(SerializationError):
        unpack(pack({"k": list(range(20))}), max_items=16)
