"""State sync, the pure part: wire messages, bounds, errors, and the byte layout of a state.

A *state* is named tensors plus a small metadata dict, served under an integer
``version``. Its bytes form one stream: the tensors' raw C-order bytes, in the
manifest's order, back to back. The stream is cut into chunks of ``chunk_bytes`` (a
chunk may span several tensors, so a model's many small biases do not each cost a
request). The :class:`Manifest` lists the tensors, the chunk size, the sha256 of every
chunk, and a checksum of the whole state (its layout, metadata and bytes).

Nothing here does I/O: :class:`Layout` says which bytes of which tensors a chunk holds,
:func:`build_snapshot` freezes a state for serving, :func:`layout_from_manifest`
validates a manifest from a peer, and :func:`state_checksum` hashes a state.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from peers.errors import PeersError, RemoteProtocolError
from peers.serialization import MAX_ARRAY_DIMS, MAX_FRAME_BYTES, SerializationError, pack, unpack

MANIFEST_PROTOCOL = "/swarmtrain/state/manifest/1.0.0"
CHUNKS_PROTOCOL = "/swarmtrain/state/chunks/1.0.0"

#: sha256, for every chunk and for the whole state.
DIGEST_BYTES = 32
#: Smallest chunk a donor may use: below this the 32-byte digest and per-request framing
#: become a noticeable share of the traffic. Small enough for tests with small states.
MIN_CHUNK_BYTES = 4 * 1024
#: Largest chunk: half a frame (peers.serialization.MAX_FRAME_BYTES = 16 MiB), leaving
#: room for the frame's head (one array descriptor per tensor the chunk spans).
MAX_CHUNK_BYTES = MAX_FRAME_BYTES // 2
#: Default chunk: small enough that a dead donor costs little to re-fetch and a slow
#: link delivers one in seconds, large enough that per-chunk overhead is negligible.
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
#: Most chunks in a state: bounds the manifest's digests to 4 MiB (a quarter frame).
#: With the largest chunks a state may be 1 TiB.
MAX_CHUNKS = 1 << 17
#: Most tensors in a state. Large models have a few thousand parameters plus as many
#: optimizer tensors; this bounds the manifest's tensor list (with MAX_NAME_CHARS) to
#: ~9 MiB, so a manifest always fits in one frame.
MAX_TENSORS = 1 << 15
#: Longest tensor name; module paths are well under 200 characters.
MAX_NAME_CHARS = 256
#: Largest packed metadata: step and epoch counters, hyperparameters, a scheduler's
#: state. Tensors belong in the tensors, not here.
MAX_METADATA_BYTES = 1024 * 1024

#: dtypes a state may hold: those peers.serialization lets travel, by torch name.
DTYPES: Mapping[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 "
        "float16 bfloat16 float32 float64 complex64 complex128"
    ).split()
}
_CHECKSUM_DOMAIN = b"swarmtrain-state-v1"


class StateSyncError(PeersError):
    """A state could not be served or downloaded (base of every state sync error)."""


class StateSyncTimeout(StateSyncError, TimeoutError):
    """The download did not finish by its deadline."""


class DonorError(StateSyncError, RemoteProtocolError):
    """A donor sent something wrong: a malformed or oversized manifest, a chunk of the
    wrong size or with a bad checksum. Costs only that donor."""


class StateRequestError(StateSyncError, RemoteProtocolError):
    """A request to a donor names a version it does not serve or a chunk out of range,
    or the donor is too busy; the caller receives it as a ``RemoteError``."""


class VersionGoneError(StateRequestError):
    """The version asked for is not (or no longer) served by this donor: it moved on to
    newer ones. Not a fault: a newcomer looks again for what the donor serves now."""


# --- wire messages ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # a key of DTYPES
    shape: list[int]


@dataclass(frozen=True)
class ManifestRequest:
    version: int | None = None  # None: the newest the donor serves


@dataclass(frozen=True)
class Manifest:
    """What a donor serves under one version."""

    version: int
    metadata: bytes  # peers.serialization.pack of a dict
    tensors: list[TensorSpec]
    chunk_bytes: int
    chunk_digests: bytes  # DIGEST_BYTES per chunk, in order
    state_checksum: bytes  # state_checksum() of the whole state
    signer: bytes = b""  # a run key's PeerID bytes, if one signed it (averaging.state.signing)
    signature: bytes = b""  # its Ed25519 signature (averaging.state.signing)


@dataclass(frozen=True)
class ChunkRequest:
    version: int
    index: int


@dataclass(frozen=True)
class ChunkResponse:
    """One chunk: its bytes as uint8 arrays, one per tensor segment it spans (sent out of
    band, zero-copy)."""

    index: int
    parts: list[np.ndarray]


# --- layout -------------------------------------------------------------------------------


class Layout:
    """Where each tensor's bytes sit in the state's byte stream, and how chunks cut it."""

    def __init__(self, specs: Sequence[TensorSpec], chunk_bytes: int) -> None:
        self.specs = tuple(specs)
        self.chunk_bytes = chunk_bytes
        self.sizes = tuple(math.prod(s.shape) * DTYPES[s.dtype].itemsize for s in self.specs)
        self.offsets: list[int] = []
        total = 0
        for size in self.sizes:
            self.offsets.append(total)
            total += size
        self.total_bytes = total
        self.num_chunks = -(-total // chunk_bytes)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """The chunk's ``[start, end)`` in the state's byte stream."""
        if not 0 <= index < self.num_chunks:
            raise IndexError(f"chunk {index} is out of range (the state has {self.num_chunks})")
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def chunk_size(self, index: int) -> int:
        start, end = self.chunk_range(index)
        return end - start

    def segments(self, index: int) -> list[tuple[int, int, int]]:
        """``(tensor index, start, end)`` byte ranges within tensors that make up the
        chunk, in order (empty tensors never appear)."""
        start, end = self.chunk_range(index)
        out = []
        i = bisect.bisect_right(self.offsets, start) - 1
        while start < end:
            tensor_end = self.offsets[i] + self.sizes[i]
            if tensor_end > start:
                stop = min(end, tensor_end)
                out.append((i, start - self.offsets[i], stop - self.offsets[i]))
                start = stop
            i += 1
        return out

    def encode(self) -> bytes:
        """The layout as bytes, for checksums: names, dtypes and shapes in order."""
        packed: bytes = msgpack.packb([[s.name, s.dtype, s.shape] for s in self.specs])
        return packed


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    view: np.ndarray = tensor.reshape(-1).view(torch.uint8).numpy()
    return view


def state_checksum(layout: Layout, metadata: bytes, views: Sequence[np.ndarray]) -> bytes:
    """sha256 of the layout, the packed metadata and every tensor's bytes, in order. Each
    piece is length-prefixed so no two states share a checksum by shifting bytes across
    a boundary. Independent of the chunk size."""
    digest = hashlib.sha256(_CHECKSUM_DOMAIN)
    for piece in (layout.encode(), metadata):
        digest.update(len(piece).to_bytes(8, "little"))
        digest.update(piece)
    for view in views:
        digest.update(view.data)
    return digest.digest()


def chunk_digests(layout: Layout, views: Sequence[np.ndarray]) -> bytes:
    out = bytearray()
    for index in range(layout.num_chunks):
        digest = hashlib.sha256()
        for tensor, start, end in layout.segments(index):
            digest.update(views[tensor][start:end].data)
        out += digest.digest()
    return bytes(out)


# --- the donor's frozen state -------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Snapshot:
    """One version of a state, frozen for serving: its manifest and its tensors' bytes."""

    manifest: Manifest
    layout: Layout
    tensors: tuple[torch.Tensor, ...]
    views: tuple[np.ndarray, ...]

    def chunk_parts(self, index: int) -> list[np.ndarray]:
        """The chunk's bytes as views of the snapshot (no copy). IndexError if out of range."""
        return [self.views[t][start:end] for t, start, end in self.layout.segments(index)]


def build_snapshot(
    version: int,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, Any] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    copy: bool = True,
) -> Snapshot:
    """Freeze a state: copy the tensors to contiguous CPU memory (unless ``copy`` is False
    and they already are), hash every chunk and the whole. CPU-bound (two sha256 passes
    over the state): run it in a thread for large states.

    Raises ValueError or TypeError for a state that could not be served: a negative
    version, a name or dtype that cannot travel, too many tensors or chunks, metadata
    that does not pack or is too large.
    """
    if version < 0:
        raise ValueError(f"version must be non-negative, got {version}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a state holds at most {MAX_TENSORS} tensors, got {len(tensors)}")
    specs, held = [], []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"tensor names must be strings of 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} is a {type(tensor).__name__}, not a torch.Tensor")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}, which cannot travel")
        if tensor.dim() > MAX_ARRAY_DIMS:
            raise ValueError(f"{name} has more than {MAX_ARRAY_DIMS} dimensions")
        tensor = tensor.detach()
        if copy or tensor.device.type != "cpu" or not tensor.is_contiguous():
            frozen = torch.empty(tensor.shape, dtype=tensor.dtype)
            frozen.copy_(tensor)
            tensor = frozen
        specs.append(TensorSpec(name, dtype, list(tensor.shape)))
        held.append(tensor)
    packed_metadata = pack(dict(metadata or {}))  # TypeError if it does not pack
    if len(packed_metadata) > MAX_METADATA_BYTES:
        raise ValueError(
            f"metadata packs to {len(packed_metadata)} bytes, at most {MAX_METADATA_BYTES}"
        )
    layout = Layout(specs, chunk_bytes)
    if layout.num_chunks > MAX_CHUNKS:
        raise ValueError(
            f"the state needs {layout.num_chunks} chunks, at most {MAX_CHUNKS}: use larger chunks"
        )
    views = tuple(byte_view(t) for t in held)
    manifest = Manifest(
        version=version,
        metadata=packed_metadata,
        tensors=specs,
        chunk_bytes=chunk_bytes,
        chunk_digests=chunk_digests(layout, views),
        state_checksum=state_checksum(layout, packed_metadata, views),
    )
    return Snapshot(manifest, layout, tuple(held), views)


# --- checking a manifest from a peer ------------------------------------------------------


def layout_from_manifest(manifest: Manifest, *, max_state_bytes: int) -> Layout:
    """Validate a donor's manifest and return its layout.

    Raises :class:`DonorError` saying what is wrong: a bad version, too many tensors,
    a duplicate or overlong name, an unknown dtype, a bad shape, a state larger than
    ``max_state_bytes``, a chunk size out of bounds, digests that do not match the chunk
    count, or metadata that is oversized or not a dict.
    """
    if manifest.version < 0:
        raise DonorError(f"manifest has a negative version {manifest.version}")
    if len(manifest.tensors) > MAX_TENSORS:
        raise DonorError(f"manifest lists {len(manifest.tensors)} tensors, at most {MAX_TENSORS}")
    if not MIN_CHUNK_BYTES <= manifest.chunk_bytes <= MAX_CHUNK_BYTES:
        raise DonorError(f"manifest's chunk size {manifest.chunk_bytes} is out of bounds")
    names: set[str] = set()
    total = 0
    for spec in manifest.tensors:
        if not 0 < len(spec.name) <= MAX_NAME_CHARS or spec.name in names:
            raise DonorError(f"manifest has an empty, overlong or repeated name {spec.name[:80]!r}")
        names.add(spec.name)
        if spec.dtype not in DTYPES:
            raise DonorError(f"manifest gives {spec.name} the unknown dtype {spec.dtype[:32]!r}")
        if len(spec.shape) > MAX_ARRAY_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= max_state_bytes
            for d in spec.shape
        ):
            raise DonorError(f"manifest gives {spec.name} an invalid shape")
        total += math.prod(spec.shape) * DTYPES[spec.dtype].itemsize
        if total > max_state_bytes:
            raise DonorError(f"manifest describes more than {max_state_bytes} bytes of state")
    layout = Layout(manifest.tensors, manifest.chunk_bytes)
    if layout.num_chunks > MAX_CHUNKS:
        raise DonorError(f"manifest needs {layout.num_chunks} chunks, at most {MAX_CHUNKS}")
    if len(manifest.chunk_digests) != DIGEST_BYTES * layout.num_chunks:
        raise DonorError(
            f"manifest has {len(manifest.chunk_digests)} bytes of chunk digests for "
            f"{layout.num_chunks} chunks"
        )
    if len(manifest.state_checksum) != DIGEST_BYTES:
        raise DonorError("manifest's state checksum is not a sha256 digest")
    decode_metadata(manifest.metadata)
    return layout


def decode_metadata(data: bytes) -> dict[str, Any]:
    """The metadata dict of a manifest; :class:`DonorError` if oversized or malformed."""
    if len(data) > MAX_METADATA_BYTES:
        raise DonorError(f"manifest's metadata is {len(data)} bytes, at most {MAX_METADATA_BYTES}")
    try:
        metadata = unpack(data)
    except SerializationError as e:
        raise DonorError(f"manifest's metadata does not decode: {e}") from e
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise DonorError("manifest's metadata is not a dict with string keys")
    return metadata


def chunk_digest(manifest: Manifest, index: int) -> bytes:
    return manifest.chunk_digests[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]
