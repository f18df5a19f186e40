"""The donor side of state sync: serve frozen snapshots of a state and announce them.

``StateServer`` serves, on a :class:`peers.Peer` (any
:class:`peers.stream_api.ReachableHost`), the manifest (unary) and the chunks
(streaming) of the last ``num_versions_kept`` versions given to :meth:`set_state`. A
version's snapshot is copied and hashed once, when it is set, and never changes after:
every download of a version gets the same bytes, whatever training does meanwhile.
With a DHT it announces ``{version, addrs}`` under ``f"{prefix}/state"``, in a subkey
only this peer can sign, and re-announces before the record expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from averaging.state.manifest import (
    CHUNKS_PROTOCOL,
    DEFAULT_CHUNK_BYTES,
    MANIFEST_PROTOCOL,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    ChunkRequest,
    ChunkResponse,
    Manifest,
    ManifestRequest,
    Snapshot,
    StateRequestError,
    VersionGoneError,
    build_snapshot,
)
from averaging.state.signing import sign_manifest
from peers.dht import DHT, owner_marker
from peers.errors import PeersError
from peers.identity import KeyPair, PeerID
from peers.rpc import CallContext, add_stream_handler
from peers.service import Service
from peers.stream_api import ReachableHost

logger = logging.getLogger(__name__)

#: Versions a server may be asked to keep: each is a full copy of the state in memory.
MAX_VERSIONS_KEPT = 8


def state_key(prefix: str) -> str:
    """The DHT key under which donors of ``prefix`` announce themselves."""
    return f"{prefix}/state"


@dataclass(frozen=True, kw_only=True)
class StateServerConfig:
    """How a :class:`StateServer` cuts, keeps and announces its state."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """Bytes per chunk (the last may be shorter). Every donor of one swarm should use the
    same value: a newcomer splits one version's chunks only among donors that agree."""
    num_versions_kept: int = 2
    """Versions served at once. Two lets a download of the previous version finish while
    the next is announced; each costs a copy of the state in memory."""
    hold_seconds: float = 60.0
    """A version whose manifest or a chunk was asked for within this many seconds stays
    served past ``num_versions_kept``: a peer that sets versions faster than a newcomer
    downloads one does not cut the download short."""
    max_versions_held: int = 4
    """Versions served at most, the held ones included (memory: a copy each)."""
    max_concurrent_streams: int = 32
    """Chunk streams served at once, from all peers; more are refused as busy."""
    max_streams_per_peer: int = 4
    """Chunk streams served at once to one peer (a newcomer needs one)."""
    announce_ttl_seconds: float = 120.0
    """Lifetime of a DHT announcement: a donor that vanishes stops being found after it."""
    announce_interval_seconds: float = 40.0
    """Seconds between re-announcements; must be shorter than ``announce_ttl_seconds``."""

    def __post_init__(self) -> None:
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if not 1 <= self.num_versions_kept <= MAX_VERSIONS_KEPT:
            raise ValueError(f"num_versions_kept must be in [1, {MAX_VERSIONS_KEPT}]")
        if not self.num_versions_kept <= self.max_versions_held <= MAX_VERSIONS_KEPT:
            raise ValueError(
                f"max_versions_held must be in [num_versions_kept, {MAX_VERSIONS_KEPT}]"
            )
        if not self.hold_seconds >= 0:
            raise ValueError("hold_seconds must be 0 or more")
        if self.max_concurrent_streams < 1 or self.max_streams_per_peer < 1:
            raise ValueError("stream limits must be at least 1")
        if not 0 < self.announce_interval_seconds < self.announce_ttl_seconds:
            raise ValueError("announce_interval_seconds must be in (0, announce_ttl_seconds)")


@dataclass(frozen=True, slots=True)
class StateServerStatistics:
    versions: tuple[int, ...]
    num_manifests_served: int
    num_chunks_served: int
    num_bytes_served: int
    num_requests_refused: int
    num_active_streams: int


class StateServer(Service):
    """Serve a state to newcomers. Use ``async with StateServer(peer, ...) as server``.

    ``dht`` and ``prefix`` (together) make it announce itself so newcomers can find it.
    With ``signer`` (a run key, :mod:`averaging.state.signing`), every manifest served
    is signed with it for ``prefix``.
    """

    def __init__(
        self,
        peer: ReachableHost,
        *,
        dht: DHT[Any] | None = None,
        prefix: str | None = None,
        config: StateServerConfig | None = None,
        signer: KeyPair | None = None,
    ) -> None:
        super().__init__()
        if (dht is None) != (prefix is None):
            raise ValueError("give both dht and prefix to announce, or neither")
        if signer is not None and prefix is None:
            raise ValueError("a run key signs states for a prefix: give one")
        self.signer = signer
        self.peer = peer
        self.dht = dht
        self.prefix = prefix
        self.config = config or StateServerConfig()
        self._snapshots: dict[int, Snapshot] = {}  # oldest first
        self._asked_at: dict[int, float] = {}  # version -> when a newcomer last asked for it
        self._streams: Counter[PeerID] = Counter()
        self._counters: Counter[str] = Counter()
        self._announce_now = asyncio.Event()

    async def _start(self) -> None:
        self._serve_unary(self.peer, MANIFEST_PROTOCOL, self.rpc_manifest, ManifestRequest)
        self._serve(
            lambda: add_stream_handler(self.peer, CHUNKS_PROTOCOL, self.rpc_chunks, ChunkRequest),
            lambda: self.peer.remove_stream_handler(CHUNKS_PROTOCOL),
        )
        if self.dht is not None:
            self._spawn(self._announce_forever())

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions served now, oldest first."""
        return tuple(self._snapshots)

    async def set_state(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, Any] | None = None,
        *,
        copy: bool = True,
    ) -> Manifest:
        """Serve ``tensors`` and ``metadata`` as ``version`` from now on, and announce it.

        The tensors are copied (in a worker thread, so the loop keeps serving) unless
        ``copy`` is False and they are contiguous CPU tensors: then the caller must not
        modify them while this version is served. The oldest version is dropped past
        ``num_versions_kept``. Returns the version's manifest. Raises ValueError if
        ``version`` is not newer than every version served, and ValueError or TypeError
        for a state that cannot be served (see :func:`build_snapshot`).
        """
        self._check_newer(version)
        snapshot = await asyncio.to_thread(
            build_snapshot,
            version,
            tensors,
            metadata,
            chunk_bytes=self.config.chunk_bytes,
            copy=copy,
        )
        self._check_newer(version)  # another set_state may have finished meanwhile
        if self.signer is not None:
            assert self.prefix is not None
            signed = sign_manifest(self.signer, self.prefix, snapshot.manifest)
            snapshot = replace(snapshot, manifest=signed)
        self._snapshots[version] = snapshot
        self._drop_old_versions()
        self._announce_now.set()
        return snapshot.manifest

    def _drop_old_versions(self) -> None:
        """Keep the newest ``num_versions_kept`` versions, and older ones a newcomer asked
        for within ``hold_seconds``, at most ``max_versions_held`` in all (the newest)."""
        now = time.monotonic()
        older = list(self._snapshots)[: -self.config.num_versions_kept]
        for version in older:
            held = now < self._asked_at.get(version, -math.inf) + self.config.hold_seconds
            if not held or len(self._snapshots) > self.config.max_versions_held:
                del self._snapshots[version]
                self._asked_at.pop(version, None)

    def _check_newer(self, version: int) -> None:
        if self._snapshots and version <= max(self._snapshots):
            raise ValueError(
                f"version {version} is not newer than {max(self._snapshots)}: a served "
                "version never changes"
            )

    def _snapshot(self, version: int | None) -> Snapshot:
        if not self._snapshots:
            raise StateRequestError("no state is served here yet")
        if version is None:
            version = max(self._snapshots)
        snapshot = self._snapshots.get(version)
        if snapshot is None:
            raise VersionGoneError(
                f"version {version} is not served here (serving {list(self._snapshots)})"
            )
        self._asked_at[version] = time.monotonic()
        return snapshot

    # --- handlers -------------------------------------------------------------------

    async def rpc_manifest(self, request: ManifestRequest, context: CallContext) -> Manifest:
        try:
            snapshot = self._snapshot(request.version)
        except StateRequestError:
            self._counters["refused"] += 1
            raise
        self._counters["manifests"] += 1
        return snapshot.manifest

    async def rpc_chunks(
        self, requests: AsyncIterator[ChunkRequest], context: CallContext
    ) -> AsyncIterator[ChunkResponse]:
        """Answer chunk requests one at a time, in order. A stream over the limits, a
        version not served or an index out of range ends the stream with an error."""
        peer_id = context.remote_peer_id
        if (
            self._streams.total() >= self.config.max_concurrent_streams
            or self._streams[peer_id] >= self.config.max_streams_per_peer
        ):
            self._counters["refused"] += 1
            raise StateRequestError("too many state downloads at once: try another donor")
        self._streams[peer_id] += 1
        try:
            async for request in requests:
                try:
                    snapshot = self._snapshot(request.version)
                    parts = snapshot.chunk_parts(request.index)
                except StateRequestError:
                    self._counters["refused"] += 1
                    raise
                except IndexError as e:
                    self._counters["refused"] += 1
                    raise StateRequestError(str(e)) from e
                self._counters["chunks"] += 1
                self._counters["bytes"] += sum(len(p) for p in parts)
                yield ChunkResponse(request.index, parts)
        finally:
            self._streams[peer_id] -= 1
            if not self._streams[peer_id]:
                del self._streams[peer_id]

    # --- announcing -------------------------------------------------------------------

    async def _announce_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.announce_interval_seconds):
                    await self._announce_now.wait()
            self._announce_now.clear()
            if self._snapshots:
                try:
                    await self.announce()
                except (PeersError, TimeoutError) as e:
                    logger.info("state announcement failed: %r", e)

    async def announce(self) -> bool:
        """Announce the newest version now; True if a DHT replica accepted it. Raises
        ValueError without a DHT or a state."""
        if self.dht is None or self.prefix is None or not self._snapshots:
            raise ValueError("announcing needs a DHT, a prefix and a state")
        value = {
            "version": max(self._snapshots),
            # Relayed addresses too: a donor behind NAT serves through its relays.
            "addrs": [str(a) for a in self.peer.advertised_addrs],
        }
        return await self.dht.store(
            state_key(self.prefix),
            value,
            self.dht.clock() + self.config.announce_ttl_seconds,
            subkey=owner_marker(self.peer.peer_id),
        )

    def statistics(self) -> StateServerStatistics:
        return StateServerStatistics(
            versions=self.versions,
            num_manifests_served=self._counters["manifests"],
            num_chunks_served=self._counters["chunks"],
            num_bytes_served=self._counters["bytes"],
            num_requests_refused=self._counters["refused"],
            num_active_streams=self._streams.total(),
        )
