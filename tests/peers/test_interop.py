"""Interop with go-libp2p: the p2pd daemon bundled in hivemind, driven by hivemind's P2P.

Nobody on this project wrote that implementation, so these tests check that we speak
multistream-select, Noise XX, yamux, identify and ping as libp2p defines them.
"""

from __future__ import annotations

import asyncio

import pytest

from peers import Peer, PeerIDMismatch, Stream, parse_multiaddr, split_peer_id

hivemind_p2p = pytest.importorskip(
    "hivemind.p2p",
    reason="hivemind (the bench extra) is not installed; it bundles go-libp2p's p2pd",
)
from hivemind.utils.multiaddr import Multiaddr as HivemindMultiaddr  # noqa: E402

PROTOCOL = "/swarmtrain/interop-echo/1.0.0"


def test_go_libp2p_dials_us_and_uses_our_protocol() -> None:
    async def main() -> None:
        daemon = await hivemind_p2p.P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            async with Peer() as ours:
                served: list[bytes] = []

                async def echo(stream: Stream) -> None:
                    data = b""
                    while not data.endswith(b"\n"):
                        chunk = await stream.read()
                        if not chunk:
                            break
                        data += chunk
                    served.append(data)
                    await stream.write(b"echo:" + data)
                    await stream.close()

                ours.set_stream_handler(PROTOCOL, echo)
                transport, _ = split_peer_id(ours.listen_addrs[0])
                our_id = hivemind_p2p.PeerID.from_base58(str(ours.peer_id))
                # p2pd's connect takes the address without its /p2p part.
                async with asyncio.timeout(20):
                    await daemon._client.connect(our_id, [HivemindMultiaddr(str(transport))])
                    _, reader, writer = await daemon._client.stream_open(our_id, (PROTOCOL,))
                    payload = b"hello from go-libp2p " + b"x" * 300_000 + b"\n"
                    writer.write(payload)
                    await writer.drain()
                    reply = await reader.readexactly(len(payload) + 5)
                    writer.close()
                assert reply == b"echo:" + payload
                assert served == [payload]
                # the daemon authenticated as who it says it is
                daemon_id = (await daemon.get_visible_maddrs())[0]
                assert str(daemon.peer_id) in str(daemon_id)
                assert any(str(p) == str(daemon.peer_id) for p in ours.connected_peers())
                [conn] = [c for p in ours.connected_peers() if (c := ours.connection_to(p))]
                assert conn.security_protocol == "/noise"  # go-libp2p does not know ours
        finally:
            await daemon.shutdown()

    asyncio.run(main())


def test_we_dial_go_libp2p_ping_and_identify() -> None:
    async def main() -> None:
        daemon = await hivemind_p2p.P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            maddr = str((await daemon.get_visible_maddrs())[0])
            async with Peer() as ours:
                async with asyncio.timeout(20):
                    remote = await ours.connect(maddr)
                    assert str(remote) == str(daemon.peer_id)
                    # we proposed our AESGCM Noise first; go-libp2p said na, then /noise
                    conn = ours.connection_to(remote)
                    assert conn is not None and conn.security_protocol == "/noise"
                    rtts = [await ours.ping(remote) for _ in range(3)]
                    info = await ours.identify(remote)
                assert all(0 < r < 5 for r in rtts)
                assert "/ipfs/ping/1.0.0" in info.protocols
                assert info.agent_version  # go-libp2p reports its agent
                # its identify names the address we dialed
                assert str(split_peer_id(parse_multiaddr(maddr))[0]) in map(str, info.listen_addrs)
                # a wrong /p2p part is refused after the Noise handshake
                other = await hivemind_p2p.P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                try:
                    wrong = str(split_peer_id(parse_multiaddr(maddr))[0]) + f"/p2p/{other.peer_id}"
                    async with asyncio.timeout(20):
                        with pytest.raises(PeerIDMismatch):
                            await ours.connect(wrong)
                finally:
                    await other.shutdown()
        finally:
            await daemon.shutdown()

    asyncio.run(main())
