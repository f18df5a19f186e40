"""Training progress shared through the DHT, and what a peer concludes from it.

Each peer publishes one signed record under ``{run_id}/progress`` (its subkey is its
owner marker, so nobody can write another peer's record): its epoch, the samples it
accumulated toward the next step, its throughput and the time. :func:`summarize` turns
every peer's records into the swarm's state from one peer's point of view (pure:
CONTRIBUTING.md, "Protocols are pure state machines").

Sample counts are self-reported, so one peer could claim a billion and end every epoch
alone. A peer's claim therefore counts only up to ``plausible_factor`` times the
*typical* claim (the median over peers in the epoch) or what this peer measured itself,
whichever is larger: hardware differs by a small factor between volunteers, not by
orders of magnitude. Liars in a minority cannot move the median, so they cannot advance
the epoch by themselves; honest fast peers are at worst under-counted (the epoch then
lasts a little longer, never shorter).

Epochs are claims too. The swarm's epoch is the one at least half of the live peers
reached (:func:`quorum_epoch`), never the largest claim: a record claiming epoch 10**9
would otherwise make every peer drop its gradients and download the claimant's state.
A peer saying it started averaging (so the others join its round now) is followed only
once the swarm's own count reaches half the global batch: a liar can make steps come
at most twice as often, with half batches, not make every step a one-sample step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from peers.dht.protocol import MAX_ADDR_CHARS, MAX_CONTACT_ADDRS
from peers.identity import PeerID

#: A peer counts for at most this many times the median claim of its epoch: volunteers'
#: hardware differs by a few times, not by orders of magnitude.
PLAUSIBLE_FACTOR = 4.0
#: A round fingerprint in a progress record: 16 bytes tell rounds apart.
MAX_FINGERPRINT_BYTES = 32
#: The most peers a record may ask the run to wait for: a hostile record cannot make
#: joiners wait for a swarm that will never come (they wait a bounded time anyway).
MAX_EXPECTED_PEERS = 4096
#: Fields every record has; a later version may append more (each an addition older
#: peers skip), up to this many in all. The eighth, ``contact``, came after the first
#: seven: a record without it is an older peer's.
RECORD_FIELDS = 7
MAX_RECORD_FIELDS = 32


@dataclass(frozen=True, slots=True)
class PeerProgress:
    """One peer's published record."""

    epoch: int
    samples: int
    """Samples accumulated toward the step that ends ``epoch``."""
    samples_per_second: float
    time: float
    """When it was published (``dht_time``)."""
    averaging: bool = False
    """It has started averaging for ``epoch``: peers in that epoch should join it now."""
    fingerprint: bytes = b""
    """Of the round that ended its previous epoch: peers that stepped together share it."""
    expect: int = 1
    """Peers this one waits for before the run's first step (``swarm train --num-peers``):
    peers joining at the start wait for as many, so the run does not begin with a part
    of the swarm."""
    contact: tuple[str, ...] | None = None
    """Where this peer's averaging searches are reached (``Averager.contact``; empty: it
    accepts no connections, so it cannot lead a group). Peers expecting it in a round
    join their leader without reading the round's declarations first. ``None``: not
    said (a peer of an older version)."""

    @classmethod
    def from_wire(cls, value: object) -> PeerProgress | None:
        """Parse a record; ``None`` for anything malformed (a remote's garbage). Fields
        past the ones this version knows are skipped: a later version may add some and
        stay readable here."""
        if not isinstance(value, list) or not RECORD_FIELDS <= len(value) <= MAX_RECORD_FIELDS:
            return None
        epoch, samples, rate, when, averaging, fingerprint, expect = value[:RECORD_FIELDS]
        if not isinstance(fingerprint, bytes) or len(fingerprint) > MAX_FINGERPRINT_BYTES:
            return None
        if not all(
            isinstance(v, int) and not isinstance(v, bool) for v in (epoch, samples, expect)
        ):
            return None
        if not 1 <= expect <= MAX_EXPECTED_PEERS:
            return None
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in (rate, when)):
            return None
        if epoch < 0 or samples < 0 or rate < 0 or not isinstance(averaging, bool):
            return None
        # A malformed contact costs only itself: the peer's progress still counts, and
        # its searches are found through their declarations, as an older peer's are.
        contact = _contact_from_wire(value[RECORD_FIELDS]) if len(value) > RECORD_FIELDS else None
        return cls(
            epoch, samples, float(rate), float(when), averaging, fingerprint, expect, contact
        )

    def to_wire(self) -> list[object]:
        return [
            self.epoch,
            self.samples,
            self.samples_per_second,
            self.time,
            self.averaging,
            self.fingerprint,
            self.expect,
            *([] if self.contact is None else [list(self.contact)]),
        ]


def _contact_from_wire(value: object) -> tuple[str, ...] | None:
    """A record's ``contact``, or ``None`` if malformed."""
    if not isinstance(value, list) or len(value) > MAX_CONTACT_ADDRS:
        return None
    if not all(isinstance(a, str) and 0 < len(a) <= MAX_ADDR_CHARS for a in value):
        return None
    return tuple(value)


@dataclass(frozen=True, slots=True)
class SwarmProgress:
    """The swarm as one peer sees it."""

    epoch: int
    """The epoch half of the live peers reached (:func:`quorum_epoch`), or mine if I am
    ahead of it."""
    num_peers: int
    """Live peers, this one included (a peer one epoch behind is about to catch up),
    except those claiming an epoch ahead of :attr:`epoch`: they are not in its round."""
    samples: int
    """Samples accumulated toward that epoch's step, each peer's claim capped."""
    target_batch_size: int
    samples_per_second: float
    """Sum of the live peers' throughput (capped alike)."""
    averaging: bool = False
    """A peer in this epoch has started averaging."""

    @property
    def ready(self) -> bool:
        """Time to step: the global batch is full, or a peer already started averaging."""
        return self.averaging or self.samples >= self.target_batch_size

    @property
    def eta_seconds(self) -> float:
        """Seconds until the step, at the current throughput (inf when none)."""
        missing = max(self.target_batch_size - self.samples, 0)
        if missing == 0:
            return 0.0
        return missing / self.samples_per_second if self.samples_per_second > 0 else math.inf


def summarize(
    records: Mapping[PeerID, PeerProgress],
    me: PeerID,
    mine: PeerProgress,
    target_batch_size: int,
    *,
    now: float,
    expiration_seconds: float,
    plausible_factor: float = PLAUSIBLE_FACTOR,
) -> SwarmProgress:
    """The swarm's progress from ``records`` (everyone's, maybe stale) and ``mine`` (my
    own, always current). Records older than ``expiration_seconds`` are of peers gone."""
    live = {p: r for p, r in records.items() if now - r.time <= expiration_seconds and p != me}
    live[me] = mine
    epoch = max(mine.epoch, quorum_epoch(live.values()))
    current = [r for r in live.values() if r.epoch == epoch]
    # median_low: with two peers, the smaller claim (one liar in two is no majority)
    median_samples = statistics.median_low(r.samples for r in current)
    median_rate = statistics.median_low(r.samples_per_second for r in current)
    own_samples = mine.samples if mine.epoch == epoch else 0
    sample_cap = plausible_factor * max(median_samples, own_samples, 1)
    rate_cap = plausible_factor * max(median_rate, mine.samples_per_second, 1e-9)
    samples = int(sum(min(r.samples, sample_cap) for r in current))
    flagged = any(r.averaging for p, r in live.items() if r.epoch == epoch and p != me)
    return SwarmProgress(
        epoch=epoch,
        num_peers=sum(1 for r in live.values() if r.epoch <= epoch),
        samples=samples,
        target_batch_size=target_batch_size,
        samples_per_second=sum(min(r.samples_per_second, rate_cap) for r in current),
        averaging=flagged and 2 * samples >= target_batch_size,
    )


def quorum_epoch(records: Iterable[PeerProgress]) -> int:
    """The epoch at least half of ``records`` (the live peers, me included) reached: the
    upper median. A minority claiming epochs far ahead moves it not at all; a peer that
    missed a round that half the swarm took is behind, and resyncs."""
    epochs = sorted(r.epoch for r in records)
    return epochs[len(epochs) // 2]


def split_winner(
    records: Mapping[PeerID, PeerProgress],
    me: PeerID,
    mine: PeerProgress,
    *,
    now: float,
    expiration_seconds: float,
) -> tuple[bytes, list[PeerID]] | None:
    """If live peers in my epoch reached it through a different round than I did (the
    swarm split into groups that stepped apart), the branch to follow and its peers:
    the one most peers are on, ties to the smaller fingerprint. ``None`` when I am on it
    (or nobody else is in my epoch)."""
    branches: dict[bytes, list[PeerID]] = {mine.fingerprint: [me]}
    for peer, r in records.items():
        if peer != me and now - r.time <= expiration_seconds and r.epoch == mine.epoch:
            branches.setdefault(r.fingerprint, []).append(peer)
    best = min(branches, key=lambda f: (-len(branches[f]), f))
    if best == mine.fingerprint or not best:
        return None
    return best, branches[best]
