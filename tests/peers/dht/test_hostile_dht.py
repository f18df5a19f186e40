"""Hostile peers against a DHT node: forged, replayed, far-future, oversized and
flooding stores, and lies about who is where. Each is sent over the real RPC."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from peers import KeyPair, Peer, PeerConfig, PeersError, RemoteError
from peers.dht.ids import Contact, distance, key_id, node_id_of
from peers.dht.node import DHT, DHTConfig, ValueWithExpiration, dht_time
from peers.dht.protocol import (
    FIND_NODE_PROTOCOL,
    FIND_VALUE_PROTOCOL,
    MAX_REPLY_RECORD_BYTES,
    STORE_PROTOCOL,
    FindNodeRequest,
    FindNodeResponse,
    FindValueRequest,
    FindValueResponse,
    SenderInfo,
    StoreRequest,
    StoreResponse,
    WireRecord,
    record_from_wire,
    record_to_wire,
)
from peers.dht.records import MAX_TTL_SECONDS, MAX_VALUE_BYTES, Record, owner_marker
from peers.serialization import pack

Run = Callable[[Coroutine[Any, Any, Any]], Any]
FAST = {"rpc_timeout": 2.0, "maintenance_interval": 3600.0}


@contextlib.asynccontextmanager
async def victim_and_attacker() -> AsyncIterator[tuple[DHT, Peer]]:
    """A DHT node, and a plain peer that speaks the DHT protocols by hand."""
    async with Peer() as victim_peer, DHT(victim_peer, DHTConfig(**FAST)) as victim:
        async with Peer() as attacker:
            await attacker.connect(victim_peer.listen_addrs[0])
            yield victim, attacker


async def raw_store(attacker: Peer, victim: DHT, records: list[WireRecord]) -> list[bool]:
    response = await attacker.call_unary(
        victim.peer.peer_id,
        STORE_PROTOCOL,
        StoreRequest(SenderInfo(), records),
        StoreResponse,
        timeout=10,
    )
    return response.accepted


def wire(key: bytes, value: object, expiration: float, subkey: bytes | None = None) -> WireRecord:
    return WireRecord(key, subkey, pack(value), expiration)


def held(victim: DHT, key: bytes) -> Any:
    record = victim.store_.get_record(key, None, dht_time())
    return None if record is None else record


def test_unsigned_overwrite_of_a_signed_record_is_refused(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            owner = KeyPair.generate()
            key = b"profile" + owner_marker(owner.peer_id)
            genuine = Record(key, None, pack("genuine"), dht_time() + 60).sign(owner)
            assert await raw_store(attacker, victim, [record_to_wire(genuine)]) == [True]
            forged = [
                wire(key, "forged", dht_time() + 120),  # no signature
                WireRecord(key, None, pack("forged"), dht_time() + 120, b"\x00" * 64),  # a bad one
                record_to_wire(
                    Record(key, None, pack("forged"), dht_time() + 120).sign(KeyPair.generate())
                ),
            ]
            assert await raw_store(attacker, victim, forged) == [False, False, False]
            assert held(victim, key).value == pack("genuine")

    arun(main())


def test_replay_of_an_older_signed_value_is_refused(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            owner = KeyPair.generate()
            key = b"status" + owner_marker(owner.peer_id)
            old = Record(key, None, pack("step 1"), dht_time() + 30).sign(owner)
            new = Record(key, None, pack("step 2"), dht_time() + 60).sign(owner)
            assert await raw_store(attacker, victim, [record_to_wire(old)]) == [True]
            assert await raw_store(attacker, victim, [record_to_wire(new)]) == [True]
            # the attacker captured "step 1" (validly signed) and replays it
            assert await raw_store(attacker, victim, [record_to_wire(old)]) == [False]
            assert held(victim, key).value == pack("step 2")

    arun(main())


def test_far_future_expiry_cannot_hijack_a_key(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            ten_years = dht_time() + 10 * 365 * 86400
            assert await raw_store(attacker, victim, [wire(b"open-key", "hijack", ten_years)]) == [
                False
            ]
            assert held(victim, b"open-key") is None
            # the longest legal expiry only holds the key for MAX_TTL: an honest peer's
            # later store (expiring later) takes it over
            assert await raw_store(
                attacker, victim, [wire(b"open-key", "squat", dht_time() + MAX_TTL_SECONDS)]
            ) == [True]
            later = dht_time() + MAX_TTL_SECONDS + 1
            assert not victim.store_.get_record(b"open-key", None, later)  # expired by then

    arun(main())


def test_oversized_value_is_refused(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            big = WireRecord(b"big", None, b"\x00" * (MAX_VALUE_BYTES + 1), dht_time() + 60)
            assert await raw_store(attacker, victim, [big]) == [False]
            assert len(victim.store_) == 0
            # and a frame beyond the RPC limit is refused as a whole, the node keeps serving
            huge = WireRecord(b"huge", None, b"\x00" * (17 << 20), dht_time() + 60)
            with pytest.raises(RemoteError):
                await raw_store(attacker, victim, [huge])
            assert await raw_store(attacker, victim, [wire(b"small", 1, dht_time() + 60)]) == [True]

    arun(main())


def test_a_flood_from_one_peer_does_not_evict_honest_records(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            async with Peer() as honest:
                await honest.connect(victim.peer.listen_addrs[0])
                honest_records = [
                    wire(f"honest-{i}".encode(), i, dht_time() + 600) for i in range(200)
                ]
                assert all(await raw_store(honest, victim, honest_records))
                accepted = 0
                for batch in range(10):  # 10^4 stores in batches of 1000
                    flood = [
                        wire(f"flood-{batch}-{i}".encode(), "x" * 512, dht_time() + 600)
                        for i in range(1000)
                    ]
                    accepted += sum(await raw_store(attacker, victim, flood))
                print(f"flood: {accepted} of 10000 stores accepted")
                assert accepted < 10_000  # the quota stopped it
                for i in range(200):
                    record = victim.store_.get_record(f"honest-{i}".encode(), None, dht_time())
                    assert record is not None and record.value == pack(i)

    arun(main())


def test_a_peer_cannot_choose_its_node_id_or_impersonate(arun: Run) -> None:
    """No message carries a node id: a peer's place is sha256 of the PeerID its
    connection authenticated. A contact that names someone else's PeerID at the
    attacker's address fails the Noise check when dialed and is dropped."""

    async def main() -> None:
        async with Peer() as victim_peer, DHT(victim_peer, DHTConfig(**FAST)) as victim:
            async with Peer() as attacker:
                addr = str(attacker.listen_addrs[0]).rsplit("/p2p/", 1)[0]
                # the attacker calls with extra trailing fields (say, a chosen node id)
                request = FindNodeRequest(SenderInfo([addr], False), b"\x00" * 32)
                raw = [[[addr], False], b"\x00" * 32, b"\xff" * 32]
                await attacker.connect(victim_peer.listen_addrs[0])
                await attacker.call_unary(
                    victim_peer.peer_id, FIND_NODE_PROTOCOL, request, FindNodeResponse
                )
                await attacker.call_unary(
                    victim_peer.peer_id, FIND_NODE_PROTOCOL, raw, FindNodeResponse
                )
                entry = victim.routing.get(attacker.peer_id)
                assert entry is not None and entry.node_id == node_id_of(attacker.peer_id)

                # now the attacker poses as someone else, at its own address
                impostor_of = KeyPair.generate().peer_id
                fake = Contact(impostor_of, (addr,))
                assert victim.routing.update(fake, 0.0) is None
                with pytest.raises(Exception, match="but the remote is"):
                    await victim.call_find_node(fake, 0)
                for _ in range(3):
                    with contextlib.suppress(Exception):
                        await victim.call_find_node(fake, 0)
                assert impostor_of not in victim.routing

    arun(main())


def test_client_mode_is_automatic_without_a_listen_address(arun: Run) -> None:
    async def main() -> None:
        async with Peer() as server_peer, DHT(server_peer, DHTConfig(**FAST)) as server:
            initial = (str(server_peer.listen_addrs[0]),)
            async with Peer(PeerConfig(listen_addrs=())) as client_peer:
                async with DHT(client_peer, DHTConfig(initial_peers=initial, **FAST)) as client:
                    assert client.client_mode
                    assert await client.store("k", "v", dht_time() + 60)
                    assert client_peer.peer_id not in server.routing
                    found = await client.get("k")
                    assert isinstance(found, ValueWithExpiration) and found.value == "v"

    arun(main())


def test_an_undecodable_value_does_not_hide_the_others_under_its_key(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            expiration = dht_time() + 60
            good = wire(b"shared", "honest", expiration, subkey=b"a")
            garbage = WireRecord(b"shared", b"b", b"\xc1\xff\x00garbage", expiration)
            assert await raw_store(attacker, victim, [good, garbage]) == [True, True]
            found = await victim.get(b"shared")
            assert isinstance(found, dict) and list(found) == [b"a"]
            assert found[b"a"].value == "honest"
            lone = WireRecord(b"lone", None, b"\xc1", expiration)
            assert await raw_store(attacker, victim, [lone]) == [True]
            assert await victim.get(b"lone") is None

    arun(main())


def test_a_big_key_is_read_in_pages_of_bounded_size(arun: Run) -> None:
    """A key holding 600 kB: a 100-byte request gets at most MAX_REPLY_RECORD_BYTES of
    it (it got all of it, up to 8 MiB, before), and a reader still gets every value."""

    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            expiration = dht_time() + 300
            values = {f"peer{i:03d}".encode(): "x" * 6000 for i in range(100)}
            records = [wire(b"big", v, expiration, subkey=k) for k, v in values.items()]
            assert all(await raw_store(attacker, victim, records))
            pages, after, seen = 0, None, []
            while True:  # bounded: every page moves past its last subkey
                response = await attacker.call_unary(
                    victim.peer.peer_id,
                    FIND_VALUE_PROTOCOL,
                    FindValueRequest(SenderInfo(), b"big", after),
                    FindValueResponse,
                    timeout=10,
                )
                pages += 1
                size = sum(len(r.value) + len(r.subkey or b"") for r in response.records)
                assert 0 < size <= MAX_REPLY_RECORD_BYTES
                seen += [r.subkey for r in response.records]
                if not response.more:
                    break
                after = response.records[-1].subkey
            assert pages == 3 and seen == sorted(values)  # in order, none twice
            async with (
                Peer() as reader_peer,
                DHT(
                    reader_peer,
                    DHTConfig(initial_peers=(str(victim.peer.listen_addrs[0]),), **FAST),
                ) as reader,
            ):
                got = await reader.get(b"big")
                assert isinstance(got, dict) and sorted(got) == sorted(values)

    arun(main())


def test_a_server_that_always_says_more_costs_a_bounded_read(arun: Run) -> None:
    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            calls = 0
            record = wire(b"k", "v", dht_time() + 60, subkey=b"same")

            async def endless(request: FindValueRequest, context: object) -> FindValueResponse:
                nonlocal calls
                calls += 1
                return FindValueResponse([record], [], more=True)

            attacker.add_unary_handler(FIND_VALUE_PROTOCOL, endless, FindValueRequest)
            contact = Contact(attacker.peer_id, tuple(str(a) for a in attacker.listen_addrs))
            records, _ = await victim.call_find_value(contact, b"k")
            assert calls == 2 and len(records) == 2  # the second page did not move on

    arun(main())


def test_a_store_far_from_its_key_is_refused(arun: Run) -> None:
    """Issue 21, item 4: records live at the nodes closest to their key. A node that
    knows k nodes closer to a key than itself refuses to hold records under it, so a
    stranger cannot make any node it likes hold its records."""

    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            k = victim.config.k
            contacts = [Contact(KeyPair.generate().peer_id) for _ in range(3 * k)]
            for i, contact in enumerate(contacts):
                victim.routing.update(contact, float(i))

            def closer(key: bytes) -> int:
                mine = distance(victim.node_id, key_id(key))
                return sum(1 for c in contacts if distance(c.node_id, key_id(key)) < mine)

            far = next(key for key in (os.urandom(8) for _ in range(1000)) if closer(key) > k)
            near = next(key for key in (os.urandom(8) for _ in range(10_000)) if closer(key) == 0)
            expires = dht_time() + 60
            result = await raw_store(
                attacker, victim, [wire(far, "x", expires), wire(near, "y", expires)]
            )
            assert result == [False, True]
            assert victim.statistics().num_stores_refused_far == 1
            assert held(victim, far) is None and held(victim, near) is not None

    arun(main())


def test_a_dht_frame_is_small_and_our_own_big_stores_go_in_batches(arun: Run) -> None:
    """Issue 21, item 5: DHT messages are small by design, so a DHT stream reads frames
    of at most MAX_DHT_FRAME_BYTES holding at most MAX_DHT_VALUE_ITEMS items (it read
    the RPC layer's 16 MiB and 262,144 before: any peer could make a node buffer and
    decode that much per stream). A bigger request costs its caller an error and the
    node nothing; our own big stores are split."""

    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            expiration = dht_time() + 300
            big = [wire(os.urandom(8), "x" * 8000, expiration) for _ in range(200)]  # 1.6 MB
            with pytest.raises(PeersError):
                await raw_store(attacker, victim, big)
            # 100 kB of one-byte items: within the frame, past MAX_DHT_VALUE_ITEMS.
            with pytest.raises(RemoteError, match=r"max_array_len|items"):
                await attacker.call_unary(
                    victim.peer.peer_id,
                    STORE_PROTOCOL,
                    StoreRequest(SenderInfo([""] * 100_000), []),
                    StoreResponse,
                    timeout=10,
                )
            assert await raw_store(attacker, victim, big[:50]) == [True] * 50  # still serving
            async with Peer() as peer, DHT(peer, DHTConfig(**FAST)) as storer:
                await peer.connect(victim.peer.listen_addrs[0])
                records = [record_from_wire(r) for r in big[50:]]
                contact = Contact(victim.peer.peer_id, (str(victim.peer.listen_addrs[0]),))
                assert await storer.call_store(contact, records) == [True] * 150
                assert storer.statistics().rpcs_sent["store"] >= 3

    arun(main())


def test_malformed_and_oversized_status_records_are_refused_and_cost_nothing_else(
    arun: Run,
) -> None:
    """A status record (peers.dht.status) that breaks the schema, or is too large, is
    refused by the replica over the real RPC; the attacker's connection, an honest
    peer's record and the attacker's own valid record after it all still work."""
    from peers.dht.status import MAX_STATUS_BYTES, STATUS_KEY, PeerStatus

    def signed(owner: KeyPair, value: object) -> WireRecord:
        data = value if isinstance(value, bytes) else pack(value)
        subkey = owner_marker(owner.peer_id)
        return record_to_wire(Record(STATUS_KEY, subkey, data, dht_time() + 60).sign(owner))

    async def main() -> None:
        async with victim_and_attacker() as (victim, attacker):
            honest, hostile = KeyPair.generate(), KeyPair.generate()
            good = PeerStatus(agent="swarmtrain", reachability="public", time=dht_time())
            assert await raw_store(attacker, victim, [signed(honest, good.to_value())]) == [True]
            broken = {**good.to_value(), "reach": "<script>", "agent": "x\x00"}
            oversized = {**good.to_value(), "agent": "a" * MAX_STATUS_BYTES}
            garbage = b"\x03\xc1\xc1\xc1"
            attempts = [signed(hostile, v) for v in (broken, oversized, garbage)]
            assert await raw_store(attacker, victim, attempts) == [False, False, False]
            assert victim.store_.statistics().num_rejected_invalid == 3
            assert await raw_store(attacker, victim, [signed(hostile, good.to_value())]) == [True]
            found = await victim.get(STATUS_KEY)
            assert isinstance(found, dict) and len(found) == 2
            assert {owner_marker(honest.peer_id), owner_marker(hostile.peer_id)} == set(found)

    arun(main())
