"""The checkpoint file format, as bytes in and bytes out (no paths, no renames).

:func:`encode_state` turns a state tree into the bytes before the payload plus the
payload's buffers; :func:`decode_state` reads one back from an open binary file,
checking everything. :mod:`swarm.checkpoint` writes and reads files with them; the
layout and the reasons for it are described there.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from swarm.errors import CheckpointError

MAGIC = b"SWARMCKP"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIQ32s")  # magic, version, header length, SHA-256 of the header
MAX_HEADER_BYTES = 64 * 2**20
"""A header is names, shapes and small numbers: a model with 100k tensors needs ~10 MiB.
A larger length is corruption, and must not make us allocate it."""
_EXT_TENSOR = 1
_EXT_TUPLE = 2
_INDEX = struct.Struct("<Q")

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Tensor dtypes a checkpoint may hold, by their name in the header."""
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


# -- encoding ------------------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor, name: str) -> memoryview:
    if tensor.layout != torch.strided or tensor.is_meta or tensor.is_quantized:
        raise CheckpointError(f"{name}: cannot store a {tensor.layout} / meta / quantized tensor")
    if tensor.dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"{name}: dtype {tensor.dtype} is not supported")
    flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


class _Encoder:
    """Turns a state tree into a msgpack-able tree plus tensor descriptors and bytes."""

    def __init__(self) -> None:
        self.descriptors: list[dict[str, Any]] = []
        self.buffers: list[memoryview] = []
        self.offset = 0

    def encode(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            data = _tensor_bytes(value, path)
            self.descriptors.append(
                {
                    "name": path,
                    "dtype": _DTYPE_NAMES[value.dtype],
                    "shape": list(value.shape),
                    "offset": self.offset,
                    "nbytes": data.nbytes,
                }
            )
            self.buffers.append(data)
            self.offset += data.nbytes
            return msgpack.ExtType(_EXT_TENSOR, _INDEX.pack(len(self.buffers) - 1))
        if value is None or isinstance(value, bool | float | str | bytes):
            return value
        if isinstance(value, int):
            if not -(2**63) <= value < 2**64:
                raise CheckpointError(f"{path}: integer {value} does not fit 64 bits")
            return value
        if isinstance(value, tuple):
            items = [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(items))
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            out: dict[Any, Any] = {}
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, str | int):
                    raise CheckpointError(f"{path}: key {key!r} is not a str or an int")
                out[key] = self.encode(item, f"{path}/{key}")
            return out
        raise CheckpointError(f"{path}: cannot store a {type(value).__name__}")


def encode_state(state: Mapping[str, Any]) -> tuple[bytes, list[memoryview]]:
    """The file's bytes before the payload, and the payload's buffers (which are views of
    the state's CPU tensors, not copies: write them before changing the tensors).

    Raises :class:`CheckpointError` for a value the format cannot hold: an object other
    than a dict (str or int keys), list, tuple, None, bool, int (64-bit), float, str,
    bytes or dense tensor of a dtype in :data:`DTYPES`.
    """
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are little-endian; this machine is not")
    encoder = _Encoder()
    tree = encoder.encode(state, "")
    digest = hashlib.sha256()
    for buffer in encoder.buffers:
        digest.update(buffer)
    try:
        header = msgpack.packb(
            {
                "tensors": encoder.descriptors,
                "payload_bytes": encoder.offset,
                "payload_sha256": digest.digest(),
                "tree": tree,
            }
        )
    except (ValueError, TypeError, OverflowError) as e:  # e.g. a str that is not UTF-8
        raise CheckpointError(f"cannot encode the state: {e}") from e
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), hashlib.sha256(header).digest())
    return prefix + header, encoder.buffers


# -- decoding ------------------------------------------------------------------------


def _describe_foreign(start: bytes) -> str:
    if start.startswith(b"PK\x03\x04"):
        return " (it looks like a zip file, e.g. torch.save's format, which we never unpickle)"
    if start[:1] == b"\x80":
        return " (it looks like a pickle, which we never load)"
    return ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_descriptors(header: Any) -> list[tuple[str, torch.dtype, tuple[int, ...], int]]:
    if not isinstance(header, dict) or set(header) != {
        "tensors",
        "payload_bytes",
        "payload_sha256",
        "tree",
    }:
        raise CheckpointError("malformed header: unexpected fields")
    if (
        not isinstance(header["tensors"], list)
        or not _is_int(header["payload_bytes"])
        or not isinstance(header["payload_sha256"], bytes)
    ):
        raise CheckpointError("malformed header: bad tensor list, payload size or checksum")
    checked = []
    offset = 0
    for i, d in enumerate(header["tensors"]):
        try:
            name, dtype, shape = d["name"], DTYPES[d["dtype"]], tuple(d["shape"])
            nbytes = d["nbytes"]
            ok = (
                isinstance(name, str)
                and all(_is_int(n) and n >= 0 for n in shape)
                and _is_int(nbytes)
                and nbytes == math.prod(shape) * dtype.itemsize
                and d["offset"] == offset
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"malformed descriptor of tensor {i}: {e!r}") from e
        if not ok:
            raise CheckpointError(f"malformed descriptor of tensor {i}")
        checked.append((name, dtype, shape, nbytes))
        offset += nbytes
    if offset != header["payload_bytes"]:
        raise CheckpointError("malformed header: tensor sizes do not add up to the payload")
    return checked


def _read_exact(file: io.BufferedIOBase, buffer: bytearray) -> None:
    view = memoryview(buffer)
    while view:
        count = file.readinto(view)
        if not count:
            raise CheckpointError("truncated: the file ended inside the payload")
        view = view[count:]


def decode_state(file: io.BufferedIOBase, size: int) -> Any:
    """The state in ``file`` (positioned at its start; ``size`` bytes long), with tensors
    as new CPU tensors. Nothing is unpickled or executed.

    Raises :class:`CheckpointError` for a foreign file, an unsupported version, a
    truncated or corrupt file (size or checksum mismatch) or a malformed header.
    """
    prefix = file.read(_PREFIX.size)
    if not prefix.startswith(MAGIC):
        if MAGIC.startswith(prefix):
            raise CheckpointError(f"truncated: only {size} bytes")
        raise CheckpointError(f"not a swarmtrain checkpoint{_describe_foreign(prefix)}")
    if len(prefix) < _PREFIX.size:
        raise CheckpointError(f"truncated: only {size} bytes")
    _, version, header_len, header_sha = _PREFIX.unpack(prefix)
    if version != FORMAT_VERSION:
        newer = "; it was written by a newer swarmtrain" if version > FORMAT_VERSION else ""
        raise CheckpointError(
            f"unsupported checkpoint format version {version} "
            f"(this swarmtrain reads version {FORMAT_VERSION}{newer})"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(f"corrupt: header length {header_len} is over the bound")
    if _PREFIX.size + header_len > size:  # checked before reading: never allocate past it
        raise CheckpointError("truncated: the file ended inside the header")
    raw = file.read(header_len)
    if len(raw) < header_len:
        raise CheckpointError("truncated: the file ended inside the header")
    if hashlib.sha256(raw).digest() != header_sha:
        raise CheckpointError("corrupt: the header's checksum does not match")
    try:
        header = msgpack.unpackb(raw, strict_map_key=False, ext_hook=_lazy_ext)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CheckpointError(f"malformed header: {e}") from e
    descriptors = _check_descriptors(header)
    expected_size = _PREFIX.size + header_len + header["payload_bytes"]
    if size < expected_size:
        raise CheckpointError(f"truncated: {size} bytes, the header says {expected_size}")
    if size > expected_size:
        raise CheckpointError(f"corrupt: {size - expected_size} unexpected bytes at the end")
    digest = hashlib.sha256()
    tensors: list[torch.Tensor] = []
    for _, dtype, shape, nbytes in descriptors:
        buffer = bytearray(nbytes)
        _read_exact(file, buffer)
        digest.update(buffer)
        if nbytes == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            tensors.append(torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape))
    if digest.digest() != header["payload_sha256"]:
        raise CheckpointError("corrupt: the payload's checksum does not match")
    try:
        return _resolve(header["tree"], tensors)
    except RecursionError as e:  # tuples nested past Python's stack
        raise CheckpointError("malformed tree: nested too deeply") from e


@dataclass(frozen=True)
class _Ext:
    code: int
    data: bytes


def _lazy_ext(code: int, data: bytes) -> _Ext:
    return _Ext(code, data)


def _resolve(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Ext):
        if value.code == _EXT_TENSOR and len(value.data) == _INDEX.size:
            (index,) = _INDEX.unpack(value.data)
            if index < len(tensors):
                return tensors[index]
            raise CheckpointError(f"malformed tree: tensor reference {index} out of range")
        if value.code == _EXT_TUPLE:
            try:
                items = msgpack.unpackb(value.data, strict_map_key=False, ext_hook=_lazy_ext)
            except Exception as e:  # msgpack raises several unrelated types for bad input
                raise CheckpointError(f"malformed tuple in tree: {e}") from e
            if not isinstance(items, list):
                raise CheckpointError("malformed tuple in tree")
            return tuple(_resolve(v, tensors) for v in items)
        raise CheckpointError(f"malformed tree: unknown extension type {value.code}")
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    if isinstance(value, dict):
        for key in value:
            if isinstance(key, bool) or not isinstance(key, str | int):
                raise CheckpointError(f"malformed tree: a {type(key).__name__} key")
        return {k: _resolve(v, tensors) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    raise CheckpointError(f"malformed tree: a {type(value).__name__} value")
