"""RecordStore: newest-wins, ownership, expiry, subkeys, quotas and fair eviction."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from peers.dht.records import (
    MAX_CLOCK_SKEW_SECONDS,
    MAX_SUBKEYS_PER_KEY,
    MAX_TTL_SECONDS,
    MAX_VALUE_BYTES,
    Record,
    RecordError,
    RecordErrorReason,
    owner_marker,
)
from peers.dht.storage import (
    MAX_RECORDS_PER_SOURCE,
    RECORD_OVERHEAD_BYTES,
    RecordStore,
    StoredValue,
    StoreResult,
    record_cost,
)
from peers.identity import KeyPair, PeerID
from peers.serialization import pack

NOW = 1_000_000.0
ALICE = KeyPair.from_seed(b"a" * 32)
BOB = KeyPair.from_seed(b"b" * 32)
MALLORY = KeyPair.from_seed(b"m" * 32)


def peer(i: int) -> PeerID:
    return KeyPair.from_seed(i.to_bytes(32, "big")).peer_id


def plain(key: bytes, value: object, expiration: float, subkey: bytes | None = None) -> Record:
    return Record(key, subkey, pack(value), expiration)


def test_store_and_get_plain_value() -> None:
    store = RecordStore()
    record = plain(b"k", {"a": 1}, NOW + 60)
    assert store.store(record, source=ALICE.peer_id, now=NOW) is StoreResult.ACCEPTED
    assert store.get(b"k", NOW) == StoredValue(record, {})
    assert store.get_record(b"k", None, NOW) == record
    assert store.get(b"other", NOW) is None
    assert store.get_record(b"k", b"sub", NOW) is None
    assert list(store.records(NOW)) == [record]
    assert len(store) == 1
    assert store.usage(ALICE.peer_id) == (1, record_cost(record))
    stats = store.statistics()
    assert (stats.num_records, stats.num_sources) == (1, 1)
    assert stats.stored_bytes == record_cost(record) > RECORD_OVERHEAD_BYTES


def test_newest_expiration_wins_from_any_source_on_open_keys() -> None:
    store = RecordStore()
    first = plain(b"k", 1, NOW + 60)
    assert store.store(first, source=ALICE.peer_id, now=NOW) is StoreResult.ACCEPTED
    older, same = plain(b"k", 2, NOW + 30), plain(b"k", 3, NOW + 60)
    assert store.store(older, source=BOB.peer_id, now=NOW) is StoreResult.REJECTED_STALE
    assert store.store(same, source=BOB.peer_id, now=NOW) is StoreResult.REJECTED_STALE
    newer = plain(b"k", 4, NOW + 90)
    assert store.store(newer, source=BOB.peer_id, now=NOW) is StoreResult.ACCEPTED
    assert store.get_record(b"k", None, NOW) == newer
    assert store.usage(ALICE.peer_id) == (0, 0)  # credited back
    assert store.usage(BOB.peer_id) == (1, record_cost(newer))
    assert store.statistics().num_rejected_stale == 2


def test_restoring_the_same_record_is_accepted_and_changes_nothing() -> None:
    store = RecordStore()
    record = plain(b"k", 1, NOW + 60)
    store.store(record, source=ALICE.peer_id, now=NOW)
    assert store.store(record, source=BOB.peer_id, now=NOW + 1) is StoreResult.ACCEPTED
    assert store.usage(ALICE.peer_id)[0] == 1
    assert store.usage(BOB.peer_id)[0] == 0


def test_replacing_frees_the_old_sources_quota() -> None:
    store = RecordStore(max_records_per_source=2)
    for key in (b"a", b"b"):
        store.store(plain(key, 0, NOW + 10), source=ALICE.peer_id, now=NOW)
    assert store.store(plain(b"c", 0, NOW + 10), source=ALICE.peer_id, now=NOW) is (
        StoreResult.REJECTED_QUOTA
    )
    assert store.store(plain(b"a", 1, NOW + 20), source=BOB.peer_id, now=NOW) is (
        StoreResult.ACCEPTED
    )
    assert store.store(plain(b"c", 0, NOW + 10), source=ALICE.peer_id, now=NOW) is (
        StoreResult.ACCEPTED
    )
    # replacing one's own record does not need a free slot
    assert store.store(plain(b"c", 1, NOW + 30), source=ALICE.peer_id, now=NOW) is (
        StoreResult.ACCEPTED
    )


def test_unsigned_overwrite_of_a_signed_record_is_refused() -> None:
    store = RecordStore()
    key = b"profile" + owner_marker(ALICE.peer_id)
    signed = plain(key, "alice's", NOW + 60).sign(ALICE)
    assert store.store(signed, source=ALICE.peer_id, now=NOW) is StoreResult.ACCEPTED
    for forged in (
        plain(key, "mallory's", NOW + MAX_TTL_SECONDS),
        plain(key, "mallory's", NOW + MAX_TTL_SECONDS).sign(MALLORY),
        replace(signed, value=pack("mallory's"), expiration_time=NOW + 120),
    ):
        with pytest.raises(RecordError):
            store.store(forged, source=MALLORY.peer_id, now=NOW)
    assert store.get_record(key, None, NOW) == signed
    assert store.statistics().num_rejected_invalid == 3


def test_replay_of_an_older_signed_value_is_stale() -> None:
    store = RecordStore()
    key = b"profile" + owner_marker(ALICE.peer_id)
    old = plain(key, "v1", NOW + 60).sign(ALICE)
    new = plain(key, "v2", NOW + 120).sign(ALICE)
    store.store(old, source=ALICE.peer_id, now=NOW)
    assert store.store(new, source=ALICE.peer_id, now=NOW + 1) is StoreResult.ACCEPTED
    assert store.store(old, source=MALLORY.peer_id, now=NOW + 2) is StoreResult.REJECTED_STALE
    assert store.get_record(key, None, NOW + 2) == new
    # and it cannot come back when the newer one has expired, because it expired first
    with pytest.raises(RecordError) as info:
        store.store(old, source=MALLORY.peer_id, now=NOW + 121)
    assert info.value.reason is RecordErrorReason.EXPIRED


def test_relayed_signed_record_is_accepted_from_anyone() -> None:
    store = RecordStore()
    signed = Record(b"peers", owner_marker(ALICE.peer_id), pack(1), NOW + 60).sign(ALICE)
    assert store.store(signed, source=BOB.peer_id, now=NOW) is StoreResult.ACCEPTED


def test_far_future_expiry_is_refused_and_a_hijack_lasts_one_ttl_at_most() -> None:
    store = RecordStore()
    with pytest.raises(RecordError) as info:
        store.store(plain(b"open", "hijack", NOW + 1e9), source=MALLORY.peer_id, now=NOW)
    assert info.value.reason is RecordErrorReason.TOO_FAR_IN_FUTURE
    # the longest allowed expiry
    longest = NOW + MAX_TTL_SECONDS + MAX_CLOCK_SKEW_SECONDS
    hijack = plain(b"open", "hijack", longest)
    assert store.store(hijack, source=MALLORY.peer_id, now=NOW) is StoreResult.ACCEPTED
    honest = plain(b"open", "honest", NOW + 60 + 600)
    assert store.store(honest, source=ALICE.peer_id, now=NOW + 60) is StoreResult.REJECTED_STALE
    # an honest writer using the full TTL a minute later wins at once ...
    overtaking = plain(b"open", "honest", longest + 60)
    fresh = RecordStore()
    fresh.store(hijack, source=MALLORY.peer_id, now=NOW)
    assert fresh.store(overtaking, source=ALICE.peer_id, now=NOW + 60) is StoreResult.ACCEPTED
    # ... and a short-TTL writer wins as soon as the hijack expires, one TTL (+skew) later
    later = longest
    short = plain(b"open", "honest", later + 600)
    assert store.store(short, source=ALICE.peer_id, now=later) is StoreResult.ACCEPTED
    assert store.get_record(b"open", None, later) == short


def test_oversized_value_is_refused() -> None:
    store = RecordStore()
    record = Record(b"k", None, b"x" * (MAX_VALUE_BYTES + 1), NOW + 60)
    with pytest.raises(RecordError) as info:
        store.store(record, source=MALLORY.peer_id, now=NOW)
    assert info.value.reason is RecordErrorReason.TOO_LARGE
    assert len(store) == 0


def honest_records(num_sources: int, per_source: int) -> list[tuple[PeerID, Record]]:
    return [
        (peer(i), plain(f"honest/{i}/{j}".encode(), [i, j], NOW + 3000))
        for i in range(num_sources)
        for j in range(per_source)
    ]


@pytest.mark.parametrize("value_bytes", [8, MAX_VALUE_BYTES])
def test_flood_from_one_source_leaves_honest_records_intact(value_bytes: int) -> None:
    store = RecordStore()
    honest = honest_records(20, 5)
    for source, record in honest[:50]:
        assert store.store(record, source=source, now=NOW) is StoreResult.ACCEPTED
    outcomes: dict[StoreResult, int] = {}
    for n in range(10_000):
        flood = Record(f"flood/{n}".encode(), None, b"x" * value_bytes, NOW + 3000)
        outcome = store.store(flood, source=MALLORY.peer_id, now=NOW + 1)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    for source, record in honest[50:]:  # honest peers can still store after the flood
        assert store.store(record, source=source, now=NOW + 2) is StoreResult.ACCEPTED
    for _, record in honest:
        assert store.get_record(record.key, None, NOW + 3) == record
    assert outcomes[StoreResult.ACCEPTED] <= MAX_RECORDS_PER_SOURCE
    assert outcomes[StoreResult.REJECTED_QUOTA] >= 10_000 - MAX_RECORDS_PER_SOURCE
    assert store.statistics().num_evicted == 0


def test_sybil_flood_filling_the_store_never_evicts_honest_records() -> None:
    store = RecordStore(max_bytes=200_000, max_bytes_per_source=20_000)
    honest = honest_records(30, 3)
    for source, record in honest[:45]:
        store.store(record, source=source, now=NOW)
    sybils = [peer(1000 + i) for i in range(40)]
    for n in range(4000):  # forty sybils, each storing till its own quota, fill the store
        flood = Record(f"flood/{n}".encode(), None, b"x" * 500, NOW + 3000)
        store.store(flood, source=sybils[n % 40], now=NOW + 1)
    assert store.statistics().stored_bytes > 200_000 - 1000
    for source, record in honest[45:]:  # newcomers get in by evicting from the richest
        assert store.store(record, source=source, now=NOW + 2) is StoreResult.ACCEPTED
    for _, record in honest:
        assert store.get_record(record.key, None, NOW + 3) == record
    assert store.statistics().num_evicted > 0
    assert store.statistics().stored_bytes <= 200_000


def test_expired_records_are_purged() -> None:
    store = RecordStore()
    short, long = plain(b"a", 1, NOW + 10), plain(b"b", 2, NOW + 20)
    store.store(short, source=ALICE.peer_id, now=NOW)
    store.store(long, source=BOB.peer_id, now=NOW)
    assert store.get(b"a", NOW + 10) is None  # expired at exactly its expiration time
    assert store.get(b"b", NOW + 10) == StoredValue(long, {})
    assert store.usage(ALICE.peer_id) == (0, 0)
    assert store.purge_expired(NOW + 20) == 1
    assert len(store) == 0 and store.statistics().stored_bytes == 0
    assert list(store.records(NOW + 20)) == []


def test_replacements_do_not_grow_the_expiry_heap_without_bound() -> None:
    store = RecordStore()
    for n in range(20_000):
        store.store(plain(b"k", n, NOW + 100 + n * 1e-3), source=ALICE.peer_id, now=NOW)
    assert len(store) == 1
    assert len(store._expiry) <= 2 * len(store) + 1024 + 1
    assert store.purge_expired(NOW + 200) == 1


def test_subkeys_expire_independently() -> None:
    store = RecordStore()
    a = plain(b"group", "a", NOW + 10, subkey=b"a")
    b = plain(b"group", "b", NOW + 20, subkey=b"b")
    value = plain(b"group", "plain", NOW + 30)
    for record in (a, b, value):
        assert store.store(record, source=ALICE.peer_id, now=NOW) is StoreResult.ACCEPTED
    assert store.get(b"group", NOW) == StoredValue(value, {b"a": a, b"b": b})
    assert store.get(b"group", NOW + 15) == StoredValue(value, {b"b": b})
    assert store.get(b"group", NOW + 25) == StoredValue(value, {})
    assert store.get(b"group", NOW + 30) is None
    # a newer subkey entry replaces only that subkey
    store = RecordStore()
    store.store(a, source=ALICE.peer_id, now=NOW)
    store.store(b, source=ALICE.peer_id, now=NOW)
    a2 = replace(a, value=pack("a2"), expiration_time=NOW + 40)
    assert store.store(a2, source=BOB.peer_id, now=NOW) is StoreResult.ACCEPTED
    assert store.get(b"group", NOW) == StoredValue(None, {b"a": a2, b"b": b})


def test_each_peer_writes_only_its_own_subkey_under_a_shared_key() -> None:
    store = RecordStore()
    announcements = {
        kp.peer_id: Record(b"peers", owner_marker(kp.peer_id), pack(str(kp.peer_id)), NOW + 60)
        for kp in (ALICE, BOB)
    }
    for kp in (ALICE, BOB):
        signed = announcements[kp.peer_id].sign(kp)
        assert store.store(signed, source=kp.peer_id, now=NOW) is StoreResult.ACCEPTED
    alices = announcements[ALICE.peer_id]
    for forged in (
        replace(alices, value=pack("evil"), expiration_time=NOW + 90).sign(BOB),
        replace(alices, value=pack("evil"), expiration_time=NOW + 90).sign(MALLORY),
        replace(alices, value=pack("evil"), expiration_time=NOW + 90),
    ):
        with pytest.raises(RecordError):
            store.store(forged, source=MALLORY.peer_id, now=NOW)
    # an open plain value or open subkey under the same key neither replaces nor hides them
    store.store(plain(b"peers", "noise", NOW + 3000), source=MALLORY.peer_id, now=NOW)
    store.store(plain(b"peers", "noise", NOW + 3000, b"junk"), source=MALLORY.peer_id, now=NOW)
    stored = store.get(b"peers", NOW)
    assert stored is not None
    for kp in (ALICE, BOB):
        marker = owner_marker(kp.peer_id)
        assert stored.subkeys[marker] == announcements[kp.peer_id].sign(kp)


def test_a_flooder_cannot_crowd_honest_peers_out_of_a_shared_key() -> None:
    store = RecordStore()
    honest = [KeyPair.from_seed(i.to_bytes(32, "big")) for i in range(1, 11)]

    def announce(kp: KeyPair, now: float) -> StoreResult:
        record = Record(b"peers", owner_marker(kp.peer_id), pack(1), now + 600)
        return store.store(record.sign(kp), source=kp.peer_id, now=now)

    for kp in honest[:5]:
        assert announce(kp, NOW) is StoreResult.ACCEPTED
    for n in range(MAX_SUBKEYS_PER_KEY + 500):
        junk = plain(b"peers", 0, NOW + 3000, subkey=f"junk{n}".encode())
        store.store(junk, source=MALLORY.peer_id, now=NOW)
    stored = store.get(b"peers", NOW)
    assert stored is not None and len(stored.subkeys) == MAX_SUBKEYS_PER_KEY
    for kp in honest[5:]:
        assert announce(kp, NOW + 1) is StoreResult.ACCEPTED
    stored = store.get(b"peers", NOW + 2)
    assert stored is not None and len(stored.subkeys) == MAX_SUBKEYS_PER_KEY
    for kp in honest:
        assert owner_marker(kp.peer_id) in stored.subkeys
    junk = plain(b"peers", 0, NOW + 3000, subkey=b"more junk")
    assert store.store(junk, source=MALLORY.peer_id, now=NOW + 2) is StoreResult.REJECTED_QUOTA


def test_constructor_checks_its_bounds() -> None:
    with pytest.raises(ValueError):
        RecordStore(max_bytes=10, max_bytes_per_source=20)
    with pytest.raises(ValueError):
        RecordStore(max_records_per_source=0)


def test_random_operations_keep_the_invariants() -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    max_bytes, per_source = 30_000, 8_000
    store = RecordStore(max_bytes=max_bytes, max_bytes_per_source=per_source)
    sources = [peer(i) for i in range(12)]
    now = NOW
    for _ in range(3000):
        now += rng.random()
        key = f"k{rng.randrange(40)}".encode()
        subkey = None if rng.random() < 0.3 else f"s{rng.randrange(30)}".encode()
        record = Record(key, subkey, b"v" * rng.randrange(2000), now + rng.uniform(1, 300))
        source = rng.choice(sources)
        store.purge_expired(now)
        holders = {(k, s): e.source for k, es in store._keys.items() for s, e in es.items()}
        before = {s: store.usage(s)[1] for s in sources}
        result = store.store(record, source=source, now=now)
        after = {(r.key, r.subkey): r for r in store.records(now)}
        assert (result is StoreResult.ACCEPTED) == (after.get((key, subkey)) == record)
        # whatever vanished was evicted from another source that held more than the
        # storing source holds now (max-min fairness)
        mine = store.usage(source)[1]
        for slot in holders.keys() - after.keys():
            assert holders[slot] != source and before[holders[slot]] > mine
        total = sum(store.usage(s)[1] for s in sources)
        assert total == store.statistics().stored_bytes <= max_bytes
        assert all(store.usage(s)[1] <= per_source for s in sources)
        assert sum(store.usage(s)[0] for s in sources) == len(store) == len(after)
        assert all(r.expiration_time > now for r in after.values())
    stats = store.statistics()
    assert stats.num_evicted > 0 and stats.num_rejected_quota > 0 and stats.num_rejected_stale > 0
