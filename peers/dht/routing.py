"""The Kademlia routing table: k-buckets over the 256-bit id space.

Maymounkov & Mazières 2002, "Kademlia": §2.2 (k-buckets, least-recently-seen eviction),
§2.3 (bucket refresh), §2.4 (buckets as leaves of a binary tree, split when the bucket
holding our own id overflows) and §4.1 (replacement cache). A pure data structure: it
never pings anyone and never reads the clock. :meth:`RoutingTable.update` returns the
contact the caller should ping, and the caller reports back with ``update`` (it
answered) or ``remove``/``record_failure`` (it did not).
"""

from __future__ import annotations

import heapq
import itertools
import random
from bisect import bisect_right
from collections.abc import Collection
from dataclasses import dataclass

from peers.dht.ids import ID_BITS, Contact, NodeID, distance, node_id_of
from peers.identity import PeerID

#: The paper's k (§2.2): contacts per bucket, and how many nodes a lookup returns. 20
#: is the paper's choice ("no more than k nodes fail within an hour of each other") and
#: what libp2p and hivemind use.
K = 20
#: Contacts remembered per bucket to replace dead ones (§4.1). As many as the bucket
#: holds: a bucket whose members all die can be refilled at once, and the cost is only
#: k more small records per bucket.
REPLACEMENT_CACHE_SIZE = K
#: Consecutive failed RPCs after which a contact is dropped. The paper's 5 (§4.1) is for
#: UDP, where packets are lost routinely; our RPCs run over reliable streams, so one
#: failure already means a failed dial or a deadline missed. Three forgives a brief
#: stall without keeping a dead peer in every lookup for long.
MAX_FAILURES = 3
#: Contacts one source (a public /24 or /48, a private host: ``peers.subnets``) may have
#: in one bucket, and in the whole table. Identities are cheap to make, networks are not
#: (docs/benchmarks.md, "Figures behind constants"): without these, one machine could
#: fill every bucket and the neighbourhood of any key (an eclipse). Two per bucket and
#: eight in all are what go-libp2p's routing-table diversity filter allows by its
#: defaults (per /16 there; we count the finer ``peers.subnets`` sources, as everywhere
#: else); honest peers rarely share a /24.
MAX_PER_SOURCE_PER_BUCKET = 2
MAX_PER_SOURCE = 8
_ID_SPACE_END = 1 << ID_BITS


@dataclass(frozen=True, slots=True)
class RoutingStatistics:
    num_contacts: int
    num_buckets: int
    num_replacements: int


class _Entry:
    __slots__ = ("contact", "last_seen", "num_failures", "source")

    def __init__(self, contact: Contact, last_seen: float, source: str | None) -> None:
        self.contact = contact
        self.last_seen = last_seen
        self.num_failures = 0
        self.source = source


class _Bucket:
    """Ids in ``[low, high)``. Dicts keep insertion order and a refreshed contact is
    re-inserted, so ``replacements`` runs from least to most recently seen; for
    ``entries`` (where promotion breaks that order) the eviction rule reads
    ``last_seen`` instead."""

    __slots__ = ("entries", "high", "last_refreshed", "low", "replacements")

    def __init__(self, low: int, high: int, last_refreshed: float) -> None:
        self.low = low
        self.high = high
        self.last_refreshed = last_refreshed
        self.entries: dict[PeerID, _Entry] = {}
        self.replacements: dict[PeerID, _Entry] = {}


class RoutingTable:
    """k-buckets around ``local_id``; see the module docstring for who does the I/O."""

    def __init__(
        self, local_id: NodeID, *, k: int = K, replacement_cache_size: int = REPLACEMENT_CACHE_SIZE
    ) -> None:
        """``k`` is the paper's k: the capacity of each bucket."""
        if not 0 <= local_id < _ID_SPACE_END:
            raise ValueError(f"local id must be a {ID_BITS}-bit non-negative int")
        if k < 1 or replacement_cache_size < 0:
            raise ValueError("k must be positive and replacement_cache_size non-negative")
        self.local_id = local_id
        self.k = k
        self.replacement_cache_size = replacement_cache_size
        # A new table has never refreshed anything: its one bucket is due at once.
        self._buckets = [_Bucket(0, _ID_SPACE_END, float("-inf"))]
        self._lows = [0]  # the buckets' lower bounds, sorted, for bisection
        self._per_source: dict[str, int] = {}  # entries (not replacements) per source
        self.num_refused_by_source = 0

    # --- heard from, found dead --------------------------------------------------------

    def update(self, contact: Contact, now: float, *, source: str | None = None) -> Contact | None:
        """``contact`` answered us or called us, at time ``now``, from ``source`` (the
        network it reached us from, :func:`peers.subnets.source_group`; None: unknown,
        not limited).

        A known contact moves to its bucket's most-recently-seen end, takes the new
        addresses (kept as they were if the new contact has none) and has its failures
        forgotten. A new one is added if its bucket has room or can split (§2.4: only the
        bucket holding our own id splits). Otherwise it waits in the bucket's replacement
        cache (§4.1) and the bucket's least-recently-seen contact is returned: the caller
        pings it, then calls ``update`` (alive: it stays, as §2.2 prefers old live nodes)
        or ``remove`` (dead: the newest replacement takes its place). Returns None in
        every other case. Our own id is never added, nor a new contact whose source
        already has :data:`MAX_PER_SOURCE_PER_BUCKET` contacts in its bucket (entries
        and replacements together) or :data:`MAX_PER_SOURCE` in the table.
        """
        node_id = contact.node_id
        if node_id == self.local_id:
            return None
        bucket = self._bucket_of(node_id)
        bucket.last_refreshed = max(bucket.last_refreshed, now)
        entry = bucket.entries.pop(contact.peer_id, None)
        if entry is not None:
            entry.contact = contact if contact.addrs else entry.contact
            entry.last_seen = max(entry.last_seen, now)
            entry.num_failures = 0
            bucket.entries[contact.peer_id] = entry
            return None
        if self._source_is_full(bucket, source):
            self.num_refused_by_source += 1
            return None
        while len(bucket.entries) >= self.k and self._can_split(bucket):
            self._split(bucket)
            bucket = self._bucket_of(node_id)
            if self._source_is_full(bucket, source):
                self.num_refused_by_source += 1
                return None
        fresh = _Entry(contact, now, source)
        stale = bucket.replacements.pop(contact.peer_id, None)
        if stale is not None and not contact.addrs:
            fresh.contact = stale.contact
        if len(bucket.entries) < self.k:
            self._add(bucket, fresh)
            return None
        if self.replacement_cache_size > 0:
            bucket.replacements[contact.peer_id] = fresh
            while len(bucket.replacements) > self.replacement_cache_size:
                del bucket.replacements[next(iter(bucket.replacements))]  # oldest goes
        return min(bucket.entries.values(), key=lambda e: e.last_seen).contact

    def remove(self, peer_id: PeerID) -> None:
        """``peer_id`` is dead (failed ping or RPC): drop it, and promote the most recently
        seen replacement into its place (§4.1). Unknown peers are ignored."""
        bucket = self._bucket_of(node_id_of(peer_id))
        bucket.replacements.pop(peer_id, None)
        entry = bucket.entries.pop(peer_id, None)
        if entry is not None:
            self._forget_source(entry)
            self._fill_from_replacements(bucket)

    def record_failure(self, peer_id: PeerID, now: float) -> bool:
        """An RPC to ``peer_id`` failed at ``now``. After :data:`MAX_FAILURES` in a row
        (an ``update`` resets the count) the contact is removed as by :meth:`remove`.
        A failing replacement is dropped at once: it is only a spare. Returns True if
        this call removed the peer from the table or its replacement cache.

        Unlike §4.1 we remove even when no replacement is waiting; a node whose own
        network went down re-bootstraps rather than keeps dead contacts."""
        del now  # failures are counted, not timed; the time is taken for symmetry
        bucket = self._bucket_of(node_id_of(peer_id))
        if bucket.replacements.pop(peer_id, None) is not None:
            return True
        entry = bucket.entries.get(peer_id)
        if entry is None:
            return False
        entry.num_failures += 1
        if entry.num_failures < MAX_FAILURES:
            return False
        self.remove(peer_id)
        return True

    # --- queries -----------------------------------------------------------------------

    def nearest(
        self, target: NodeID, count: int, *, exclude: Collection[PeerID] = ()
    ) -> list[Contact]:
        """Up to ``count`` contacts closest to ``target`` by XOR distance, ascending
        (replacements are not included)."""
        excluded = exclude if isinstance(exclude, set | frozenset) else set(exclude)
        candidates = (
            entry.contact
            for bucket in self._buckets
            for peer_id, entry in bucket.entries.items()
            if peer_id not in excluded
        )
        return heapq.nsmallest(count, candidates, key=lambda c: distance(c.node_id, target))

    def get(self, peer_id: PeerID) -> Contact | None:
        entry = self._bucket_of(node_id_of(peer_id)).entries.get(peer_id)
        return None if entry is None else entry.contact

    def last_seen(self, peer_id: PeerID) -> float | None:
        entry = self._bucket_of(node_id_of(peer_id)).entries.get(peer_id)
        return None if entry is None else entry.last_seen

    def contacts(self) -> list[Contact]:
        return [e.contact for bucket in self._buckets for e in bucket.entries.values()]

    def bucket_ranges(self) -> list[tuple[int, int]]:
        """Each bucket's ``[low, high)`` id range, in id order (for checks and monitoring)."""
        return [(bucket.low, bucket.high) for bucket in self._buckets]

    def __len__(self) -> int:
        return sum(len(bucket.entries) for bucket in self._buckets)

    def __contains__(self, peer_id: object) -> bool:
        if not isinstance(peer_id, PeerID):
            return False
        return peer_id in self._bucket_of(node_id_of(peer_id)).entries

    def statistics(self) -> RoutingStatistics:
        return RoutingStatistics(
            num_contacts=len(self),
            num_buckets=len(self._buckets),
            num_replacements=sum(len(bucket.replacements) for bucket in self._buckets),
        )

    # --- refresh (§2.3) ----------------------------------------------------------------

    def buckets_to_refresh(
        self, now: float, refresh_interval: float, *, rng: random.Random | None = None
    ) -> list[NodeID]:
        """One target id per bucket that saw neither a lookup nor a contact within
        ``refresh_interval`` seconds before ``now``: the caller looks each one up (§2.3)
        and then calls :meth:`mark_bucket_refreshed`. The target is random in the
        bucket's range with ``rng`` (as the paper says), else the range's midpoint."""
        return [
            rng.randrange(bucket.low, bucket.high)
            if rng is not None
            else (bucket.low + bucket.high) // 2
            for bucket in self._buckets
            if now - bucket.last_refreshed >= refresh_interval
        ]

    def join_targets(self, rng: random.Random) -> list[NodeID]:
        """After a join's lookup of our own id, one random id at each distance farther
        than our closest contact's (§2.3: "u refreshes all k-buckets further away than
        its closest neighbor"): looking each up leaves us knowing a node in every
        subtree of the id space that holds one. Without it, nodes that join together
        learn only their own neighbourhood, and a lookup for a key in a subtree none of
        them knows converges on the nearest nodes they do know, not the key's."""
        nearest = self.nearest(self.local_id, 1)
        if not nearest:
            return []
        closest_bit = distance(self.local_id, nearest[0].node_id).bit_length() - 1
        return [
            self.local_id ^ ((1 << bit) | rng.getrandbits(bit))
            for bit in range(closest_bit + 1, ID_BITS)
        ]

    def mark_bucket_refreshed(self, target: NodeID, now: float) -> None:
        """A lookup for ``target`` ran at ``now``: its bucket is fresh."""
        bucket = self._bucket_of(target)
        bucket.last_refreshed = max(bucket.last_refreshed, now)

    # --- internals ---------------------------------------------------------------------

    def _bucket_of(self, node_id: NodeID) -> _Bucket:
        return self._buckets[bisect_right(self._lows, node_id) - 1]

    def _can_split(self, bucket: _Bucket) -> bool:
        # §2.4: split only the bucket whose range holds our own id (the classic rule,
        # without the relaxation for highly unbalanced trees in §2.4's last paragraph).
        return bucket.low <= self.local_id < bucket.high and bucket.high - bucket.low > 1

    def _split(self, bucket: _Bucket) -> None:
        middle = (bucket.low + bucket.high) // 2
        lower = _Bucket(bucket.low, middle, bucket.last_refreshed)
        upper = _Bucket(middle, bucket.high, bucket.last_refreshed)
        for source, lower_target, upper_target in (
            (bucket.entries, lower.entries, upper.entries),
            (bucket.replacements, lower.replacements, upper.replacements),
        ):
            for peer_id, entry in source.items():  # insertion order = recency, kept
                side = lower_target if entry.contact.node_id < middle else upper_target
                side[peer_id] = entry
        index = self._buckets.index(bucket)
        self._buckets[index : index + 1] = [lower, upper]
        self._lows[index : index + 1] = [lower.low, upper.low]
        self._fill_from_replacements(lower)
        self._fill_from_replacements(upper)

    def _fill_from_replacements(self, bucket: _Bucket) -> None:
        for peer_id in reversed(list(bucket.replacements)):  # the most recently seen first
            if len(bucket.entries) >= self.k:
                break
            entry = bucket.replacements.pop(peer_id)
            if not self._source_is_full(bucket, entry.source):
                self._add(bucket, entry)

    def _source_is_full(self, bucket: _Bucket, source: str | None) -> bool:
        if source is None:
            return False
        if self._per_source.get(source, 0) >= MAX_PER_SOURCE:
            return True
        held = itertools.chain(bucket.entries.values(), bucket.replacements.values())
        return sum(1 for e in held if e.source == source) >= MAX_PER_SOURCE_PER_BUCKET

    def _add(self, bucket: _Bucket, entry: _Entry) -> None:
        bucket.entries[entry.contact.peer_id] = entry
        if entry.source is not None:
            self._per_source[entry.source] = self._per_source.get(entry.source, 0) + 1

    def _forget_source(self, entry: _Entry) -> None:
        if entry.source is not None:
            left = self._per_source[entry.source] - 1
            if left:
                self._per_source[entry.source] = left
            else:
                del self._per_source[entry.source]
