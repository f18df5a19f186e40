"""Private swarms: ``PeerConfig.allowed_peers``, over real loopback connections. A
stranger is refused once Noise has proved who it is, whichever side dials, and costs
the members nothing; members talk as usual."""

from __future__ import annotations

import asyncio

import pytest

from peers import KeyPair, Peer, PeerConfig, PeerNotAllowed, PeersError
from peers.echo import ECHO_PROTOCOL_ID, install_echo
from peers.identity import PeerID

WAIT_SECONDS = 10.0


def _private(identity: KeyPair, members: list[KeyPair]) -> PeerConfig:
    return PeerConfig(identity=identity, allowed_peers=frozenset(k.peer_id for k in members))


async def _echo(dialer: Peer, listener: PeerID) -> str:
    async with asyncio.timeout(WAIT_SECONDS):
        return await dialer.call_unary(listener, ECHO_PROTOCOL_ID, "hello", str)


def test_members_talk_and_a_stranger_is_refused_both_ways() -> None:
    alice, bob = KeyPair.generate(), KeyPair.generate()
    team = [alice, bob]

    async def main() -> None:
        async with (
            Peer(_private(alice, team)) as a,
            Peer(_private(bob, team)) as b,
            Peer() as stranger,
        ):
            for peer in (a, b, stranger):
                install_echo(peer)
            await b.connect(a.listen_addrs[0])
            assert await _echo(b, a.peer_id) == "hello"

            # The stranger dials a member: its handshake completes (it cannot know the
            # list), then the member closes the connection; it gets no service.
            with pytest.raises(PeersError):
                async with asyncio.timeout(WAIT_SECONDS):
                    await stranger.connect(a.listen_addrs[0])
                    await stranger.call_unary(a.peer_id, ECHO_PROTOCOL_ID, "hi", str)
            assert a.connection_to(stranger.peer_id) is None

            # A member never dials a stranger, even at an address it was handed...
            a.add_addresses(stranger.peer_id, [stranger.bound_addrs()[0]])
            with pytest.raises(PeerNotAllowed, match="not in this peer's allow-list"):
                await _echo(a, stranger.peer_id)
            # ...nor keeps a connection to whoever answers an address without an id.
            with pytest.raises(PeerNotAllowed, match="not in this peer's allow-list"):
                async with asyncio.timeout(WAIT_SECONDS):
                    await a.connect(stranger.bound_addrs()[0])
            assert stranger.peer_id not in a.connected_peers()
            assert a.statistics().num_not_allowed == 3

            # the members kept talking throughout
            assert await _echo(a, b.peer_id) == "hello"
            assert await _echo(b, a.peer_id) == "hello"

    asyncio.run(main())


@pytest.mark.parametrize("allowed", [set(), ["id"], frozenset(["id"])], ids=repr)
def test_config_refuses_a_bad_allow_list(allowed: object) -> None:
    with pytest.raises(ValueError, match="allowed_peers"):
        PeerConfig(allowed_peers=allowed)  # type: ignore[arg-type]
