"""The Kademlia routing table: splitting, the eviction rule, failures, nearest, refresh.

Pure: no network, no clock; times are plain numbers.
"""

from __future__ import annotations

import hashlib
import itertools
import random

import pytest

from peers.dht.ids import ID_BITS, Contact, distance, key_id, node_id_of
from peers.dht.routing import (
    MAX_FAILURES,
    MAX_PER_SOURCE,
    MAX_PER_SOURCE_PER_BUCKET,
    K,
    RoutingStatistics,
    RoutingTable,
)
from peers.identity import KeyPair, PeerID

TOP_BIT = 1 << (ID_BITS - 1)


def random_peer(rng: random.Random) -> PeerID:
    # An identity multihash of 36 random bytes: a well-formed PeerID, much faster than
    # generating keys, and reproducible from the seed.
    return PeerID(bytes([0, 36]) + rng.randbytes(36))


def seeded() -> random.Random:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    return random.Random(seed)


def far_contacts(local_id: int, rng: random.Random, count: int) -> list[Contact]:
    """``count`` contacts whose top bit differs from ``local_id``'s: they all share the
    bucket of the far half of the id space, which never splits."""
    found: list[Contact] = []
    while len(found) < count:
        contact = Contact(random_peer(rng), ("/ip4/10.0.0.1/tcp/1",))
        if (contact.node_id ^ local_id) & TOP_BIT:
            found.append(contact)
    return found


def check_invariants(table: RoutingTable) -> None:
    ranges = table.bucket_ranges()
    assert ranges[0][0] == 0 and ranges[-1][1] == 1 << ID_BITS
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    for low, high in ranges:
        members = [c for c in table.contacts() if low <= c.node_id < high]
        assert len(members) <= table.k
    assert len({c.peer_id for c in table.contacts()}) == len(table)


def test_ids_are_sha256_of_peer_id_and_contacts_compare_by_peer_id() -> None:
    peer = KeyPair.from_seed(b"\x01" * 32).peer_id
    assert node_id_of(peer) == int.from_bytes(hashlib.sha256(peer.to_bytes()).digest(), "big")
    assert key_id(peer.to_bytes()) == node_id_of(peer)
    a, b = Contact(peer, ("/ip4/1.2.3.4/tcp/1",)), Contact(peer, ())
    assert a == b and hash(a) == hash(b) and a.node_id == node_id_of(peer)
    assert distance(a.node_id, a.node_id) == 0


def test_update_adds_and_refreshes_known_contacts() -> None:
    rng = seeded()
    table = RoutingTable(node_id_of(random_peer(rng)))
    peer = random_peer(rng)
    assert table.update(Contact(peer, ("/ip4/1.1.1.1/tcp/1",)), now=1.0) is None
    assert peer in table and len(table) == 1 and table.last_seen(peer) == 1.0
    assert table.update(Contact(peer, ("/ip4/2.2.2.2/tcp/2",)), now=5.0) is None
    found = table.get(peer)
    assert found is not None and found.addrs == ("/ip4/2.2.2.2/tcp/2",)
    assert table.last_seen(peer) == 5.0 and len(table) == 1
    # An update without addresses (say, an inbound call) keeps the known ones.
    table.update(Contact(peer), now=6.0)
    found = table.get(peer)
    assert found is not None and found.addrs == ("/ip4/2.2.2.2/tcp/2",)
    unknown = random_peer(rng)
    assert table.get(unknown) is None and table.last_seen(unknown) is None
    assert unknown not in table and "not a peer id" not in table


def test_never_adds_the_local_id() -> None:
    me = KeyPair.from_seed(b"\x02" * 32).peer_id
    table = RoutingTable(node_id_of(me))
    assert table.update(Contact(me), now=0.0) is None
    assert len(table) == 0 and me not in table


def test_buckets_split_around_the_local_id_and_respect_capacity() -> None:
    rng = seeded()
    table = RoutingTable(node_id_of(random_peer(rng)))
    for step in range(1000):
        table.update(Contact(random_peer(rng)), now=float(step))
    check_invariants(table)
    stats = table.statistics()
    # 1000 random ids: the far half holds about 500, but its bucket keeps only k; the
    # buckets near our id split until each holds at most k.
    assert stats.num_buckets >= 5
    assert stats.num_contacts == len(table) <= K * stats.num_buckets
    assert stats.num_replacements > 0
    # Only buckets that held our id were split: every bucket but the one holding it is
    # one half of a range that does.
    local = table.local_id
    for low, high in table.bucket_ranges():
        if not low <= local < high:
            size = high - low
            sibling_low = low ^ size
            assert sibling_low <= local < sibling_low + size


def test_full_bucket_returns_least_recently_seen_and_keeps_it_if_alive() -> None:
    rng = seeded()
    local_id = node_id_of(random_peer(rng))
    table = RoutingTable(local_id, replacement_cache_size=2)
    old = far_contacts(local_id, rng, K)
    for i, contact in enumerate(old):
        assert table.update(contact, now=float(i)) is None
    newcomers = far_contacts(local_id, rng, 3)
    # A full bucket that does not hold our id: the newcomer waits, the oldest is pinged.
    assert table.update(newcomers[0], now=100.0) == old[0]
    assert newcomers[0].peer_id not in table and len(table) == K
    # The oldest answered the ping: it stays (the paper prefers old live nodes) and is
    # now the most recently seen, so the next candidate for eviction is old[1].
    assert table.update(old[0], now=101.0) is None
    assert table.update(newcomers[1], now=102.0) == old[1]
    # The replacement cache is bounded and keeps the newest.
    assert table.update(newcomers[2], now=103.0) == old[1]
    assert table.statistics().num_replacements == 2
    # old[1] did not answer: it goes, and the newest replacement takes its place.
    table.remove(old[1].peer_id)
    assert old[1].peer_id not in table and newcomers[2].peer_id in table
    assert newcomers[0].peer_id not in table and len(table) == K
    table.remove(old[2].peer_id)
    assert newcomers[1].peer_id in table
    table.remove(old[3].peer_id)  # no replacement left: the bucket just shrinks
    assert len(table) == K - 1 and table.statistics().num_replacements == 0
    check_invariants(table)


def test_failures_remove_after_max_and_promote_a_replacement() -> None:
    rng = seeded()
    local_id = node_id_of(random_peer(rng))
    table = RoutingTable(local_id)
    old = far_contacts(local_id, rng, K)
    for i, contact in enumerate(old):
        table.update(contact, now=float(i))
    spare = far_contacts(local_id, rng, 1)[0]
    assert table.update(spare, now=50.0) == old[0]
    victim = old[5].peer_id
    for _ in range(MAX_FAILURES - 1):
        assert table.record_failure(victim, now=60.0) is False
    table.update(old[5], now=61.0)  # it answered: the count starts over
    for _ in range(MAX_FAILURES - 1):
        assert table.record_failure(victim, now=62.0) is False
    assert victim in table
    assert table.record_failure(victim, now=63.0) is True
    assert victim not in table and spare.peer_id in table and len(table) == K
    assert table.record_failure(victim, now=64.0) is False  # unknown now
    # A failing replacement is dropped at once.
    extra = far_contacts(local_id, rng, 1)[0]
    table.update(extra, now=70.0)
    assert table.statistics().num_replacements == 1
    assert table.record_failure(extra.peer_id, now=71.0) is True
    assert table.statistics().num_replacements == 0


def test_nearest_matches_brute_force() -> None:
    rng = seeded()
    table = RoutingTable(node_id_of(random_peer(rng)))
    for step in range(400):
        table.update(Contact(random_peer(rng)), now=float(step))
    contacts = table.contacts()
    for _ in range(200):
        target = rng.getrandbits(ID_BITS) if rng.random() < 0.5 else rng.choice(contacts).node_id
        count = rng.choice([1, 3, K, 1000])
        exclude = {c.peer_id for c in rng.sample(contacts, rng.randrange(0, 10))}
        expected = sorted(
            (c for c in contacts if c.peer_id not in exclude),
            key=lambda c: distance(c.node_id, target),
        )[:count]
        exclude_arg = list(exclude) if rng.random() < 0.5 else exclude
        assert table.nearest(target, count, exclude=exclude_arg) == expected
    assert table.nearest(0, 0) == []


def test_buckets_to_refresh() -> None:
    rng = seeded()
    table = RoutingTable(node_id_of(random_peer(rng)))
    # A new table has never refreshed its one bucket.
    assert table.buckets_to_refresh(now=0.0, refresh_interval=3600.0) == [1 << (ID_BITS - 1)]
    for step in range(300):
        table.update(Contact(random_peer(rng)), now=float(step))
    ranges = table.bucket_ranges()
    # Everything was heard from within the last 300 s; after the interval all are due.
    assert table.buckets_to_refresh(now=1000.0, refresh_interval=3600.0) == []
    due = table.buckets_to_refresh(now=10_000.0, refresh_interval=3600.0, rng=rng)
    assert len(due) == len(ranges)
    for target, (low, high) in zip(due, ranges, strict=True):
        assert low <= target < high
    # A lookup refreshes its target's bucket, and only that one.
    table.mark_bucket_refreshed(due[0], now=9_000.0)
    again = table.buckets_to_refresh(now=10_000.0, refresh_interval=3600.0)
    assert len(again) == len(ranges) - 1
    assert not ranges[0][0] <= again[0] < ranges[0][1]
    # So does hearing from a contact in a bucket.
    heard = next(c for c in table.contacts() if c.node_id >= ranges[0][1])
    table.update(heard, now=9_500.0)
    assert len(table.buckets_to_refresh(now=10_000.0, refresh_interval=3600.0)) == len(ranges) - 2


def test_statistics_is_a_frozen_record() -> None:
    stats = RoutingTable(0).statistics()
    assert stats == RoutingStatistics(num_contacts=0, num_buckets=1, num_replacements=0)
    with pytest.raises(AttributeError):
        stats.num_contacts = 1  # type: ignore[misc]


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        RoutingTable(-1)
    with pytest.raises(ValueError):
        RoutingTable(1 << ID_BITS)
    with pytest.raises(ValueError):
        RoutingTable(0, k=0)


def test_one_network_gets_two_places_per_bucket_and_eight_in_the_table() -> None:
    """Issue 21, item 4: identities are cheap, networks are not. Contacts from one
    source take at most MAX_PER_SOURCE_PER_BUCKET places of a bucket and MAX_PER_SOURCE
    of the table, and are not kept as replacements; other sources are unaffected."""
    rng = seeded()
    local = node_id_of(random_peer(rng))
    table = RoutingTable(local)
    sybils = far_contacts(local, rng, 30)
    for i, contact in enumerate(sybils):
        assert table.update(contact, float(i), source="net/203.0.113.0/24") is None
    assert len(table) == MAX_PER_SOURCE_PER_BUCKET
    assert table.statistics().num_replacements == 0
    assert table.num_refused_by_source == 30 - MAX_PER_SOURCE_PER_BUCKET
    honest = far_contacts(local, rng, 5)
    for i, contact in enumerate(honest):
        table.update(contact, 100.0 + i, source=f"net/198.51.{i}.0/24")
    assert all(c.peer_id in table for c in honest)
    # Across buckets (honest peers of distinct networks split the table): eight in all.
    for i in range(400):
        table.update(Contact(random_peer(rng)), 150.0 + i, source=f"peer/{i}")
    assert table.statistics().num_buckets > MAX_PER_SOURCE // MAX_PER_SOURCE_PER_BUCKET
    everywhere = {Contact(random_peer(rng)) for _ in range(2000)}
    for i, contact in enumerate(everywhere):
        table.update(contact, 200.0 + i, source="host/198.19.0.2")
    placed = [c for c in table.contacts() if c in everywhere]
    assert 0 < len(placed) <= MAX_PER_SOURCE
    for bucket in table._buckets:
        held = [*bucket.entries, *bucket.replacements]
        assert sum(1 for p in held if Contact(p) in everywhere) <= MAX_PER_SOURCE_PER_BUCKET
    # A contact of that source that leaves frees its place (a replacement of the same
    # source may take it at once), and the bound holds through churn.
    for leaving in placed:
        table.remove(leaving.peer_id)
        assert leaving.peer_id not in table
        for i, contact in enumerate(everywhere):
            table.update(contact, 5000.0 + i, source="host/198.19.0.2")
        assert 0 < sum(1 for c in table.contacts() if c in everywhere) <= MAX_PER_SOURCE
    check_invariants(table)


def test_contacts_of_unknown_source_are_not_limited() -> None:
    rng = seeded()
    local = node_id_of(random_peer(rng))
    table = RoutingTable(local)
    for i, contact in enumerate(far_contacts(local, rng, K)):
        table.update(contact, float(i))
    assert len(table) == K


def test_a_join_refreshes_one_id_at_each_distance_farther_than_the_closest_contact() -> None:
    rng = seeded()
    table = RoutingTable(rng.getrandbits(ID_BITS))
    assert table.join_targets(rng) == []  # nobody known: nothing to refresh
    contacts = [Contact(random_peer(rng)) for _ in range(40)]
    for contact in contacts:
        table.update(contact, 0.0)
    known = table.contacts()
    closest_bit = min(distance(table.local_id, c.node_id) for c in known).bit_length() - 1
    targets = table.join_targets(rng)
    # one per distance bucket above the closest contact's, highest differing bit = bucket
    bits = [distance(table.local_id, t).bit_length() - 1 for t in targets]
    assert bits == list(range(closest_bit + 1, ID_BITS))
