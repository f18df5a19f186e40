"""The blocking DHT, as a training script would use it."""

from __future__ import annotations

import pytest

from peers.dht import BlockingDHT, DHTError, ValueWithExpiration, dht_time


def test_three_lines_from_a_script() -> None:
    with BlockingDHT() as bootstrap:
        initial_peers = [str(bootstrap.peer.listen_addrs[0])]
        dht = BlockingDHT(initial_peers=initial_peers)
        try:
            assert dht.store("progress", {"step": 120}, ttl=60)
            found = dht.get("progress")
            assert isinstance(found, ValueWithExpiration) and found.value == {"step": 120}
            assert dht.store("members", "me", expiration_time=dht_time() + 60, subkey="a")
            members = bootstrap.get("members")
            assert isinstance(members, dict) and members[b"a"].value == "me"
            stats = dht.statistics()
            assert stats.num_contacts == 1 and stats.rpcs_sent["store"] >= 2
        finally:
            dht.close()
            dht.close()  # idempotent


def test_bad_arguments_and_unreachable_peers_fail_clearly() -> None:
    with BlockingDHT() as dht:
        with pytest.raises(ValueError, match="exactly one"):
            dht.store("k", 1)
        with pytest.raises(ValueError, match="exactly one"):
            dht.store("k", 1, expiration_time=dht_time() + 5, ttl=5)
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"
    with pytest.raises(DHTError, match="none of the 1 initial peers answered"):
        BlockingDHT(initial_peers=[dead])
