"""Wire values: msgpack with arrays as an extension type, and length-prefixed frames.

An array travels as msgpack extension ``EXT_NDARRAY`` (or ``EXT_TORCH`` for a torch
tensor): a small msgpack header ``[dtype, shape]`` followed by the raw C-order bytes.
Decoding wraps those bytes with ``numpy.frombuffer`` (no copy). Nothing is pickled.

Frames are an unsigned-varint length then that many bytes of msgpack (libp2p's usual
length-prefixed framing). :class:`FrameDecoder` is a pure state machine that refuses a
length over its bound *before* buffering the body.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np

from peers.errors import LimitExceeded, RemoteProtocolError
from peers.varint import VarintError, decode_uvarint, encode_uvarint

EXT_NDARRAY = 1
EXT_TORCH = 2
#: Largest frame we accept from a peer by default. Bulk data is streamed as many frames,
#: so a frame never needs to be big; 16 MiB keeps one frame's buffer cheap for a peer
#: serving hundreds of streams while leaving room for large DHT batches.
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: Longest array header (dtype name and shape) we decode; a remote cannot make us parse
#: a huge shape list.
MAX_ARRAY_HEADER_BYTES = 512
#: Most dimensions an array may have (numpy's own limit is 64).
MAX_ARRAY_DIMS = 32
#: dtypes that may travel. Object and void dtypes would let a peer smuggle arbitrary
#: Python objects or unbounded structures; they are refused.
_ALLOWED_DTYPES = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 "
    "complex64 complex128 bfloat16".split()
)


class SerializationError(RemoteProtocolError):
    """A frame or value from the remote cannot be decoded."""


def _array_ext(code: int, dtype: str, shape: tuple[int, ...], data: memoryview) -> msgpack.ExtType:
    header = msgpack.packb([dtype, list(shape)])
    # One copy of the array bytes here (msgpack makes the second into its buffer).
    return msgpack.ExtType(code, len(header).to_bytes(2, "big") + header + data)


def _default(obj: object) -> object:
    if isinstance(obj, np.ndarray):
        if obj.dtype.name not in _ALLOWED_DTYPES:
            raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent")
        array = np.ascontiguousarray(obj)
        raw = array.reshape(-1).view(np.uint8).data
        return _array_ext(EXT_NDARRAY, array.dtype.name, array.shape, raw)
    if isinstance(obj, np.generic):
        return obj.item()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        name = str(tensor.dtype).removeprefix("torch.")
        if name == "bfloat16":
            raw = tensor.view(torch.int16).numpy()
        else:
            raw = tensor.numpy()
        if name not in _ALLOWED_DTYPES:
            raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent")
        flat = raw.reshape(-1).view(np.uint8).data
        return _array_ext(EXT_TORCH, name, tuple(tensor.shape), flat)
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _decode_array_header(data: bytes) -> tuple[str, tuple[int, ...], int]:
    if len(data) < 2:
        raise SerializationError("array extension is truncated")
    header_len = int.from_bytes(data[:2], "big")
    if header_len > MAX_ARRAY_HEADER_BYTES or 2 + header_len > len(data):
        raise SerializationError("array header is too long or truncated")
    try:
        dtype, shape = msgpack.unpackb(data[2 : 2 + header_len], use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise SerializationError(f"array header is malformed: {e}") from e
    if not isinstance(dtype, str) or dtype not in _ALLOWED_DTYPES:
        raise SerializationError(f"array dtype {dtype!r} is not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_ARRAY_DIMS
        or not all(isinstance(d, int) and 0 <= d for d in shape)
    ):
        raise SerializationError(f"array shape {shape!r} is invalid")
    return dtype, tuple(shape), 2 + header_len


def _numpy_view(dtype: str, shape: tuple[int, ...], body: memoryview) -> np.ndarray:
    np_dtype = np.dtype("int16") if dtype == "bfloat16" else np.dtype(dtype)
    count = 1
    for dim in shape:
        count *= dim
    if count * np_dtype.itemsize != len(body):
        raise SerializationError(
            f"array of shape {shape} and dtype {dtype} needs {count * np_dtype.itemsize} bytes, "
            f"got {len(body)}"
        )
    return np.frombuffer(body, dtype=np_dtype).reshape(shape)


def _ext_hook(code: int, data: bytes) -> object:
    if code not in (EXT_NDARRAY, EXT_TORCH):
        raise SerializationError(f"unknown msgpack extension type {code}")
    dtype, shape, offset = _decode_array_header(data)
    if code == EXT_NDARRAY and dtype == "bfloat16":
        raise SerializationError("numpy has no bfloat16; send it as a torch tensor")
    array = _numpy_view(dtype, shape, memoryview(data)[offset:])
    if code == EXT_NDARRAY:
        return array
    import torch  # only reached when a peer sent a torch tensor, i.e. torch is in use

    # frombuffer views are read-only; torch wants writable memory, so copy once here.
    tensor = torch.from_numpy(array.copy())
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def pack(value: object) -> bytes:
    """Serialize a value: msgpack types, numpy arrays and torch tensors. Raises TypeError."""
    packed: bytes = msgpack.packb(value, default=_default, use_bin_type=True)
    return packed


def unpack(data: bytes | memoryview) -> Any:
    """Deserialize a value from a remote; raises :class:`SerializationError` on garbage."""
    try:
        return msgpack.unpackb(
            data, ext_hook=_ext_hook, raw=False, use_list=True, strict_map_key=False
        )
    except SerializationError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise SerializationError(f"malformed msgpack: {e}") from e


def encode_frame(body: bytes) -> bytes:
    """A length-prefixed frame."""
    return encode_uvarint(len(body)) + body


class FrameDecoder:
    """Splits a byte stream into length-prefixed frames, bounded by ``max_frame_bytes``.

    Raises :class:`LimitExceeded` as soon as a prefix announces a larger frame (nothing
    of it is buffered) and :class:`SerializationError` for a malformed prefix.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._needed: int | None = None
        self._body_start = 0

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes; return every frame body now complete."""
        self._buffer += data
        frames: list[bytes] = []
        while True:
            if self._needed is None:
                try:
                    decoded = decode_uvarint(self._buffer)
                except VarintError as e:
                    raise SerializationError(f"bad frame length prefix: {e}") from e
                if decoded is None:
                    return frames
                length, self._body_start = decoded
                if length > self.max_frame_bytes:
                    raise LimitExceeded(
                        f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}"
                    )
                self._needed = length
            end = self._body_start + self._needed
            if len(self._buffer) < end:
                return frames
            frames.append(bytes(self._buffer[self._body_start : end]))
            del self._buffer[:end]
            self._needed = None

    def at_frame_boundary(self) -> bool:
        return not self._buffer
