"""The client side of circuit relay v2: reserving a slot on a relay, dialing through one.

libp2p specs, relay/circuit-v2.md: a peer that cannot be dialed sends ``RESERVE`` on a
``hop`` stream to a relay it is connected to; the relay answers with a reservation
(when it ends, the relay's addresses, a signed voucher). Anyone may then reach it at
``RELAY_ADDR/p2p/RELAY/p2p-circuit/p2p/PEER``: the dialer sends ``CONNECT`` on a hop
stream, the relay opens a ``stop`` stream to the peer, and once both answer OK the hop
stream carries a whole libp2p connection (see :mod:`peers.stream_socket`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multiaddr import Multiaddr

from peers.addresses import split_peer_id
from peers.connection import Stream
from peers.delimited import encode_delimited, read_delimited
from peers.errors import ConnectionClosed, DialError, PeersError, ProtocolNotSupported
from peers.identity import PeerID
from peers.relay.messages import (
    HOP_PROTOCOL_ID,
    MAX_CIRCUIT_MESSAGE_BYTES,
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayProtocolError,
    Status,
    decode_hop_message,
    encode_hop_message,
)
from peers.relay.voucher import verify_voucher

if TYPE_CHECKING:
    from peers.host import Peer


class ReservationError(DialError):
    """A relay refused or botched a reservation; ``status`` is its answer, if any."""

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class ReservationInfo:
    """A reservation a relay granted us, its voucher verified."""

    relay: PeerID
    #: When it ends, Unix seconds; renew before then.
    expire_unix_seconds: int
    #: Our addresses through this relay: ``RELAY_ADDR/p2p/RELAY/p2p-circuit``.
    circuit_addrs: tuple[Multiaddr, ...]
    #: The relay's limit on each relayed connection (``None``: it sets none).
    limit: Limit | None


async def _hop_exchange(
    peer: Peer, relay: PeerID | Multiaddr, request: HopMessage
) -> tuple[Stream, HopMessage]:
    try:
        stream = await peer.new_stream(relay, HOP_PROTOCOL_ID)
        await stream.write(encode_delimited(encode_hop_message(request)))
        answer = decode_hop_message(await read_delimited(stream, MAX_CIRCUIT_MESSAGE_BYTES))
    except ProtocolNotSupported as e:
        raise DialError(f"{relay} is not a relay: {e}") from e
    except (ConnectionClosed, PeersError) as e:
        if isinstance(e, DialError):
            raise
        raise DialError(f"relay {relay} failed the hop exchange: {e}") from e
    if answer.type != HopType.STATUS:
        stream.reset()
        raise DialError(f"relay {relay} answered with {answer.type.name}, not STATUS")
    return stream, answer


async def open_circuit(peer: Peer, relay_addr: Multiaddr, destination: PeerID) -> Stream:
    """A hop stream through the relay at ``relay_addr`` (ending in ``/p2p/RELAY``) to
    ``destination``, accepted by both: the caller runs the connection upgrade on it.

    Raises :class:`DialError` if the relay cannot be reached or refuses (the message
    names its status: ``NO_RESERVATION`` when the destination holds no slot there).
    The caller bounds the wait.
    """
    _, relay = split_peer_id(relay_addr)
    target: PeerID | Multiaddr = relay_addr
    if relay is not None and peer.connection_to(relay) is not None:
        target = relay
    request = HopMessage(type=HopType.CONNECT, peer=PeerInfo(destination))
    stream, answer = await _hop_exchange(peer, target, request)
    if answer.status != Status.OK:
        stream.reset()
        status = answer.status.name if answer.status is not None else "no status"
        raise DialError(f"relay {relay} could not connect us to {destination}: {status}")
    return stream


async def reserve(peer: Peer, relay: PeerID) -> ReservationInfo:
    """Reserve a slot on ``relay`` (we must be connected to it directly) and verify the
    voucher. Raises :class:`ReservationError` with the relay's status if it refuses or
    the reservation is malformed; the caller bounds the wait."""
    conn = peer.connection_to(relay)
    if conn is None or conn.relayed:
        raise ReservationError(f"a reservation needs a direct connection to {relay}")
    stream, answer = await _hop_exchange(peer, relay, HopMessage(type=HopType.RESERVE))
    with contextlib.suppress(ConnectionClosed):
        await stream.close()
    if answer.status != Status.OK:
        raise ReservationError(
            f"relay {relay} refused a reservation: "
            + (answer.status.name if answer.status is not None else "no status"),
            answer.status,
        )
    reservation = answer.reservation
    if reservation is None:
        raise ReservationError(f"relay {relay} said OK without a reservation")
    if reservation.voucher is not None:
        try:
            verify_voucher(reservation.voucher, relay=relay, peer=peer.peer_id, now=time.time())
        except RelayProtocolError as e:
            raise ReservationError(f"relay {relay} sent a bad voucher: {e}") from e
    circuit_addrs: list[Multiaddr] = []
    for addr in reservation.addrs:
        transport, named = split_peer_id(addr)
        if named is not None and named != relay:
            continue  # an address of somebody else's
        circuit_addrs.append(Multiaddr(f"{transport}/p2p/{relay}/p2p-circuit"))
    if not circuit_addrs and conn.remote_address is not None:
        circuit_addrs.append(Multiaddr(f"{conn.remote_address}/p2p/{relay}/p2p-circuit"))
    return ReservationInfo(
        relay=relay,
        expire_unix_seconds=reservation.expire_unix_seconds,
        circuit_addrs=tuple(circuit_addrs),
        limit=answer.limit,
    )
