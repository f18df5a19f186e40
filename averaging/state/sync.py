"""A newcomer downloads a state from several donors in parallel: :func:`load_state_from_peers`.

1. Find donors: the ones given, or those announced in the DHT under ``f"{prefix}/state"``.
2. Ask each (concurrently) for its manifest; validate it (and, with ``max_version`` and
   ``check``, that it is not ahead of what the caller trusts and fits the caller's
   state); group donors whose manifests are identical. A group's *support* is how many
   distinct sources (:func:`peers.subnets.source_group`: networks, not identities)
   offer it; keep the newest version whose group has at least ``quorum`` support, and
   within it the group with the most.
3. Allocate the state's tensors once and fetch chunks from every donor of the group at
   once, one stream per donor with a few requests in flight, each donor pulling the next
   pending chunk (:class:`averaging.state.schedule.ChunkSchedule`). Each chunk's sha256
   is checked before it is written in place. A donor that dies, stalls for
   ``chunk_timeout`` or sends a bad chunk is dropped and its chunks go to the others.
4. If every donor of the group is lost, find donors again and resume with the chunks
   already verified (when the new group serves the same state).
5. Hash the assembled state and compare it with the manifest's whole-state checksum.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from multiaddr import Multiaddr

from averaging.state.donor import state_key
from averaging.state.manifest import (
    CHUNKS_PROTOCOL,
    DTYPES,
    MANIFEST_PROTOCOL,
    ChunkRequest,
    ChunkResponse,
    DonorError,
    Layout,
    Manifest,
    ManifestRequest,
    StateSyncError,
    StateSyncTimeout,
    TensorSpec,
    VersionGoneError,
    byte_view,
    chunk_digest,
    decode_metadata,
    layout_from_manifest,
    state_checksum,
)
from averaging.state.records import DonorReport, LoadedState, StateSyncConfig, SyncReport
from averaging.state.schedule import ChunkSchedule
from averaging.state.signing import check_signed
from peers.dht import DHT, owner_of
from peers.errors import PeersError, RemoteError
from peers.identity import PeerID
from peers.rpc import call_stream, call_unary
from peers.serialization import pack
from peers.stream_api import AddressedHost
from peers.subnets import source_group
from peers.wire import to_wire

logger = logging.getLogger(__name__)

#: Addresses taken from one DHT announcement (a peer has a handful).
MAX_ANNOUNCED_ADDRS = 8
#: Donors whose manifests one discovery round asks for at once.
MAX_MANIFEST_QUERIES = 32
#: Times one donor may move on to a newer version under a download (its chunks then
#: come from the version it serves now) before it is dropped: a donor whose versions
#: always change faster than a download ends cannot provide a state.
MAX_MOVES_PER_DONOR = 3

Donor: TypeAlias = "PeerID | Multiaddr | str"
ProgressCallback = Callable[[int, int], None]
#: ``check(version, tensors, metadata)``: why a donor's state does not fit the caller
#: (shapes, dtypes, counters it needs), or ``None`` if it does. Checked on the manifest,
#: before a byte is downloaded, so a state that does not fit costs only its donors.
StateCheck = Callable[[int, Sequence[TensorSpec], dict[str, Any]], str | None]


@dataclass
class _Offer:
    """A donor's validated manifest."""

    peer_id: PeerID
    manifest: Manifest
    layout: Layout
    source: str
    """The donor's :func:`~peers.subnets.source_group`: donors behind one network prefix
    support a state once, however many identities they use."""
    key: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.key = hashlib.sha256(pack(to_wire(self.manifest))).digest()


async def load_state_from_peers(
    peer: AddressedHost,
    *,
    donors: Sequence[Donor] | None = None,
    dht: DHT[Any] | None = None,
    prefix: str | None = None,
    version: int | None = None,
    max_version: int | None = None,
    quorum: int = 1,
    check: StateCheck | None = None,
    timeout: float | None = None,
    config: StateSyncConfig | None = None,
    on_progress: ProgressCallback | None = None,
) -> LoadedState:
    """Download a state from ``donors`` (PeerIDs or multiaddrs) or from the donors
    announced in ``dht`` under ``prefix``; ``version`` asks for that version, else the
    newest offered by at least ``quorum`` distinct sources (identical manifests; by all
    that answered if fewer did), none newer than ``max_version``. A donor whose manifest
    ``check`` rejects, or that offers a version above ``max_version``, is dropped before
    anything is downloaded. With ``config.trusted_signers`` (run keys), only manifests
    one of them signed for ``prefix`` count, and one donor suffices.
    ``on_progress(bytes_verified, bytes_total)`` runs after each chunk.

    Raises :class:`StateSyncError` if no group of donors can provide a verified state
    (none found, all dropped: the message says why each was), and
    :class:`StateSyncTimeout` (also a ``TimeoutError``) when ``timeout`` seconds pass.
    Without ``timeout`` it still cannot hang: every step waits at most
    ``manifest_timeout`` or ``chunk_timeout``, and each failed round drops donors for
    good. Cancelling it cancels every request (the donors' handlers stop).
    """
    if donors is None and (dht is None or prefix is None):
        raise ValueError("give donors, or a dht and a prefix to find them")
    if quorum < 1:
        raise ValueError("quorum must be at least 1")
    config = config or StateSyncConfig()
    if config.trusted_signers and prefix is None:
        raise ValueError("a run key signs a run's states under its prefix: give the prefix")
    sync = _Sync(peer, config, _Wanted(version, max_version, quorum, check, prefix), on_progress)
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            return await sync.run(donors, dht, prefix)
    except TimeoutError as e:
        if not deadline.expired():
            raise
        raise StateSyncTimeout(
            f"state download did not finish in {timeout} s ({sync.describe()})"
        ) from e


@dataclass(frozen=True, slots=True)
class _Wanted:
    """Which states the caller accepts."""

    version: int | None
    max_version: int | None
    quorum: int
    check: StateCheck | None
    prefix: str | None  # the run's; with trusted signers, what their signatures name


class _Sync:
    """One call of :func:`load_state_from_peers`: its donors, its download, its report."""

    def __init__(
        self,
        peer: AddressedHost,
        config: StateSyncConfig,
        wanted: _Wanted,
        on_progress: ProgressCallback | None,
    ) -> None:
        self.peer = peer
        self.config = config
        self.wanted = wanted
        self.on_progress = on_progress
        self.started = time.monotonic()
        self.failures: dict[PeerID, str] = {}  # donors out for good, and why
        self.moves: Counter[PeerID] = Counter()  # versions donors dropped under a download
        self.unreachable: dict[str, str] = {}  # donors we could not even identify
        self.asked: list[PeerID] = []
        self.download: _Download | None = None

    async def run(
        self, donors: Sequence[Donor] | None, dht: DHT | None, prefix: str | None
    ) -> LoadedState:
        while True:
            if donors is not None:
                targets = list(donors)
            else:
                assert dht is not None and prefix is not None
                targets = list(await _discover(self.peer, dht, prefix))
            offers = await self._offers(targets)
            # A run key's signature is the operator's word: one donor suffices.
            quorum = 1 if self.config.trusted_signers else self.wanted.quorum
            group = _choose_group(offers, quorum)
            if not group:
                raise StateSyncError(
                    f"no donor can provide the state ({_describe_support(offers, self.wanted)}"
                    f"{self.describe()})"
                )
            if self.download is None or self.download.offer.key != group[0].key:
                self.download = _Download(self, group[0])
            await self.download.run([o.peer_id for o in group[: self.config.max_donors]])
            if self.download.schedule.complete:
                if await self.download.verify():
                    return self.download.result(self.report())
                for offer in group:  # they agree on a state their chunks do not make
                    self.failures[offer.peer_id] = "its chunks do not match its state checksum"
                self.download = None

    async def _offers(self, targets: list[Donor]) -> list[_Offer]:
        semaphore = asyncio.Semaphore(MAX_MANIFEST_QUERIES)

        async def ask(target: Donor) -> _Offer | None:
            async with semaphore:
                return await self._offer(target)

        found = await asyncio.gather(*(ask(t) for t in targets))
        return [o for o in found if o is not None]

    async def _offer(self, target: Donor) -> _Offer | None:
        peer_id = target if isinstance(target, PeerID) else None
        try:
            async with asyncio.timeout(self.config.manifest_timeout):
                if peer_id is None:
                    peer_id = await self.peer.connect(target)
                if peer_id in self.failures or peer_id == self.peer.peer_id:
                    return None
                manifest = await call_unary(
                    self.peer,
                    peer_id,
                    MANIFEST_PROTOCOL,
                    ManifestRequest(self.wanted.version),
                    Manifest,
                    timeout=self.config.manifest_timeout,
                )
                layout = layout_from_manifest(manifest, max_state_bytes=self.config.max_state_bytes)
                self._check(manifest, layout)
        except (PeersError, TimeoutError) as e:
            reason = f"manifest: {_describe(e)}"
            if peer_id is None:
                self.unreachable[str(target)[:200]] = reason
                return None
            self._remember(peer_id)
            self.failures.setdefault(peer_id, reason)
            return None
        self._remember(peer_id)
        conn = self.peer.connection_to(peer_id)
        return _Offer(
            peer_id, manifest, layout, source_group(conn and conn.remote_address, peer_id)
        )

    def _check(self, manifest: Manifest, layout: Layout) -> None:
        """:class:`DonorError` if the caller does not want this manifest's state."""
        wanted = self.wanted
        if wanted.version is not None and manifest.version != wanted.version:
            raise DonorError(f"asked for version {wanted.version}, got {manifest.version}")
        if wanted.max_version is not None and manifest.version > wanted.max_version:
            raise DonorError(
                f"offers version {manifest.version}, ahead of the {wanted.max_version} "
                "the swarm's progress supports"
            )
        if self.config.trusted_signers:
            assert wanted.prefix is not None  # load_state_from_peers checks it
            check_signed(wanted.prefix, manifest, self.config.trusted_signers)
        if wanted.check is not None:
            reason = wanted.check(
                manifest.version, layout.specs, decode_metadata(manifest.metadata)
            )
            if reason is not None:
                raise DonorError(f"its state does not fit: {reason}")

    def moved_on(self, donor: PeerID) -> bool:
        """Count that ``donor`` no longer serves the version downloaded; False once it has
        done so more than :data:`MAX_MOVES_PER_DONOR` times (then it is a failure)."""
        self.moves[donor] += 1
        return self.moves[donor] <= MAX_MOVES_PER_DONOR

    def _remember(self, peer_id: PeerID) -> None:
        if peer_id not in self.asked:
            self.asked.append(peer_id)

    def report(self) -> SyncReport:
        schedule = self.download.schedule if self.download else None
        donors = []
        for peer_id in self.asked:
            progress = schedule.donors.get(peer_id) if schedule else None
            donors.append(
                DonorReport(
                    peer_id,
                    progress.num_chunks if progress else 0,
                    progress.num_bytes if progress else 0,
                    self.failures.get(peer_id),
                )
            )
        return SyncReport(
            donors=tuple(donors),
            num_chunks=schedule.num_chunks if schedule else 0,
            num_bytes=self.download.layout.total_bytes if self.download else 0,
            num_chunks_retried=schedule.num_retried if schedule else 0,
            seconds=time.monotonic() - self.started,
        )

    def describe(self) -> str:
        """Progress and every donor's failure, for error messages."""
        parts = []
        if self.download is not None:
            schedule = self.download.schedule
            parts.append(f"{schedule.num_done} of {schedule.num_chunks} chunks verified")
        failures = [(p.to_base58(), r) for p, r in self.failures.items()]
        failures += list(self.unreachable.items())
        if failures:
            parts.append("dropped donors: " + "; ".join(f"{d}: {r}" for d, r in failures))
        elif self.download is None:
            parts.append("no donor found")
        return "; ".join(parts)


def _groups(offers: list[_Offer]) -> list[tuple[int, list[_Offer]]]:
    """Donors grouped by identical manifests, each with its support (distinct sources),
    in the order their first donor was asked."""
    groups: dict[bytes, list[_Offer]] = {}
    for offer in offers:
        groups.setdefault(offer.key, []).append(offer)
    return [(len({o.source for o in g}), g) for g in groups.values()]


def _choose_group(offers: list[_Offer], quorum: int = 1) -> list[_Offer]:
    """The newest version offered with at least ``quorum`` support, and within it the
    group with the most (first asked wins ties); empty if none has the quorum. When
    fewer sources answered than ``quorum``, a group needs all of them: laptops reached
    through one relay count as one source, and must still be able to let a newcomer in,
    while two sources that disagree never settle it by the newer version."""
    quorum = min(quorum, len({o.source for o in offers}))
    supported = [(s, g) for s, g in _groups(offers) if s >= quorum]
    if not supported:
        return []
    _, best = max(supported, key=lambda item: (item[1][0].manifest.version, item[0]))
    return best


def _describe_support(offers: list[_Offer], wanted: _Wanted) -> str:
    """Why no group qualified when some donors answered (for the error message)."""
    if not offers:
        return ""
    best = max(s for s, _ in _groups(offers))
    quorum = min(wanted.quorum, len({o.source for o in offers}))
    return (
        f"{len(offers)} donors offered states, but none is offered by {quorum} "
        f"distinct networks (at most {best}); "
    )


class _Download:
    """One state being assembled in place from a group of donors that agree on it."""

    def __init__(self, sync: _Sync, offer: _Offer) -> None:
        self.sync = sync
        self.offer = offer
        self.layout = offer.layout
        self.manifest = offer.manifest
        self.tensors = {
            s.name: torch.empty(s.shape, dtype=DTYPES[s.dtype]) for s in self.layout.specs
        }
        self.views = [byte_view(t) for t in self.tensors.values()]
        self.schedule: ChunkSchedule[PeerID] = ChunkSchedule(self.layout.num_chunks)
        self.bytes_done = 0
        self.changed = asyncio.Condition()

    async def run(self, donors: list[PeerID]) -> None:
        """Fetch until every chunk is verified or every donor is out."""
        for donor in donors:
            self.schedule.add_donor(donor)
        try:
            async with asyncio.TaskGroup() as group:
                for donor in donors:
                    group.create_task(self._fetch_from(donor))
        except ExceptionGroup as e:  # a bug, or on_progress raised: not a donor's failure
            if len(e.exceptions) == 1:
                raise e.exceptions[0] from None
            raise

    async def _fetch_from(self, donor: PeerID) -> None:
        schedule = self.schedule
        outbox: asyncio.Queue[ChunkRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[ChunkRequest]:
            while (request := await outbox.get()) is not None:
                yield request

        responses = call_stream(self.sync.peer, donor, CHUNKS_PROTOCOL, requests(), ChunkResponse)
        try:
            while not schedule.complete:
                while (
                    len(schedule.donors[donor].in_flight) < self.sync.config.num_parallel_requests
                    and (index := schedule.next_chunk(donor)) is not None
                ):
                    outbox.put_nowait(ChunkRequest(self.manifest.version, index))
                expected = schedule.expected(donor)
                if expected is None:
                    async with self.changed:  # wait for a failed donor's chunks, or the end
                        await self.changed.wait_for(
                            lambda: schedule.complete or schedule.has_pending
                        )
                    continue
                try:
                    async with asyncio.timeout(self.sync.config.chunk_timeout):
                        response = await anext(responses)
                    num_bytes = self._accept(expected, response)
                except StopAsyncIteration:
                    await self._drop(donor, "closed the stream with chunks owed")
                    return
                except TimeoutError:
                    await self._drop(donor, f"sent no chunk for {self.sync.config.chunk_timeout} s")
                    return
                except PeersError as e:
                    if _moved_on(e) and self.sync.moved_on(donor):
                        await self._drop(donor, _describe(e), for_good=False)
                    else:
                        await self._drop(donor, _describe(e))
                    return
                schedule.received(donor, expected, num_bytes)
                self.bytes_done += num_bytes
                if self.sync.on_progress is not None:
                    self.sync.on_progress(self.bytes_done, self.layout.total_bytes)
                if schedule.complete:
                    async with self.changed:
                        self.changed.notify_all()
        finally:
            outbox.put_nowait(None)
            if isinstance(responses, AsyncGenerator):  # resets the stream if still open
                await responses.aclose()

    def _accept(self, index: int, response: ChunkResponse) -> int:
        """Check a chunk and write it in place; :class:`DonorError` if it is wrong."""
        if response.index != index:
            raise DonorError(f"sent chunk {response.index} when chunk {index} was due")
        segments = self.layout.segments(index)
        if len(response.parts) != len(segments):
            raise DonorError(
                f"sent chunk {index} in {len(response.parts)} parts, not {len(segments)}"
            )
        digest = hashlib.sha256()
        for part, (_, start, end) in zip(response.parts, segments, strict=True):
            if part.dtype.name != "uint8" or part.ndim != 1 or len(part) != end - start:
                raise DonorError(f"sent chunk {index} with a part of the wrong size or type")
            digest.update(part.data)
        if digest.digest() != chunk_digest(self.manifest, index):
            raise DonorError(f"sent chunk {index} with a bad checksum")
        for part, (tensor, start, end) in zip(response.parts, segments, strict=True):
            self.views[tensor][start:end] = part
        return self.layout.chunk_size(index)

    async def _drop(self, donor: PeerID, reason: str, *, for_good: bool = True) -> None:
        """``donor`` sends no more chunks of this download; with ``for_good``, none of any
        other either (else it is asked again for what it serves now)."""
        logger.info("dropping state donor %s: %s", donor, reason)
        if for_good:
            self.sync.failures.setdefault(donor, reason)
        if self.schedule.fail(donor, reason):
            async with self.changed:
                self.changed.notify_all()

    async def verify(self) -> bool:
        """Whether the assembled state matches the manifest's whole-state checksum (hashed
        in a worker thread: a large state takes a while)."""
        actual = await asyncio.to_thread(
            state_checksum, self.layout, self.manifest.metadata, self.views
        )
        return actual == self.manifest.state_checksum

    def result(self, report: SyncReport) -> LoadedState:
        return LoadedState(
            version=self.manifest.version,
            metadata=decode_metadata(self.manifest.metadata),
            tensors=self.tensors,
            state_checksum=self.manifest.state_checksum,
            report=report,
        )


async def _discover(peer: AddressedHost, dht: DHT[Any], prefix: str) -> list[PeerID]:
    """Donors announced under ``prefix``, newest announced version first. Announcements
    that do not parse are skipped (the DHT checked each one's signature, not its sense)."""
    key = state_key(prefix)
    found = await dht.get(key)  # its errors are the caller's: without a DHT, no donors
    if not isinstance(found, dict):
        return []
    announced: list[tuple[int, PeerID]] = []
    for subkey, entry in found.items():
        try:
            owner = owner_of(key.encode(), subkey)
            value = entry.value
            version = value["version"]
            addrs = [a for a in value["addrs"][:MAX_ANNOUNCED_ADDRS] if isinstance(a, str)]
            if owner is None or not isinstance(version, int):
                continue
        except (PeersError, KeyError, TypeError, AttributeError):
            continue
        for addr in addrs:
            with contextlib.suppress(PeersError, ValueError):
                peer.add_addresses(owner, [addr])
        announced.append((version, owner))
    announced.sort(key=lambda item: -item[0])
    return [owner for _, owner in announced]


def _moved_on(error: PeersError) -> bool:
    """Whether ``error`` is a donor's word that it no longer serves the version asked."""
    return isinstance(error, RemoteError) and error.remote_type == VersionGoneError.__name__


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}"[:300]
