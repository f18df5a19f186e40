"""Circuit relay v2 against go-libp2p (hivemind's bundled ``p2pd``), both ways.

- Our private peer reserves a slot on a ``p2pd`` relay (its voucher, signed by go,
  verifies here) and another peer of ours reaches it through that relay.
- A ``p2pd`` peer forced private, with our peer as its trusted relay, reserves on our
  relay, and we reach it through ours.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from peers import Peer, PeerConfig, split_peer_id

hivemind_p2p = pytest.importorskip(
    "hivemind.p2p",
    reason="hivemind (the bench extra) is not installed; it bundles go-libp2p's p2pd",
)

pytestmark = pytest.mark.timeout(120)

WAIT_SECONDS = 30.0


@contextlib.asynccontextmanager
async def p2pd(**kwargs: object) -> AsyncIterator[object]:
    daemon = await hivemind_p2p.P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **kwargs)
    try:
        yield daemon
    finally:
        await daemon.shutdown()


async def any_changed(peers: list[Peer]) -> None:
    """Until one of ``peers`` sees its connections, relays or relay service change."""
    waits = [asyncio.ensure_future(p.nat.wait_changed()) for p in peers]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


def test_our_private_peer_reserves_on_a_go_relay_and_is_dialed_through_it() -> None:
    async def main() -> None:
        # -autonat=1 -forceReachabilityPublic=1: the relay service (and its limits) only
        # starts on a go host that thinks it is public.
        async with p2pd(auto_nat=True, force_reachability="public") as daemon:
            relay_addr = str((await daemon.get_visible_maddrs())[0])  # type: ignore[attr-defined]
            async with (
                Peer(PeerConfig(reachability="private")) as private,
                Peer() as dialer,
            ):
                await private.connect(relay_addr)
                async with asyncio.timeout(WAIT_SECONDS):
                    while not private.circuit_addrs:
                        await private.nat.wait_changed()
                circuit = private.circuit_addrs[0]
                assert str(daemon.peer_id) in str(circuit)  # type: ignore[attr-defined]
                async with asyncio.timeout(WAIT_SECONDS):
                    assert await dialer.connect(circuit) == private.peer_id
                    conn = dialer.connection_to(private.peer_id)
                    assert conn is not None and conn.relayed
                    assert await dialer.ping(private.peer_id) > 0
                    info = await dialer.identify(private.peer_id)
                assert any("/p2p-circuit" in str(a) for a in info.listen_addrs)

    asyncio.run(main())


def test_a_go_private_peer_reserves_on_our_relay_and_we_reach_it() -> None:
    async def main() -> None:
        # go's autorelay reserves at once only with enough candidates (its minimum is
        # 4; with fewer it waits out a boot delay of minutes), so it gets four of ours.
        async with contextlib.AsyncExitStack() as stack:
            relays = [
                await stack.enter_async_context(Peer(PeerConfig(reachability="public")))
                for _ in range(4)
            ]
            dialer = await stack.enter_async_context(Peer())
            relay_addrs = [str(r.listen_addrs[0]) for r in relays]
            daemon = await stack.enter_async_context(
                p2pd(
                    initial_peers=relay_addrs,
                    use_auto_relay=True,
                    trusted_relays=relay_addrs,
                    force_reachability="private",
                    dht_mode="client",
                )
            )

            def holding() -> list[Peer]:
                return [
                    r
                    for r in relays
                    if r.nat.relay_service is not None
                    and r.nat.relay_service.statistics().num_reservations
                ]

            async with asyncio.timeout(WAIT_SECONDS):
                while not holding():
                    await any_changed(relays)
            relay = holding()[0]
            go_id = str(daemon.peer_id)  # type: ignore[attr-defined]
            transport, _ = split_peer_id(relay.listen_addrs[0])
            circuit = f"{transport}/p2p/{relay.peer_id}/p2p-circuit/p2p/{go_id}"
            async with asyncio.timeout(WAIT_SECONDS):
                remote = await dialer.connect(circuit)
                assert str(remote) == go_id
                conn = dialer.connection_to(remote)
                assert conn is not None and conn.relayed
                info = await dialer.identify(remote)  # a protocol run end to end
            assert info.peer_id == remote and info.agent_version
            assert relay.nat.relay_service is not None
            assert relay.nat.relay_service.statistics().num_circuits_opened >= 1

    asyncio.run(main())
