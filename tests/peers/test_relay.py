"""Circuit relay v2 and AutoNAT on loopback: reservations, relayed connections, limits,
and hostile input against the relay, the stop handler and the AutoNAT server.

Reachability is forced here (``reachability="private"`` / ``"public"``): on loopback
everyone can dial everyone, so AutoNAT would find every peer public. The NAT lab tests
(tests/peers/test_nat_lab.py) find it out for real.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from multiaddr import Multiaddr

from peers import Peer, PeerConfig, with_peer_id
from peers.autonat.messages import (
    AUTONAT_PROTOCOL_ID,
    MAX_AUTONAT_MESSAGE_BYTES,
    Dial,
    DialResponse,
    ResponseStatus,
    decode_autonat_message,
    encode_autonat_message,
)
from peers.connection import Stream
from peers.delimited import encode_delimited, read_delimited
from peers.errors import ConnectionClosed, DialError
from peers.identity import KeyPair
from peers.relay.client import ReservationError, reserve
from peers.relay.messages import (
    HOP_PROTOCOL_ID,
    MAX_CIRCUIT_MESSAGE_BYTES,
    STOP_PROTOCOL_ID,
    HopMessage,
    HopType,
    PeerInfo,
    Status,
    StopMessage,
    StopType,
    decode_hop_message,
    decode_stop_message,
    encode_hop_message,
    encode_stop_message,
)
from peers.relay.resources import RelayResourceConfig

WAIT_SECONDS = 10.0

Run = Callable[[Coroutine[Any, Any, Any]], Any]


async def wait_for(condition: Callable[[], object], what: str, peer: Peer) -> None:
    """Wait, bounded, until ``condition()`` holds, re-checked whenever ``peer``'s
    connections, relays or relay service change."""
    async with asyncio.timeout(WAIT_SECONDS):
        while not condition():
            await peer.nat.wait_changed()
    assert condition(), what


def relay_config(**limits: int) -> PeerConfig:
    return PeerConfig(
        reachability="public", relay_limits=RelayResourceConfig(**limits) if limits else None
    )


async def reserved(private: Peer, relay: Peer) -> Multiaddr:
    await private.connect(relay.listen_addrs[0])
    await wait_for(lambda: private.circuit_addrs, "a reservation on the relay", private)
    return private.circuit_addrs[0]


async def hop_request(peer: Peer, relay: Peer, raw: bytes) -> HopMessage:
    stream = await peer.new_stream(relay.listen_addrs[0], HOP_PROTOCOL_ID)
    await stream.write(raw)
    return decode_hop_message(await read_delimited(stream, MAX_CIRCUIT_MESSAGE_BYTES))


@contextlib.asynccontextmanager
async def trio() -> AsyncIterator[tuple[Peer, Peer, Peer]]:
    """A public relay, a private peer, and a third peer (client of both)."""
    async with (
        Peer(relay_config()) as relay,
        Peer(PeerConfig(reachability="private")) as private,
        Peer() as other,
    ):
        yield relay, private, other


def test_private_peer_reserves_and_announces_a_circuit_address(arun: Run) -> None:
    arun(_test_private_peer_reserves_and_announces_a_circuit_address())


async def _test_private_peer_reserves_and_announces_a_circuit_address() -> None:
    async with trio() as trio_peers:
        relay, private, _ = trio_peers
        addr = await reserved(private, relay)
        assert private.listen_addrs == []  # nothing direct is announced when private
        assert str(addr).startswith(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/")
        assert relay.nat.relay_service is not None
        assert relay.nat.relay_service.statistics().num_reservations == 1
        assert private.nat.relays == [relay.peer_id]


def test_dial_through_the_relay_carries_streams(arun: Run) -> None:
    arun(_test_dial_through_the_relay_carries_streams())


async def _test_dial_through_the_relay_carries_streams() -> None:
    async with trio() as trio_peers:
        relay, private, other = trio_peers
        addr = await reserved(private, relay)

        async def echo(stream: Stream) -> None:
            while data := await stream.read():
                await stream.write(data)
            await stream.close()

        private.set_stream_handler("/test/echo", echo)
        assert await other.connect(addr) == private.peer_id
        conn = other.connection_to(private.peer_id)
        assert conn is not None and conn.relayed
        assert other.statistics().num_relayed_connections == 1  # of its 2 (the relay's)
        assert other.statistics().num_connections == 2
        payload = bytes(range(256)) * 4096  # 1 MiB: many frames through the bridge and splice
        stream = await other.new_stream(private.peer_id, "/test/echo")
        await stream.write(payload)
        await stream.close()
        received = b""
        while data := await stream.read():
            received += data
        assert received == payload
        # The private side sees the dialer through the same relay, authenticated.
        back = private.connection_to(other.peer_id)
        assert back is not None and back.relayed
        assert "/p2p-circuit" in str(back.remote_address)


def test_relayed_connection_is_reset_at_its_data_limit(arun: Run) -> None:
    arun(_test_relayed_connection_is_reset_at_its_data_limit())


async def _test_relayed_connection_is_reset_at_its_data_limit() -> None:
    limit = 256 * 1024
    async with (
        Peer(relay_config(circuit_data_bytes=limit)) as relay,
        Peer(PeerConfig(reachability="private")) as private,
        Peer() as other,
    ):
        addr = await reserved(private, relay)
        received = [0]

        async def sink(stream: Stream) -> None:
            while data := await stream.read():
                received[0] += len(data)

        private.set_stream_handler("/test/sink", sink)
        await other.connect(addr)
        stream = await other.new_stream(private.peer_id, "/test/sink")
        with pytest.raises(ConnectionClosed):
            async with asyncio.timeout(WAIT_SECONDS):
                for _ in range(64):  # 4 MiB offered against a 256 KiB limit
                    await stream.write(b"x" * 65536)
                await stream.read()
        await wait_for(lambda: other.connection_to(private.peer_id) is None, "the reset", other)
        await wait_for(lambda: private.connection_to(other.peer_id) is None, "the far end", private)
        assert received[0] < limit  # the connection broke before the limit was passed
        assert relay.nat.relay_service is not None
        assert relay.nat.relay_service.statistics().num_circuits == 0
        # The relay and the reservation survive: a new circuit works.
        await other.connect(addr)
        assert await other.ping(private.peer_id) > 0


def test_connect_to_a_peer_without_a_reservation_is_refused(arun: Run) -> None:
    arun(_test_connect_to_a_peer_without_a_reservation_is_refused())


async def _test_connect_to_a_peer_without_a_reservation_is_refused() -> None:
    async with trio() as trio_peers:
        relay, private, other = trio_peers
        await other.connect(relay.listen_addrs[0])
        answer = await hop_request(
            other,
            relay,
            encode_delimited(
                encode_hop_message(HopMessage(type=HopType.CONNECT, peer=PeerInfo(private.peer_id)))
            ),
        )
        assert answer.type == HopType.STATUS and answer.status == Status.NO_RESERVATION
        circuit = Multiaddr(f"{relay.listen_addrs[0]}/p2p-circuit/p2p/{private.peer_id}")
        with pytest.raises(DialError, match="NO_RESERVATION"):
            await other.connect(circuit)
        assert await other.ping(relay.peer_id) > 0  # the relay keeps serving


@pytest.mark.parametrize(
    "raw",
    [
        encode_delimited(b"\xff\xff\xff"),  # not protobuf
        encode_delimited(b"\x08\x01"),  # a CONNECT without its peer
        encode_delimited(b"\x08\x07"),  # an unknown type
    ],
    ids=["garbage", "connect-without-peer", "unknown-type"],
)
def test_malformed_hop_messages_get_malformed_message(arun: Run, raw: bytes) -> None:
    arun(_test_malformed_hop_messages_get_malformed_message(raw))


async def _test_malformed_hop_messages_get_malformed_message(raw: bytes) -> None:
    async with trio() as trio_peers:
        relay, _, other = trio_peers
        answer = await hop_request(other, relay, raw)
        assert answer.status == Status.MALFORMED_MESSAGE
        assert await other.ping(relay.peer_id) > 0


def test_oversized_hop_message_is_refused(arun: Run) -> None:
    arun(_test_oversized_hop_message_is_refused())


async def _test_oversized_hop_message_is_refused() -> None:
    async with trio() as trio_peers:
        relay, _, other = trio_peers
        raw = encode_delimited(b"\x00" * (MAX_CIRCUIT_MESSAGE_BYTES + 1))
        answer = await hop_request(other, relay, raw)
        assert answer.status == Status.MALFORMED_MESSAGE
        assert await other.ping(relay.peer_id) > 0


def test_reservations_per_ip_are_limited(arun: Run) -> None:
    arun(_test_reservations_per_ip_are_limited())


async def _test_reservations_per_ip_are_limited() -> None:
    async with Peer(relay_config(max_reservations_per_ip=2)) as relay:
        peers = [Peer(PeerConfig(reachability="private", use_relays=False)) for _ in range(3)]
        async with peers[0], peers[1], peers[2]:
            for p in peers:
                await p.connect(relay.listen_addrs[0])
            await reserve(peers[0], relay.peer_id)
            await reserve(peers[1], relay.peer_id)
            with pytest.raises(ReservationError) as refused:
                await reserve(peers[2], relay.peer_id)
            assert refused.value.status == Status.RESERVATION_REFUSED
            # A refresh by a holder is not a new slot.
            await reserve(peers[0], relay.peer_id)
            assert relay.nat.relay_service is not None
            assert relay.nat.relay_service.statistics().num_reservations == 2
            # A closed connection frees its slot.
            relay.disconnect(peers[1].peer_id)
            await wait_for(
                lambda: (
                    relay.nat.relay_service is not None
                    and relay.nat.relay_service.statistics().num_reservations == 1
                ),
                "the slot of a closed connection freed",
                relay,
            )
            await peers[2].connect(relay.listen_addrs[0])
            await reserve(peers[2], relay.peer_id)


def test_reservation_needs_a_relay_that_serves(arun: Run) -> None:
    arun(_test_reservation_needs_a_relay_that_serves())


async def _test_reservation_needs_a_relay_that_serves() -> None:
    async with trio() as trio_peers:
        _, private, other = trio_peers  # ``other`` is not public: it refuses to relay
        async with Peer(PeerConfig(reachability="private")) as not_a_relay:
            await private.connect(with_peer_id(not_a_relay.bound_addrs()[0], not_a_relay.peer_id))
            with pytest.raises(ReservationError) as refused:
                await reserve(private, not_a_relay.peer_id)
            assert refused.value.status == Status.PERMISSION_DENIED
        del other


def test_stop_from_a_peer_we_did_not_reserve_with_is_denied(arun: Run) -> None:
    arun(_test_stop_from_a_peer_we_did_not_reserve_with_is_denied())


async def _test_stop_from_a_peer_we_did_not_reserve_with_is_denied() -> None:
    async with trio() as trio_peers:
        _, private, other = trio_peers
        stream = await other.new_stream(
            private.listen_addrs[0] if private.listen_addrs else private.bound_addrs()[0],
            STOP_PROTOCOL_ID,
        )
        request = StopMessage(type=StopType.CONNECT, peer=PeerInfo(KeyPair.generate().peer_id))
        await stream.write(encode_delimited(encode_stop_message(request)))
        answer = decode_stop_message(await read_delimited(stream, MAX_CIRCUIT_MESSAGE_BYTES))
        assert answer.status == Status.PERMISSION_DENIED
        assert await other.ping(private.peer_id) > 0


async def autonat_ask(peer: Peer, server: Peer, dial: Dial | bytes) -> DialResponse:
    stream = await peer.new_stream(server.listen_addrs[0], AUTONAT_PROTOCOL_ID)
    raw = dial if isinstance(dial, bytes) else encode_autonat_message(dial)
    await stream.write(encode_delimited(raw))
    answer = decode_autonat_message(await read_delimited(stream, MAX_AUTONAT_MESSAGE_BYTES))
    assert isinstance(answer, DialResponse)
    return answer


def test_autonat_dials_back_the_requester(arun: Run) -> None:
    arun(_test_autonat_dials_back_the_requester())


async def _test_autonat_dials_back_the_requester() -> None:
    async with Peer(relay_config()) as server, Peer() as client:
        answer = await autonat_ask(
            server=server, peer=client, dial=Dial(client.peer_id, tuple(client.bound_addrs()))
        )
        assert answer.status == ResponseStatus.OK
        assert answer.addr == client.bound_addrs()[0]


def test_autonat_refuses_a_third_partys_address(arun: Run) -> None:
    arun(_test_autonat_refuses_a_third_partys_address())


async def _test_autonat_refuses_a_third_partys_address() -> None:
    async with Peer(relay_config()) as server, Peer() as client:
        third = Multiaddr("/ip4/198.51.100.7/tcp/4001")
        answer = await autonat_ask(client, server, Dial(client.peer_id, (third,)))
        assert answer.status == ResponseStatus.E_DIAL_REFUSED
        assert server.nat.autonat_server.num_dial_backs == 0  # it dialed nobody


def test_autonat_refuses_a_request_for_another_peer_and_garbage(arun: Run) -> None:
    arun(_test_autonat_refuses_a_request_for_another_peer_and_garbage())


async def _test_autonat_refuses_a_request_for_another_peer_and_garbage() -> None:
    async with Peer(relay_config()) as server, Peer() as client:
        other = KeyPair.generate().peer_id
        answer = await autonat_ask(client, server, Dial(other, tuple(client.bound_addrs())))
        assert answer.status == ResponseStatus.E_BAD_REQUEST
        answer = await autonat_ask(client, server, b"\xff\x01")
        assert answer.status == ResponseStatus.E_BAD_REQUEST
        assert await client.ping(server.peer_id) > 0


def test_autonat_reports_a_dial_error_for_an_address_nobody_listens_on(arun: Run) -> None:
    arun(_test_autonat_reports_a_dial_error_for_an_address_nobody_listens_on())


async def _test_autonat_reports_a_dial_error_for_an_address_nobody_listens_on() -> None:
    async with Peer(relay_config()) as server, Peer() as client:
        dead = Multiaddr("/ip4/127.0.0.1/tcp/9")  # discard: nobody listens here
        answer = await autonat_ask(client, server, Dial(client.peer_id, (dead,)))
        assert answer.status == ResponseStatus.E_DIAL_ERROR


def test_malformed_stop_message_is_refused(arun: Run) -> None:
    async def main() -> None:
        async with trio() as (_, private, other):
            stream = await other.new_stream(
                with_peer_id(private.bound_addrs()[0], private.peer_id), STOP_PROTOCOL_ID
            )
            await stream.write(encode_delimited(b"\xff\xff"))
            answer = decode_stop_message(await read_delimited(stream, MAX_CIRCUIT_MESSAGE_BYTES))
            assert answer.status == Status.MALFORMED_MESSAGE
            assert await other.ping(private.peer_id) > 0

    arun(main())


def test_malformed_dcutr_message_resets_only_its_stream(arun: Run) -> None:
    from peers.dcutr.messages import DCUTR_PROTOCOL_ID

    async def main() -> None:
        async with trio() as (relay, private, other):
            addr = await reserved(private, relay)
            await other.connect(addr)  # a relayed connection, where DCUtR is served
            conn = other.connection_to(private.peer_id)
            assert conn is not None and conn.relayed
            stream = await other.new_stream(private.peer_id, DCUTR_PROTOCOL_ID)
            await stream.write(encode_delimited(b"\x08"))  # a truncated varint field
            with pytest.raises(ConnectionClosed):
                async with asyncio.timeout(WAIT_SECONDS):
                    while await stream.read():
                        pass
            assert await other.ping(private.peer_id) > 0

    arun(main())


def test_a_voucher_for_another_peer_is_refused(arun: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    import peers.relay.hop as hop
    from peers.relay.voucher import make_voucher

    stranger = KeyPair.generate().peer_id

    def wrong_voucher(keypair: KeyPair, peer: object, expiration: int) -> bytes:
        return make_voucher(keypair, stranger, expiration)

    monkeypatch.setattr(hop, "make_voucher", wrong_voucher)

    async def main() -> None:
        async with (
            Peer(relay_config()) as relay,
            Peer(PeerConfig(reachability="private", use_relays=False)) as private,
        ):
            await private.connect(relay.listen_addrs[0])
            with pytest.raises(ReservationError, match="bad voucher"):
                await reserve(private, relay.peer_id)
            assert private.circuit_addrs == []

    arun(main())
