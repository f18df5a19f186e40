"""The records a DHT node stores for others: bounded, fair between sources, no I/O.

Rules:

- *Newest expiration wins.* Under one ``(key, subkey)`` a record replaces the one held
  only if it expires strictly later, signed or not, from any source. So an older signed
  value can never be replayed over a newer one, and an open key belongs to whoever
  stores the later expiration (at most one MAX_TTL_SECONDS ahead, see records.py).
  Re-storing exactly the record held is accepted and changes nothing (republish, retry).
- *Plain value and subkeys are separate entries.* Under a key, subkey None holds the
  plain value and each subkey its own entry; neither replaces nor hides the other, so a
  plain store on a shared announce key cannot wipe the announcements.
- *Per-source quotas.* ``source`` is where the store came from: the DHT node passes the
  sender's network (``peers.subnets.source_group``: a public /24 or /48, a private host,
  or the identity itself on loopback), so a thousand identities on one network share
  one quota; :data:`OWN_SOURCE` for what we store ourselves. Each source has a hard cap
  on records and bytes.
  A replaced record is credited back to its old source and charged to the new one.
- *Max-min fair eviction when full.* When the store (bytes) or a key (subkeys) is full,
  expired records are purged first; then a record is evicted only from the source that
  holds the most, and only while that source holds more than the newcomer's source will
  after the store. So a flooder can only ever take space from sources richer than
  itself, never from an honest peer holding little, and two sources cannot evict each
  other back and forth (each eviction lowers the larger of the two holdings).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from peers.dht.records import MAX_SUBKEYS_PER_KEY, Record, RecordError, validate
from peers.dht.status import STATUS_KEY, too_soon
from peers.identity import PeerID

#: Who a stored record is charged to: a network's name (``peers.subnets``) or a PeerID.
Source = str | PeerID

#: What one stored record costs beyond its bytes: the Python objects holding it (record,
#: entry, dict and set slots, a heap item) take about this much. It also makes a flood of
#: empty records cost memory quota like the memory it really takes.
RECORD_OVERHEAD_BYTES = 256
#: Memory for records stored for others. 64 MiB is affordable on the small server a
#: bootstrap peer runs on, and is far more than a node's share of a swarm's records.
MAX_STORE_BYTES = 64 * 1024 * 1024
#: Where a node's own records count.
OWN_SOURCE = "self"
#: Bytes one source may hold: 1/16 of the store, so fewer than 16 sources can never fill it.
MAX_BYTES_PER_SOURCE = 4 * 1024 * 1024
#: Records one source may hold. An honest peer stores a few announcements of its own, but
#: a replica republishing what it holds sends many more; 2048 fits a swarm of hundreds.
MAX_RECORDS_PER_SOURCE = 2048
#: The expiry heap keeps superseded items until they surface; rebuild it when it holds
#: this many more than twice the live records, so replacements cannot grow it for an hour.
_EXPIRY_HEAP_SLACK = 1024


class StoreResult(enum.Enum):
    ACCEPTED = "accepted"
    REJECTED_STALE = "rejected: not newer than the record held"
    REJECTED_QUOTA = "rejected: the source holds more than its share"
    REJECTED_FULL = "rejected: full, and no source holds more than this one"
    REJECTED_TOO_SOON = "rejected: replaces its owner's status record too soon"


@dataclass(frozen=True, slots=True)
class StoredValue:
    """What a key holds: its plain value (subkey None) and its subkey entries."""

    plain: Record | None
    subkeys: Mapping[bytes, Record]


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    num_records: int
    num_sources: int
    stored_bytes: int
    num_rejected_invalid: int
    num_rejected_stale: int
    num_rejected_quota: int
    num_rejected_full: int
    num_evicted: int
    num_rejected_too_soon: int = 0
    """Status records replacing their owner's previous one sooner than
    ``peers.dht.status.MIN_STATUS_INTERVAL_SECONDS`` after it."""


@dataclass(slots=True, eq=False)
class _Entry:
    record: Record
    source: Source
    cost: int


def record_cost(record: Record) -> int:
    """Bytes a record is charged for: its fields plus RECORD_OVERHEAD_BYTES."""
    fields = (record.key, record.subkey or b"", record.value, record.signature)
    return RECORD_OVERHEAD_BYTES + sum(len(f) for f in fields)


def _fair_victims(
    candidates: Iterable[_Entry], size: Callable[[_Entry], int], mine: int, need: int
) -> list[_Entry] | None:
    """Entries freeing ``need`` units, max-min fairly (see the module docstring), or None.

    ``candidates`` excludes the newcomer's source, which will hold ``mine`` units; each
    victim source loses its soonest-expiring entries first.
    """
    usage: dict[Source, int] = {}
    queues: dict[Source, list[_Entry]] = {}
    for entry in candidates:
        usage[entry.source] = usage.get(entry.source, 0) + size(entry)
        queues.setdefault(entry.source, []).append(entry)
    for queue in queues.values():
        queue.sort(key=lambda e: e.record.expiration_time, reverse=True)
    victims: list[_Entry] = []
    while need > 0:
        richest = max(usage, key=usage.__getitem__, default=None)
        if richest is None or usage[richest] <= mine:
            return None
        victim = queues[richest].pop()
        usage[richest] -= size(victim)
        need -= size(victim)
        victims.append(victim)
        if not queues[richest]:
            del usage[richest]
    return victims


class RecordStore:
    """Records stored for other peers, with quotas; every method takes ``now``."""

    def __init__(
        self,
        *,
        max_bytes: int = MAX_STORE_BYTES,
        max_bytes_per_source: int = MAX_BYTES_PER_SOURCE,
        max_records_per_source: int = MAX_RECORDS_PER_SOURCE,
    ) -> None:
        if not 0 < max_bytes_per_source <= max_bytes or max_records_per_source <= 0:
            raise ValueError("RecordStore needs 0 < max_bytes_per_source <= max_bytes")
        self.max_bytes = max_bytes
        self.max_bytes_per_source = max_bytes_per_source
        self.max_records_per_source = max_records_per_source
        self._keys: dict[bytes, dict[bytes | None, _Entry]] = {}
        self._by_source: dict[Source, set[_Entry]] = {}
        self._source_bytes: dict[Source, int] = {}
        self._stored_bytes = 0
        self._num_records = 0
        self._expiry: list[tuple[float, int, _Entry]] = []
        self._sequence = itertools.count()  # breaks expiration ties in the heap
        # how many stores ended each way ("invalid" or a StoreResult name)
        self._outcomes = dict.fromkeys(["invalid", *StoreResult.__members__], 0)
        self._num_evicted = 0

    def store(self, record: Record, *, source: Source, now: float) -> StoreResult:
        """Store ``record`` sent by ``source``; raises :class:`RecordError` if it is invalid."""
        try:
            record = validate(record, now)
        except RecordError:
            self._outcomes["invalid"] += 1
            raise
        result = self._store_valid(record, source, now)
        self._outcomes[result.name] += 1
        return result

    def _store_valid(self, record: Record, source: Source, now: float) -> StoreResult:
        self.purge_expired(now)
        entries = self._keys.get(record.key, {})
        old = entries.get(record.subkey)
        if old is not None and old.record == record:
            return StoreResult.ACCEPTED
        if old is not None and record.expiration_time <= old.record.expiration_time:
            return StoreResult.REJECTED_STALE
        if (
            old is not None
            and record.key == STATUS_KEY
            and too_soon(old.record.value, record.value)
        ):
            return StoreResult.REJECTED_TOO_SOON
        cost = record_cost(record)
        own_old = old if old is not None and old.source == source else None
        held = len(self._by_source.get(source, ())) + (own_old is None)
        mine = self._source_bytes.get(source, 0) + cost - (own_old.cost if own_old else 0)
        if held > self.max_records_per_source or mine > self.max_bytes_per_source:
            return StoreResult.REJECTED_QUOTA
        victims: list[_Entry] = []
        num_subkeys = len(entries) - (None in entries)
        if record.subkey is not None and old is None and num_subkeys >= MAX_SUBKEYS_PER_KEY:
            others = [e for s, e in entries.items() if s is not None and e.source != source]
            mine_here = num_subkeys - len(others) + 1
            picked = _fair_victims(others, lambda e: 1, mine_here, need=1)
            if picked is None:
                num_sources = len({e.source for e in others}) + 1
                return self._refusal(mine_here, MAX_SUBKEYS_PER_KEY, num_sources)
            victims = picked
        leaving = {*victims, *([old] if old else [])}
        need = self._stored_bytes - sum(e.cost for e in leaving) + cost - self.max_bytes
        if need > 0:
            rich = (
                e
                for s, held_entries in self._by_source.items()
                if s != source and self._source_bytes[s] > mine
                for e in held_entries
                if e not in leaving
            )
            picked = _fair_victims(rich, lambda e: e.cost, mine, need)
            if picked is None:
                num_sources = len(self._by_source) + (source not in self._by_source)
                return self._refusal(mine, self.max_bytes, num_sources)
            victims += picked
        for victim in victims:
            self._remove(victim)
            self._num_evicted += 1
        if old is not None:
            self._remove(old)
        self._add(_Entry(record, source, cost))
        return StoreResult.ACCEPTED

    @staticmethod
    def _refusal(mine: int, capacity: int, num_sources: int) -> StoreResult:
        """Full and nobody richer to evict: is the source past its fair share, or is it us?"""
        over_share = mine * num_sources > capacity
        return StoreResult.REJECTED_QUOTA if over_share else StoreResult.REJECTED_FULL

    def get(self, key: bytes, now: float) -> StoredValue | None:
        """What ``key`` holds at ``now`` (expired records dropped), or None."""
        self.purge_expired(now)
        entries = self._keys.get(key)
        if not entries:
            return None
        plain = entries.get(None)
        subkeys = {s: e.record for s, e in entries.items() if s is not None}
        return StoredValue(plain.record if plain else None, subkeys)

    def get_record(self, key: bytes, subkey: bytes | None, now: float) -> Record | None:
        self.purge_expired(now)
        entry = self._keys.get(key, {}).get(subkey)
        return entry.record if entry else None

    def records(self, now: float) -> Iterator[Record]:
        """Every live record (for republishing); a snapshot, safe to store while iterating."""
        self.purge_expired(now)
        snapshot = [e.record for entries in self._keys.values() for e in entries.values()]
        return iter(snapshot)

    def purge_expired(self, now: float) -> int:
        """Drop every record expiring at or before ``now``; return how many."""
        num_purged = 0
        while self._expiry and self._expiry[0][0] <= now:
            entry = heapq.heappop(self._expiry)[2]
            if self._is_live(entry):
                self._remove(entry)
                num_purged += 1
        return num_purged

    def usage(self, source: Source) -> tuple[int, int]:
        """How many records, and how many bytes (see :func:`record_cost`), ``source`` holds."""
        return len(self._by_source.get(source, ())), self._source_bytes.get(source, 0)

    def __len__(self) -> int:
        return self._num_records

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            num_records=self._num_records,
            num_sources=len(self._by_source),
            stored_bytes=self._stored_bytes,
            num_rejected_invalid=self._outcomes["invalid"],
            num_rejected_stale=self._outcomes["REJECTED_STALE"],
            num_rejected_quota=self._outcomes["REJECTED_QUOTA"],
            num_rejected_full=self._outcomes["REJECTED_FULL"],
            num_evicted=self._num_evicted,
            num_rejected_too_soon=self._outcomes["REJECTED_TOO_SOON"],
        )

    def _is_live(self, entry: _Entry) -> bool:
        return self._keys.get(entry.record.key, {}).get(entry.record.subkey) is entry

    def _add(self, entry: _Entry) -> None:
        self._keys.setdefault(entry.record.key, {})[entry.record.subkey] = entry
        self._by_source.setdefault(entry.source, set()).add(entry)
        self._source_bytes[entry.source] = self._source_bytes.get(entry.source, 0) + entry.cost
        self._stored_bytes += entry.cost
        self._num_records += 1
        heapq.heappush(self._expiry, (entry.record.expiration_time, next(self._sequence), entry))
        if len(self._expiry) > 2 * self._num_records + _EXPIRY_HEAP_SLACK:
            self._expiry = [item for item in self._expiry if self._is_live(item[2])]
            heapq.heapify(self._expiry)

    def _remove(self, entry: _Entry) -> None:
        entries = self._keys[entry.record.key]
        del entries[entry.record.subkey]
        if not entries:
            del self._keys[entry.record.key]
        held = self._by_source[entry.source]
        held.discard(entry)
        self._source_bytes[entry.source] -= entry.cost
        if not held:
            del self._by_source[entry.source], self._source_bytes[entry.source]
        self._stored_bytes -= entry.cost
        self._num_records -= 1
