"""Upgrading a raw TCP connection: multistream-select -> Noise XX -> multistream-select -> yamux.

As the libp2p connections spec describes it. The pure machines (multistream, Noise)
decide; this module only reads and writes the socket, inside the caller's deadline.
The first multistream-select picks the Noise cipher: the dialer proposes its ciphers in
its order of preference (ours first, libp2p's ``/noise`` after it), the listener takes
the first it also speaks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from peers.errors import HandshakeError, ProtocolNotSupported
from peers.identity import KeyPair, PeerID, PublicKey
from peers.multistream import MultistreamDialer, MultistreamListener
from peers.noise import NOISE_CIPHERS, NoiseCipher, NoiseHandshake, NoiseStaticKey, NoiseTransport
from peers.yamux import YAMUX_PROTOCOL_ID

#: Bytes read from the socket per step of the handshake.
_HANDSHAKE_READ_BYTES = 64 * 1024


@dataclass(slots=True)
class UpgradedConnection:
    transport: NoiseTransport
    #: The Noise cipher the two sides agreed on.
    cipher: NoiseCipher
    remote_peer_id: PeerID
    remote_public_key: PublicKey
    #: yamux bytes the remote sent right behind the muxer negotiation.
    leftover_plaintext: bytes


class _Source:
    """A reader with a push-back buffer for bytes read past a negotiation."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader
        self._pending = b""

    async def read_some(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        data = await self._reader.read(_HANDSHAKE_READ_BYTES)
        if not data:
            raise HandshakeError("connection closed during the handshake")
        return data

    async def readexactly(self, num_bytes: int) -> bytes:
        data = self._pending[:num_bytes]
        self._pending = self._pending[num_bytes:]
        if len(data) < num_bytes:
            try:
                data += await self._reader.readexactly(num_bytes - len(data))
            except asyncio.IncompleteReadError as e:
                raise HandshakeError("connection closed during the handshake") from e
        return data

    def take_pending(self) -> bytes:
        data, self._pending = self._pending, b""
        return data

    def push_back(self, data: bytes) -> None:
        self._pending = data + self._pending


async def _negotiate_plain(
    source: _Source, writer: asyncio.StreamWriter, outbound: bool, protocols: list[str]
) -> str:
    """The protocol agreed on: the first of ``protocols`` the listener speaks."""
    machine = MultistreamDialer(protocols) if outbound else MultistreamListener(set(protocols))
    writer.write(machine.initial_bytes())
    while machine.selected is None:
        reply = machine.receive_data(await source.read_some())
        if reply:
            writer.write(reply)
    source.push_back(machine.leftover)
    await writer.drain()
    return machine.selected


async def _noise_handshake(
    source: _Source,
    writer: asyncio.StreamWriter,
    identity: KeyPair,
    static: NoiseStaticKey | None,
    outbound: bool,
    expected_peer_id: PeerID | None,
    cipher: NoiseCipher,
) -> NoiseHandshake:
    handshake = NoiseHandshake(
        initiator=outbound,
        identity=identity,
        static=static,
        expected_peer_id=expected_peer_id,
        cipher=cipher,
    )
    while not handshake.is_complete:
        if handshake.our_turn:
            writer.write(handshake.write_message())
            await writer.drain()
        else:
            length = int.from_bytes(await source.readexactly(2), "big")
            handshake.read_message(await source.readexactly(length))
    return handshake


async def upgrade(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    identity: KeyPair,
    outbound: bool,
    expected_peer_id: PeerID | None = None,
    ciphers: Sequence[NoiseCipher] = tuple(NOISE_CIPHERS.values()),
    static: NoiseStaticKey | None = None,
) -> UpgradedConnection:
    """Run the whole upgrade; the caller bounds it with a timeout. ``ciphers``: the Noise
    ciphers we speak, in our order of preference (it decides when we dial). ``static``:
    ``identity``'s long-term Noise static key; a fresh one for this connection if ``None``.

    Raises :class:`HandshakeError` (or its subclass ``PeerIDMismatch``) when the remote
    misbehaves, is someone else, or offers neither Noise nor yamux.
    """
    by_id = {cipher.protocol_id: cipher for cipher in ciphers}
    if not by_id:
        raise ValueError("upgrade needs at least one Noise cipher")
    source = _Source(reader)
    try:
        selected = await _negotiate_plain(source, writer, outbound, list(by_id))
    except ProtocolNotSupported as e:
        raise HandshakeError(f"remote speaks none of our Noise ciphers: {e}") from e
    cipher = by_id[selected]
    handshake = await _noise_handshake(
        source, writer, identity, static, outbound, expected_peer_id, cipher
    )
    transport = handshake.to_transport()
    # Bytes the remote sent right after its last handshake message are transport frames.
    pending = source.take_pending()
    first_plain = transport.receive_data(pending) if pending else b""
    try:
        leftover = await _negotiate_muxer(source, writer, transport, outbound, first_plain)
    except ProtocolNotSupported as e:
        raise HandshakeError(f"remote does not speak yamux: {e}") from e
    return UpgradedConnection(
        transport=transport,
        cipher=cipher,
        remote_peer_id=handshake.remote_peer_id,
        remote_public_key=handshake.remote_public_key,
        leftover_plaintext=leftover,
    )


async def _negotiate_muxer(
    source: _Source,
    writer: asyncio.StreamWriter,
    transport: NoiseTransport,
    outbound: bool,
    first_plaintext: bytes,
) -> bytes:
    machine: MultistreamDialer | MultistreamListener
    if outbound:
        machine = MultistreamDialer([YAMUX_PROTOCOL_ID])
    else:
        machine = MultistreamListener({YAMUX_PROTOCOL_ID})
    writer.write(transport.encrypt(machine.initial_bytes()))
    plaintext = first_plaintext
    while True:
        if plaintext:
            reply = machine.receive_data(plaintext)
            if reply:
                writer.write(transport.encrypt(reply))
        if machine.selected is not None:
            break
        plaintext = transport.receive_data(await source.read_some())
    await writer.drain()
    return machine.leftover
