"""Wire values: msgpack with arrays as out-of-band raw buffers, and length-prefixed frames.

A serialized value is ``uvarint(len(head)) head raw...``: ``head`` is msgpack in which
each array is an extension ``EXT_NDARRAY`` (or ``EXT_TORCH`` for a torch tensor) holding
only its descriptor ``[dtype, shape]``; the arrays' raw C-order bytes follow the head,
in the order the descriptors appear. So an array is never copied into a msgpack
buffer on the way out (:func:`pack_buffers` returns the array's own memory), and on
the way in it is a ``numpy.frombuffer`` view of the received frame. Nothing is pickled.

Frames are an unsigned-varint length then that many bytes (libp2p's usual framing).
:class:`FrameDecoder` is a pure state machine that refuses a length over its bound
*before* buffering the body.
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
#: Longest array descriptor (dtype name and shape) we decode; a remote cannot make us
#: parse a huge shape list.
MAX_ARRAY_HEADER_BYTES = 512
#: Most dimensions an array may have (numpy's own limit is 64).
MAX_ARRAY_DIMS = 32
#: Most containers and container elements one value may hold, all levels together.
#: msgpack spends one byte on an empty list that costs Python 64: without a bound a
#: 16 MiB frame of them became 1.2 GiB of objects and seconds of event-loop time. Arrays
#: travel out of band and bytes are one object each, so real messages stay far below.
MAX_VALUE_ITEMS = 1 << 18
#: dtypes that may travel. Object and void dtypes would let a peer smuggle arbitrary
#: Python objects or unbounded structures; they are refused.
_ALLOWED_DTYPES = frozenset(
    "bool int8 uint8 int16 uint16 int32 uint32 int64 uint64 float16 float32 float64 "
    "complex64 complex128 bfloat16".split()
)


#: numpy's ``dtype.name`` is computed in Python on every access, several times per array
#: sent or received (docs/benchmarks.md, "Figures behind constants"); the names of the
#: dtypes that may travel, cached.
_NAMES = {np.dtype(name): name for name in _ALLOWED_DTYPES if name != "bfloat16"}
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, fast for the dtypes that may travel."""
    name = _NAMES.get(dtype)
    return dtype.name if name is None else name


class SerializationError(RemoteProtocolError):
    """A frame or value from the remote cannot be decoded."""


class _Packer:
    """Collects the raw buffers of the arrays met while packing one value."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def _descriptor(
        self, code: int, dtype: str, shape: tuple[int, ...], raw: memoryview
    ) -> msgpack.ExtType:
        self.buffers.append(raw)
        return msgpack.ExtType(code, msgpack.packb([dtype, list(shape)]))

    def default(self, obj: object) -> object:
        if isinstance(obj, np.ndarray):
            name = dtype_name(obj.dtype)
            if name not in _ALLOWED_DTYPES:
                raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent")
            if not obj.dtype.isnative:  # e.g. big-endian: the wire carries native order
                obj = obj.astype(obj.dtype.newbyteorder("="))
            array = np.ascontiguousarray(obj)  # a copy only if it was not contiguous
            return self._descriptor(
                EXT_NDARRAY, name, array.shape, array.reshape(-1).view(np.uint8).data
            )
        if isinstance(obj, np.generic):
            return obj.item()
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            name = str(tensor.dtype).removeprefix("torch.")
            if name not in _ALLOWED_DTYPES:
                raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent")
            raw = (tensor.view(torch.int16) if name == "bfloat16" else tensor).numpy()
            return self._descriptor(
                EXT_TORCH, name, tuple(tensor.shape), raw.reshape(-1).view(np.uint8).data
            )
        if isinstance(obj, tuple | set | frozenset):
            return list(obj)
        raise TypeError(f"cannot serialize {type(obj).__name__}")


def pack_buffers(value: object) -> list[bytes | memoryview]:
    """Serialize ``value`` as a list of buffers whose concatenation is the wire form.

    Array bodies are views of the arrays themselves (no copy): do not modify them until
    the buffers are written. Raises TypeError for values that cannot travel.
    """
    packer = _Packer()
    head: bytes = msgpack.packb(value, default=packer.default, use_bin_type=True)
    return [encode_uvarint(len(head)), head, *packer.buffers]


def pack(value: object) -> bytes:
    """Serialize a value (msgpack types, numpy arrays, torch tensors) into one bytes."""
    return b"".join(pack_buffers(value))


def frame_buffers(value: object) -> list[bytes | memoryview]:
    """A length-prefixed frame carrying ``value``, as buffers (see :func:`pack_buffers`)."""
    buffers = pack_buffers(value)
    return [encode_uvarint(sum(len(b) for b in buffers)), *buffers]


def _decode_descriptor(data: bytes) -> tuple[str, tuple[int, ...]]:
    if len(data) > MAX_ARRAY_HEADER_BYTES:
        raise SerializationError("array descriptor is too long")
    try:
        dtype, shape = msgpack.unpackb(data, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise SerializationError(f"array descriptor is malformed: {e}") from e
    if not isinstance(dtype, str) or dtype not in _ALLOWED_DTYPES:
        raise SerializationError(f"array dtype {dtype!r} is not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_ARRAY_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)
    ):
        raise SerializationError(f"array shape {shape!r} is invalid")
    return dtype, tuple(shape)


class _Unpacker:
    """Hands out views of the raw section, in order, as descriptors are decoded."""

    def __init__(self, raw: memoryview, max_items: int) -> None:
        self.raw = raw
        self.offset = 0
        self.items = 0
        self.max_items = max_items

    def _count(self, size: int) -> None:
        self.items += size + 1
        if self.items > self.max_items:
            raise SerializationError(f"value holds more than {self.max_items} items")

    def list_hook(self, value: list[object]) -> list[object]:
        self._count(len(value))
        return value

    def object_hook(self, value: dict[object, object]) -> dict[object, object]:
        self._count(len(value))
        return value

    def ext_hook(self, code: int, data: bytes) -> object:
        if code not in (EXT_NDARRAY, EXT_TORCH):
            raise SerializationError(f"unknown msgpack extension type {code}")
        dtype, shape = _decode_descriptor(data)
        if code == EXT_NDARRAY and dtype == "bfloat16":
            raise SerializationError("numpy has no bfloat16; send it as a torch tensor")
        np_dtype = _DTYPES["int16"] if dtype == "bfloat16" else _DTYPES[dtype]
        count = 1
        for dim in shape:
            count *= dim
        num_bytes = count * np_dtype.itemsize
        if num_bytes > len(self.raw) - self.offset:
            raise SerializationError(
                f"array of shape {shape} and dtype {dtype} needs {num_bytes} bytes, "
                f"only {len(self.raw) - self.offset} remain"
            )
        body = self.raw[self.offset : self.offset + num_bytes]
        self.offset += num_bytes
        array = np.frombuffer(body, dtype=np_dtype).reshape(shape)
        if code == EXT_NDARRAY:
            return array
        try:  # only reached when a peer sent a torch tensor; peers never needs torch
            import torch
        except ImportError as e:  # a bootstrap peer, say: it has no use for tensors
            raise SerializationError(
                "the remote sent a torch tensor, and this peer has no torch, so it cannot "
                f"take tensors ({e})"
            ) from e

        # torch wants writable memory: a view of a read-only buffer is copied once here;
        # one of a frame the caller owns (``FrameDecoder``'s bytearray) is used as it is.
        tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
        return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def unpack(data: bytes | bytearray | memoryview, *, max_items: int = MAX_VALUE_ITEMS) -> Any:
    """Deserialize a value from a remote; raises :class:`SerializationError` on garbage,
    on more than ``max_items`` containers and container elements (a protocol whose
    messages are small passes a smaller bound), and on a torch tensor in a process
    without torch.

    Arrays in the result are views of ``data`` (no copy): read-only if ``data`` is, else
    writable, sharing its memory, and so are torch tensors (copied only from read-only
    ``data``). Pass a buffer nothing else will change.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    try:
        decoded = decode_uvarint(view)
    except VarintError as e:
        raise SerializationError(f"bad value head length: {e}") from e
    if decoded is None or decoded[0] > len(view) - decoded[1]:
        raise SerializationError("value is truncated")
    head_len, start = decoded
    unpacker = _Unpacker(view[start + head_len :], max_items)
    try:
        value = msgpack.unpackb(
            view[start : start + head_len],
            ext_hook=unpacker.ext_hook,
            list_hook=unpacker.list_hook,
            object_hook=unpacker.object_hook,
            max_array_len=max_items,
            max_map_len=max_items,
            raw=False,
            use_list=True,
            strict_map_key=False,
        )
    except SerializationError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise SerializationError(f"malformed msgpack: {e}") from e
    if unpacker.offset != len(unpacker.raw):
        raise SerializationError(
            f"{len(unpacker.raw) - unpacker.offset} raw bytes follow the value unclaimed"
        )
    return value


def encode_frame(body: bytes) -> bytes:
    """A length-prefixed frame."""
    return encode_uvarint(len(body)) + body


class FrameDecoder:
    """Splits a byte stream into length-prefixed frames, bounded by ``max_frame_bytes``.

    A body is collected as the pieces it arrived in and joined once when complete (one
    copy), into a ``bytearray`` the caller owns: :func:`unpack` of it gives writable
    arrays, which need no second copy to become tensors. A body that arrived whole, in a
    writable piece it fills at least half of, is returned as a view of that piece instead
    (no copy; the piece must be the caller's to give). Raises :class:`LimitExceeded`
    as soon as a prefix announces a larger frame
    (nothing of it is buffered) and :class:`SerializationError` for a malformed prefix.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._head = b""  # an incomplete length prefix (< 10 bytes)
        self._parts: list[memoryview] = []
        self._have = 0
        self._needed: int | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._head) + self._have

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytearray | memoryview]:
        """Add bytes; return every frame body now complete. ``data`` must not change
        afterwards: pieces of a frame still incomplete are kept as views of it."""
        frames: list[bytearray | memoryview] = []
        view = memoryview(data)
        whole = len(view)
        while view:
            if self._needed is None:
                probe = self._head + bytes(view[:10])
                try:
                    decoded = decode_uvarint(probe)
                except VarintError as e:
                    raise SerializationError(f"bad frame length prefix: {e}") from e
                if decoded is None:
                    self._head = probe
                    return frames
                length, end = decoded
                if length > self.max_frame_bytes:
                    raise LimitExceeded(
                        f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes}"
                    )
                view = view[end - len(self._head) :]
                self._head = b""
                self._needed = length
            take = min(len(view), self._needed - self._have)
            if take == self._needed and not view.readonly and 2 * take >= whole:
                frames.append(view[:take])  # whole, writable and most of ``data``
                view = view[take:]
                self._needed = None
                continue
            if take:
                self._parts.append(view[:take])
                self._have += take
                view = view[take:]
            if self._have == self._needed:
                frames.append(bytearray().join(self._parts))
                self._parts.clear()
                self._have = 0
                self._needed = None
        return frames

    def at_frame_boundary(self) -> bool:
        return self._needed is None and not self._head
