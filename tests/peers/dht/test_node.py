"""DHT nodes in one process on loopback: joining, storing, getting, signatures, clients."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from peers import Peer, PeerConfig
from peers.dht.ids import distance, key_id, node_id_of
from peers.dht.node import DHT, DHTConfig, DHTError, ValueWithExpiration, dht_time
from peers.dht.records import Record, RecordError, owner_marker
from peers.serialization import pack

Run = Callable[[Coroutine[Any, Any, Any]], Any]
FAST = {"rpc_timeout": 2.0, "maintenance_interval": 3600.0}


@contextlib.asynccontextmanager
async def swarm(num_nodes: int, **config: Any) -> AsyncIterator[list[DHT]]:
    async with contextlib.AsyncExitStack() as stack:
        first_peer = await stack.enter_async_context(Peer())
        first = await stack.enter_async_context(DHT(first_peer, DHTConfig(**FAST, **config)))
        nodes = [first]
        initial = (str(first_peer.listen_addrs[0]),)
        for _ in range(num_nodes - 1):
            peer = await stack.enter_async_context(Peer())
            nodes.append(
                await stack.enter_async_context(
                    DHT(peer, DHTConfig(initial_peers=initial, **FAST, **config))
                )
            )
        for node in nodes:  # a second round of lookups, now that everyone is there
            await node.find_nearest(node.node_id)
        yield nodes


@pytest.mark.parametrize("paths", [1, 3], ids=["one_path", "three_disjoint_paths"])
def test_store_and_get_from_every_node(arun: Run, paths: int) -> None:
    async def main() -> None:
        async with swarm(8, disjoint_paths=paths) as nodes:
            assert await nodes[3].store("greeting", {"hello": [1, 2, 3]}, dht_time() + 60)
            for node in nodes:
                found = await node.get("greeting")
                assert isinstance(found, ValueWithExpiration)
                assert found.value == {"hello": [1, 2, 3]}
            assert await nodes[0].get("nothing here") is None

    arun(main())


def test_newest_value_wins(arun: Run) -> None:
    async def main() -> None:
        async with swarm(6) as nodes:
            now = dht_time()
            assert await nodes[1].store("k", "new", now + 50)
            await nodes[2].store("k", "old", now + 20)  # older: refused where "new" is held
            for node in nodes:
                found = await node.get("k")
                assert isinstance(found, ValueWithExpiration) and found.value == "new"

    arun(main())


def test_subkeys_let_many_peers_announce_under_one_key(arun: Run) -> None:
    async def main() -> None:
        async with swarm(6) as nodes:
            for node in nodes:
                subkey = owner_marker(node.peer.peer_id)
                assert await node.store(
                    "members", str(node.peer.peer_id), dht_time() + 60, subkey=subkey
                )
            found = await nodes[0].get("members")
            assert isinstance(found, dict)
            assert {v.value for v in found.values()} == {str(n.peer.peer_id) for n in nodes}

    arun(main())


def test_signed_records_cannot_be_forged(arun: Run) -> None:
    async def main() -> None:
        async with swarm(5) as nodes:
            owner, attacker = nodes[1], nodes[2]
            key = b"profile" + owner_marker(owner.peer.peer_id)
            assert await owner.store(key, "genuine", dht_time() + 30)
            # the attacker's node will not sign for someone else: the record is invalid
            with pytest.raises(RecordError):
                await attacker.store(key, "forged", dht_time() + 60)
            for node in nodes:
                found = await node.get(key)
                assert isinstance(found, ValueWithExpiration) and found.value == "genuine"

    arun(main())


def test_client_mode_peer_uses_the_dht_but_is_in_no_routing_table(arun: Run) -> None:
    async def main() -> None:
        async with swarm(5) as nodes:
            initial = (str(nodes[0].peer.listen_addrs[0]),)
            async with Peer(PeerConfig(listen_addrs=())) as client_peer:
                async with DHT(client_peer, DHTConfig(initial_peers=initial, **FAST)) as client:
                    assert client.client_mode
                    assert await client.store("from-client", 42, dht_time() + 60)
                    found = await nodes[4].get("from-client")
                    assert isinstance(found, ValueWithExpiration) and found.value == 42
                    for node in nodes:
                        await node.find_nearest(client.node_id)
                        assert client_peer.peer_id not in node.routing
                    assert client.statistics().num_records == 0  # clients hold nothing

    arun(main())


def test_unreachable_initial_peers(arun: Run, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with swarm(2) as nodes:
            good = str(nodes[0].peer.listen_addrs[0])
            dead = good.rsplit("/tcp/", 1)[0] + "/tcp/1/p2p/" + str(nodes[1].peer.peer_id)
            async with (
                Peer() as peer,
                DHT(peer, DHTConfig(initial_peers=(dead, good), **FAST)) as dht,
            ):
                assert len(dht.routing) >= 1
            assert any(dead in r.getMessage() for r in caplog.records)
            async with Peer() as peer:
                with pytest.raises(DHTError, match="none of the 1 initial peers answered"):
                    async with DHT(
                        peer, DHTConfig(initial_peers=(dead,), bootstrap_timeout=2, **FAST)
                    ):
                        pass

    arun(main())


def test_statistics(arun: Run) -> None:
    async def main() -> None:
        async with swarm(4) as nodes:
            await nodes[0].store("x", 1, dht_time() + 60)
            stats = nodes[0].statistics()
            assert stats.num_contacts == 3 and not stats.client_mode
            assert stats.rpcs_sent.get("find-node", 0) > 0 and stats.rpcs_sent.get("store", 0) > 0
            assert sum(n.statistics().num_records for n in nodes) >= 1

    arun(main())


def test_republish_restores_records_after_their_holders_leave(arun: Run) -> None:
    async def main() -> None:
        async with contextlib.AsyncExitStack() as outer:
            first_peer = await outer.enter_async_context(Peer())
            first = await outer.enter_async_context(
                DHT(first_peer, DHTConfig(**{**FAST, "republish_interval": 0.001}))
            )
            initial = (str(first_peer.listen_addrs[0]),)
            config = DHTConfig(initial_peers=initial, **FAST)
            stayers = []
            for _ in range(4):
                peer = await outer.enter_async_context(Peer())
                stayers.append(await outer.enter_async_context(DHT(peer, config)))
            async with contextlib.AsyncExitStack() as leavers_stack:
                leavers = []
                for _ in range(8):
                    peer = await leavers_stack.enter_async_context(Peer())
                    leavers.append(await leavers_stack.enter_async_context(DHT(peer, config)))
                for node in [first, *stayers, *leavers]:
                    await node.find_nearest(node.node_id)
                assert await first.store("durable", "value", dht_time() + 300)
                holders = [
                    n for n in [first, *stayers, *leavers] if n.store_.get(b"durable", dht_time())
                ]
                assert holders
            # the 8 leavers are gone, with whatever copies they held; drop our local copy
            # too, so only a republish can bring the record back
            first.store_ = type(first.store_)()
            for node in [first, *stayers]:
                await node.find_nearest(node.node_id)  # notice the departures
            await first.maintain_once()
            found = await stayers[-1].get("durable")
            assert isinstance(found, ValueWithExpiration) and found.value == "value"

    arun(main())


def test_a_get_caches_the_value_at_the_closest_node_that_lacked_it(arun: Run) -> None:
    async def main() -> None:
        async with swarm(10) as nodes:
            assert await nodes[0].store("cached", 7, dht_time() + 300)
            now = dht_time()
            holders = {n.peer.peer_id for n in nodes if n.store_.get(b"cached", now)}
            # drop it from one holder; the next get stores it back there
            victim = next(n for n in nodes if n.peer.peer_id in holders and n is not nodes[5])
            victim.store_ = type(victim.store_)()
            for _ in range(3):
                found = await nodes[5].get("cached")
                assert isinstance(found, ValueWithExpiration) and found.value == 7
            after = {n.peer.peer_id for n in nodes if n.store_.get(b"cached", dht_time())}
            assert victim.peer.peer_id in after

    arun(main())


def test_rebootstrap_when_the_routing_table_empties(arun: Run) -> None:
    async def main() -> None:
        async with swarm(3) as nodes:
            loner = nodes[2]
            for contact in loner.routing.contacts():
                loner.routing.remove(contact.peer_id)
            assert len(loner.routing) == 0
            await loner.maintain_once()
            assert len(loner.routing) >= 1

    arun(main())


def test_a_first_found_get_stops_early_and_a_latest_get_finds_the_freshest(arun: Run) -> None:
    async def main() -> None:
        async with swarm(10) as nodes:
            assert await nodes[1].store("ver", "old", dht_time() + 30)
            reader = nodes[6]
            sent = reader.statistics().rpcs_sent.get("find-value", 0)
            quick = await reader.get("ver", latest=False)
            assert isinstance(quick, ValueWithExpiration) and quick.value == "old"
            quick_rpcs = reader.statistics().rpcs_sent.get("find-value", 0) - sent
            # plant a fresher value at the key's closest node only: a first-found get may
            # miss it, a latest get (which asks the closest nodes) must not
            target = key_id(b"ver")
            holder = min(
                (n for n in nodes if n is not reader),
                key=lambda n: distance(node_id_of(n.peer.peer_id), target),
            )
            fresher = Record(b"ver", None, pack("new"), dht_time() + 60)
            holder.store_.store(fresher, source=holder.peer.peer_id, now=dht_time())
            sent = reader.statistics().rpcs_sent.get("find-value", 0)
            latest = await reader.get("ver")
            latest_rpcs = reader.statistics().rpcs_sent.get("find-value", 0) - sent
            assert isinstance(latest, ValueWithExpiration) and latest.value == "new"
            # The first-found get stopped at its first value: never more requests than a
            # latest get, which hears from every replica. (Not always fewer: alpha = 8
            # sends a whole first wave at once, and where the reader's table holds the 8
            # replicas already, a latest get needs no more than that wave either.)
            assert quick_rpcs <= latest_rpcs

    arun(main())


def test_a_store_reaches_the_known_nearest_before_its_lookup_ends(arun: Run) -> None:
    """A store goes out at once to the nearest nodes the routing table knows, beside the
    lookup (one round trip where the table is current, not two): with the lookup held
    up, the record is already at the other nodes; once it ends, the store reports
    success. A guessed node that is gone costs nothing but its own failed request."""

    async def main() -> None:
        async with swarm(5) as nodes:
            writer, gone = nodes[0], nodes[4]
            await gone.peer.__aexit__(None, None, None)  # still in the others' tables
            gate = asyncio.Event()
            find_node = writer.call_find_node

            async def held_up(contact: Any, target: Any) -> Any:
                await gate.wait()
                return await find_node(contact, target)

            writer.call_find_node = held_up  # type: ignore[method-assign]
            storing = asyncio.ensure_future(writer.store("early", 1, dht_time() + 60))
            others = nodes[1:4]
            for _ in range(200):  # bounded: 10 s
                if all(n.store_.get(b"early", dht_time()) for n in others):
                    break
                await asyncio.sleep(0.05)
            assert not storing.done()  # the lookup is still held up
            assert all(n.store_.get(b"early", dht_time()) for n in others)
            gate.set()
            assert await asyncio.wait_for(storing, 10)
            found = await nodes[2].get("early")
            assert isinstance(found, ValueWithExpiration) and found.value == 1

    arun(main())
