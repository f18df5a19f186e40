"""State sync's records: the newcomer's config, and what a download returns and reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from peers.identity import PeerID


@dataclass(frozen=True, kw_only=True)
class StateSyncConfig:
    """How :func:`load_state_from_peers` downloads."""

    num_parallel_requests: int = 4
    """Chunks requested ahead on each donor's stream, so its link never idles between
    chunks. At least 2, so a donor never waits on our round trip."""
    chunk_timeout: float = 30.0
    """Seconds without a chunk from a donor that owes one before it counts as stalled and
    its chunks go to the others. A 2 MiB chunk needs ~2 s at 10 Mbit/s, times the chunks
    queued ahead of it."""
    manifest_timeout: float = 10.0
    """Seconds for dialing a donor and getting its manifest."""
    max_donors: int = 8
    """Donors downloaded from at once (the rest wait in reserve for a new round)."""
    max_state_bytes: int = 1 << 36
    """Largest state we agree to allocate (64 GiB): a manifest over it is refused."""
    trusted_signers: frozenset[PeerID] = frozenset()
    """Run keys (:mod:`averaging.state.signing`): when any are given, a state is loaded
    only if one of them signed its manifest, and then one donor suffices (no quorum of
    networks is asked for). Empty: any state offered by a quorum of networks."""

    def __post_init__(self) -> None:
        if self.num_parallel_requests < 2:
            raise ValueError("num_parallel_requests must be at least 2")
        if self.chunk_timeout <= 0 or self.manifest_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_donors < 1 or self.max_state_bytes < 0:
            raise ValueError("max_donors must be at least 1 and max_state_bytes non-negative")
        signers: object = self.trusted_signers
        if not isinstance(signers, frozenset) or not all(isinstance(p, PeerID) for p in signers):
            raise ValueError("trusted_signers must be a frozenset of PeerIDs")


@dataclass(frozen=True, slots=True)
class DonorReport:
    """What one donor contributed: verified chunks and bytes, and why it was dropped."""

    peer_id: PeerID
    num_chunks: int
    num_bytes: int
    failure: str | None  # None: it served until the end (or was not needed)


@dataclass(frozen=True, slots=True)
class SyncReport:
    donors: tuple[DonorReport, ...]  # every donor asked, in the order first asked
    num_chunks: int
    num_bytes: int
    num_chunks_retried: int  # chunks re-requested after their donor failed
    seconds: float

    @property
    def donors_used(self) -> tuple[PeerID, ...]:
        return tuple(d.peer_id for d in self.donors if d.num_chunks)

    @property
    def failed_donors(self) -> tuple[PeerID, ...]:
        return tuple(d.peer_id for d in self.donors if d.failure is not None)


@dataclass(frozen=True, slots=True)
class LoadedState:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    state_checksum: bytes
    report: SyncReport
