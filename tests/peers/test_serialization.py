"""Wire values: arrays as raw-byte extensions, typed messages validated at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest

from peers.serialization import EXT_NDARRAY, SerializationError, pack, unpack
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
    ext = msgpack.unpackb(packed)
    assert isinstance(ext, msgpack.ExtType) and ext.code == EXT_NDARRAY
    assert array.tobytes() in ext.data


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


def _ext(header: object, body: bytes) -> bytes:
    head = msgpack.packb(header)
    return msgpack.packb(msgpack.ExtType(EXT_NDARRAY, len(head).to_bytes(2, "big") + head + body))


@pytest.mark.parametrize(
    "payload",
    [
        _ext(["float32", [4]], b"\x00" * 15),  # wrong byte count
        _ext(["object", [1]], b"\x00" * 8),  # forbidden dtype
        _ext(["float32", [-1]], b""),  # negative dim
        _ext(["float32", [1] * 40], b"\x00" * 4),  # too many dims
        _ext("nonsense", b""),
        msgpack.packb(msgpack.ExtType(EXT_NDARRAY, b"\x00")),  # truncated header
        msgpack.packb(msgpack.ExtType(99, b"abc")),  # unknown extension
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # truncated array
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
