"""Which Noise cipher two peers agree on, over real loopback connections.

Ours (``/swarmtrain/noise-aesgcm/2.0.0``) between our peers; libp2p's ``/noise`` with
anyone who does not speak it (the interop tests check go-libp2p and py-libp2p), and a
clear error when the two sides share none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from peers import DialError, Peer, PeerConfig
from peers.echo import ECHO_PROTOCOL_ID, ECHO_STREAM_PROTOCOL_ID, install_echo
from peers.noise import AESGCM_NOISE, CHACHAPOLY_NOISE, NOISE_CIPHERS

WAIT_SECONDS = 10.0


@contextlib.asynccontextmanager
async def pair(
    dialer_ciphers: tuple[str, ...], listener_ciphers: tuple[str, ...]
) -> AsyncIterator[tuple[Peer, Peer]]:
    async with (
        Peer(PeerConfig(noise_ciphers=dialer_ciphers)) as dialer,
        Peer(PeerConfig(noise_ciphers=listener_ciphers)) as listener,
    ):
        install_echo(listener)
        yield dialer, listener


async def security_of(dialer: Peer, listener: Peer) -> tuple[str, str]:
    """Connect; the protocol as each side recorded it."""
    async with asyncio.timeout(WAIT_SECONDS):
        await dialer.connect(listener.listen_addrs[0])
        ours = dialer.connection_to(listener.peer_id)
        for _ in range(100):  # the listener registers its side a moment later
            theirs = listener.connection_to(dialer.peer_id)
            if theirs is not None:
                break
            await asyncio.sleep(0.01)
    assert ours is not None and theirs is not None
    return ours.security_protocol, theirs.security_protocol


async def round_trip(dialer: Peer, listener: Peer) -> None:
    """A unary call and a multi-frame stream of arrays, byte-exact both ways."""
    async with asyncio.timeout(WAIT_SECONDS):
        reply = await dialer.call_unary(listener.peer_id, ECHO_PROTOCOL_ID, "hello", str)
        assert reply == "hello"
        arrays = [np.frombuffer(os.urandom(300_000), dtype=np.uint8) for _ in range(3)]

        async def requests() -> AsyncIterator[np.ndarray]:
            for array in arrays:
                yield array

        replies = dialer.call_stream(
            listener.peer_id, ECHO_STREAM_PROTOCOL_ID, requests(), np.ndarray
        )
        echoed = [array async for array in replies]
    assert len(echoed) == len(arrays)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, echoed, strict=True))


@pytest.mark.parametrize(
    ("dialer_ciphers", "listener_ciphers", "expected"),
    [
        (("AESGCM", "ChaChaPoly"), ("AESGCM", "ChaChaPoly"), AESGCM_NOISE.protocol_id),
        # the dialer's order decides, not the listener's
        (("AESGCM", "ChaChaPoly"), ("ChaChaPoly", "AESGCM"), AESGCM_NOISE.protocol_id),
        (("ChaChaPoly", "AESGCM"), ("AESGCM", "ChaChaPoly"), CHACHAPOLY_NOISE.protocol_id),
        # a listener without ours answers na, and the dialer falls back to /noise
        (("AESGCM", "ChaChaPoly"), ("ChaChaPoly",), CHACHAPOLY_NOISE.protocol_id),
        (("ChaChaPoly",), ("AESGCM", "ChaChaPoly"), CHACHAPOLY_NOISE.protocol_id),
        (("AESGCM",), ("AESGCM",), AESGCM_NOISE.protocol_id),
    ],
)
def test_peers_agree_on_a_cipher_and_carry_traffic(
    dialer_ciphers: tuple[str, ...], listener_ciphers: tuple[str, ...], expected: str
) -> None:
    async def main() -> None:
        async with pair(dialer_ciphers, listener_ciphers) as (dialer, listener):
            assert await security_of(dialer, listener) == (expected, expected)
            await round_trip(dialer, listener)

    asyncio.run(main())


def test_no_common_cipher_is_a_clear_error_and_the_listener_keeps_serving() -> None:
    async def main() -> None:
        async with pair(("AESGCM",), ("ChaChaPoly",)) as (dialer, listener):
            with pytest.raises(DialError, match=r"none of our Noise ciphers: .*/swarmtrain/"):
                async with asyncio.timeout(WAIT_SECONDS):
                    await dialer.connect(listener.listen_addrs[0])
            assert dialer.connection_to(listener.peer_id) is None
            # the listener counted a failed handshake, and serves the next peer as usual
            async with Peer() as honest:
                assert await security_of(honest, listener) == (CHACHAPOLY_NOISE.protocol_id,) * 2
                await round_trip(honest, listener)
            assert listener.statistics().num_handshake_failures == 1

    asyncio.run(main())


@pytest.mark.parametrize(
    "ciphers",
    [(), ("AES",), ("AESGCM", "AESGCM"), ("chachapoly",), "ChaChaPoly", ["AESGCM"], (1,)],
    ids=repr,
)
def test_config_refuses_bad_cipher_lists(ciphers: object) -> None:
    with pytest.raises(ValueError, match="noise_ciphers must be a non-empty tuple"):
        PeerConfig(noise_ciphers=ciphers)  # type: ignore[arg-type]


def test_traffic_crosses_many_rekeys_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both directions of a real connection rekey in step (every 8 messages here,
    2^20 normally), through the handshake, unary calls and a multi-frame stream."""
    fast = dataclasses.replace(AESGCM_NOISE, rekey_every=8)
    monkeypatch.setitem(NOISE_CIPHERS, "AESGCM", fast)

    async def main() -> None:
        async with pair(("AESGCM",), ("AESGCM",)) as (dialer, listener):
            assert await security_of(dialer, listener) == (AESGCM_NOISE.protocol_id,) * 2
            for _ in range(4):
                await round_trip(dialer, listener)
            conn = dialer.connection_to(listener.peer_id)
            assert conn is not None and not conn.is_closed
            # each direction went through several keys (the sent counts as the nonces)
            noise: Any = conn._transport
            assert noise._send.nonce > 3 * 8 and noise._receive.nonce > 3 * 8

    asyncio.run(main())
