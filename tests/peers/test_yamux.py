"""Tests for the sans-I/O yamux session: two sessions wired back to back, plus raw frames."""

from __future__ import annotations

import array
import os
import random
import struct

import pytest

from peers.errors import LocalProtocolError, PeersError, RemoteProtocolError
from peers.yamux import (
    GO_AWAY_NORMAL,
    GO_AWAY_PROTOCOL_ERROR,
    INITIAL_WINDOW_BYTES,
    MAX_FRAME_PAYLOAD_BYTES,
    MAX_OWED_ACKS,
    MAX_QUEUED_REPLIES,
    WARM_AFTER_BYTES,
    YAMUX_PROTOCOL_ID,
    DataReceived,
    GoAwayReceived,
    PingReceived,
    PongReceived,
    SendWindowUpdated,
    StreamEnded,
    StreamOpened,
    StreamRejected,
    StreamReset,
    YamuxError,
    YamuxEvent,
    YamuxProtocolError,
    YamuxSession,
    YamuxStreamError,
)

DATA, WINDOW_UPDATE, PING, GO_AWAY = 0, 1, 2, 3
SYN, ACK, FIN, RST = 1, 2, 4, 8


def frame(
    kind: int, flags: int, stream_id: int, length: int, body: bytes = b"", version: int = 0
) -> bytes:
    """A frame laid out by hand from spec.md "Framing", independent of the module's struct."""
    return (
        bytes([version, kind])
        + flags.to_bytes(2, "big")
        + stream_id.to_bytes(4, "big")
        + length.to_bytes(4, "big")
        + body
    )


def pump(a: YamuxSession, b: YamuxSession) -> tuple[list[YamuxEvent], list[YamuxEvent]]:
    """Move bytes both ways until both are quiet; return the events a saw and b saw."""
    events_a: list[YamuxEvent] = []
    events_b: list[YamuxEvent] = []
    while True:
        out_a, out_b = a.data_to_send(), b.data_to_send()
        if not out_a and not out_b:
            return events_a, events_b
        events_b += b.receive_data(out_a)
        events_a += a.receive_data(out_b)


def pair(**server_kwargs: int) -> tuple[YamuxSession, YamuxSession]:
    return YamuxSession(is_client=True), YamuxSession(is_client=False, **server_kwargs)


def collect(events: list[YamuxEvent]) -> dict[int, bytes]:
    got: dict[int, bytearray] = {}
    for event in events:
        if isinstance(event, DataReceived):
            got.setdefault(event.stream_id, bytearray()).extend(event.data)
    return {k: bytes(v) for k, v in got.items()}


def test_protocol_id() -> None:
    assert YAMUX_PROTOCOL_ID == "/yamux/1.0.0"


def test_header_bytes_match_spec_layout() -> None:
    client = YamuxSession(is_client=True)
    stream_id = client.open_stream()
    assert stream_id == 1
    # version 0, type 1 (window update), flags 0x0001 (SYN), stream 1, delta 0
    assert client.data_to_send() == bytes.fromhex("00 01 0001 00000001 00000000")
    client.send_data(stream_id, b"hello")
    assert client.data_to_send() == bytes.fromhex("00 00 0000 00000001 00000005") + b"hello"
    client.ping(0x01020304)
    assert client.data_to_send() == bytes.fromhex("00 02 0001 00000000 01020304")
    client.go_away(GO_AWAY_NORMAL)
    assert client.data_to_send() == frame(GO_AWAY, 0, 0, 0)


def test_open_streams_both_ways_with_data_both_directions() -> None:
    client, server = pair()
    a = client.open_stream()
    b = server.open_stream()
    assert (a % 2, b % 2) == (1, 0)
    client.send_data(a, b"from client")
    server.send_data(b, b"from server")
    client_events, server_events = pump(client, server)
    assert server_events[:2] == [StreamOpened(a), DataReceived(a, b"from client")]
    assert client_events[:2] == [StreamOpened(b), DataReceived(b, b"from server")]
    client.send_data(b, b"reply to server")
    server.send_data(a, b"reply to client")
    client_events, server_events = pump(client, server)
    assert client_events == [DataReceived(a, b"reply to client")]
    assert server_events == [DataReceived(b, b"reply to server")]


def test_syn_is_acked_just_ahead_of_the_first_frame_sent_on_the_stream() -> None:
    client, server = pair()
    client.open_stream()
    server.receive_data(client.data_to_send())
    assert server.data_to_send() == b""  # nothing goes out for the ACK alone
    server.send_data(1, b"ab")
    server.send_data(1, b"cd")
    ack = frame(WINDOW_UPDATE, ACK, 1, 0)
    assert server.data_to_send() == ack + frame(DATA, 0, 1, 2, b"ab") + frame(DATA, 0, 1, 2, b"cd")
    # A stream closed or reset before any data: the ACK, then the FIN or RST on its own
    # (py-libp2p reads a FIN or RST that carries ACK as a bare ACK).
    for stream_id, act, flag in ((3, server.close_stream, FIN), (5, server.reset_stream, RST)):
        client.open_stream()
        server.receive_data(client.data_to_send())
        act(stream_id)
        assert server.data_to_send() == (
            frame(WINDOW_UPDATE, ACK, stream_id, 0) + frame(WINDOW_UPDATE, flag, stream_id, 0)
        )


def test_past_max_owed_acks_every_owed_ack_goes_at_once() -> None:
    client, server = pair(max_streams=1000)
    ids = [client.open_stream() for _ in range(MAX_OWED_ACKS)]
    server.receive_data(client.data_to_send())
    assert server.data_to_send() == b""
    ids.append(client.open_stream())  # one more than may wait: a go-yamux dialer may block
    server.receive_data(client.data_to_send())
    assert server.data_to_send() == b"".join(frame(WINDOW_UPDATE, ACK, i, 0) for i in ids)


def test_pending_acks_ride_with_any_other_output() -> None:
    client, server = pair()
    a, b = client.open_stream(), client.open_stream()
    server.receive_data(client.data_to_send())
    server.ping(7)  # unrelated output: the owed ACKs go ahead of it
    assert server.data_to_send() == (
        frame(WINDOW_UPDATE, ACK, a, 0) + frame(WINDOW_UPDATE, ACK, b, 0) + frame(PING, SYN, 0, 7)
    )
    server.send_data(a, b"x")  # acknowledged already: no second ACK
    assert server.data_to_send() == frame(DATA, 0, a, 1, b"x")


def test_a_stream_reset_before_our_ack_is_never_acked() -> None:
    client, server = pair()
    a = client.open_stream()
    server.receive_data(client.data_to_send())
    client.reset_stream(a)
    server.receive_data(client.data_to_send())
    server.ping(1)
    assert server.data_to_send() == frame(PING, SYN, 0, 1)


def test_syn_may_come_on_a_data_frame_with_payload() -> None:
    server = YamuxSession(is_client=False)
    events = server.receive_data(frame(DATA, SYN | FIN, 1, 2, b"hi"))
    assert events == [StreamOpened(1), DataReceived(1, b"hi"), StreamEnded(1)]


def test_many_concurrent_streams_keep_their_data_apart() -> None:
    client, server = pair()
    ids = [client.open_stream() for _ in range(10)] + [server.open_stream() for _ in range(10)]
    for i, stream_id in enumerate(ids):
        sender = client if stream_id % 2 else server
        sender.send_data(stream_id, bytes([i]) * (1000 * i + 1))
    client_events, server_events = pump(client, server)
    got = collect(client_events) | collect(server_events)
    assert got == {sid: bytes([i]) * (1000 * i + 1) for i, sid in enumerate(ids)}


def test_bytes_fed_one_at_a_time() -> None:
    client, server = pair()
    a, b = client.open_stream(), client.open_stream()
    client.send_data(a, b"alpha")
    client.send_data(b, b"bravo")
    client.close_stream(a)
    client.ping(9)
    wire = client.data_to_send()
    events: list[YamuxEvent] = []
    for i in range(len(wire)):
        events += server.receive_data(wire[i : i + 1])
    assert events == [
        StreamOpened(a),
        StreamOpened(b),
        *[DataReceived(a, bytes([c])) for c in b"alpha"],
        *[DataReceived(b, bytes([c])) for c in b"bravo"],
        StreamEnded(a),
        PingReceived(9),
    ]


def test_random_fragmentation_reassembles() -> None:
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    client, server = pair()
    payloads = {client.open_stream(): rng.randbytes(rng.randrange(1, 200_000)) for _ in range(5)}
    for stream_id, payload in payloads.items():
        assert client.send_data(stream_id, payload) == len(payload)
        client.close_stream(stream_id)
    wire = client.data_to_send()
    events: list[YamuxEvent] = []
    pos = 0
    while pos < len(wire):
        step = rng.choice([1, 5, 11, 12, 13, rng.randrange(1, 100_000)])
        events += server.receive_data(memoryview(wire)[pos : pos + step])
        pos += step
    assert collect(events) == payloads
    assert [e for e in events if isinstance(e, StreamEnded)] == [StreamEnded(s) for s in payloads]


def test_large_send_is_split_into_bounded_frames() -> None:
    client = YamuxSession(is_client=True)
    stream_id = client.open_stream()
    client.data_to_send()
    assert client.send_data(stream_id, bytes(200_000)) == 200_000
    wire = client.data_to_send()
    lengths = []
    pos = 0
    while pos < len(wire):
        _, kind, _, sid, length = struct.unpack_from(">BBHII", wire, pos)
        assert (kind, sid) == (DATA, stream_id)
        lengths.append(length)
        pos += 12 + length
    assert sum(lengths) == 200_000
    assert max(lengths) <= MAX_FRAME_PAYLOAD_BYTES


def test_send_data_counts_bytes_of_non_byte_memoryviews() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    words = array.array("I", [1, 2, 3])
    assert client.send_data(stream_id, memoryview(words)) == 12
    _, server_events = pump(client, server)
    assert collect(server_events) == {stream_id: words.tobytes()}


def test_sender_blocks_at_initial_window_until_receiver_acknowledges() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    assert client.send_window(stream_id) == INITIAL_WINDOW_BYTES
    assert client.send_data(stream_id, bytes(1024 * 1024)) == INITIAL_WINDOW_BYTES
    assert client.send_data(stream_id, b"more") == 0
    client_events, server_events = pump(client, server)
    assert sum(len(e.data) for e in server_events if isinstance(e, DataReceived)) == 256 * 1024
    assert client_events == []
    # Less than half the window consumed: no update yet.
    server.acknowledge_received(stream_id, INITIAL_WINDOW_BYTES // 2 - 1)
    assert server.data_to_send() == b""
    server.acknowledge_received(stream_id, 1)
    client_events, _ = pump(client, server)
    assert client_events == [SendWindowUpdated(stream_id)]
    assert client.send_window(stream_id) == INITIAL_WINDOW_BYTES // 2
    assert client.send_data(stream_id, bytes(1024 * 1024)) == INITIAL_WINDOW_BYTES // 2


def test_data_beyond_window_is_rejected_before_its_body_arrives() -> None:
    server = YamuxSession(is_client=False)
    server.receive_data(frame(WINDOW_UPDATE, SYN, 1, 0))
    with pytest.raises(YamuxProtocolError, match="window"):
        server.receive_data(frame(DATA, 0, 1, 0xFFFF_FFFF))  # header only, no body


def transfer(client: YamuxSession, server: YamuxSession, stream_id: int, total: int) -> int:
    """Send ``total`` bytes client->server, acknowledging promptly; return the largest window."""
    sent = largest = 0
    while sent < total:
        largest = max(largest, client.send_window(stream_id))
        sent += client.send_data(stream_id, bytes(min(total - sent, 1 << 20)))
        _, server_events = pump(client, server)
        for event in server_events:
            if isinstance(event, DataReceived):
                server.acknowledge_received(stream_id, len(event.data))
        pump(client, server)
    return largest


def test_window_grows_when_consumer_drains_whole_windows_and_is_capped() -> None:
    client, server = pair(max_window_bytes=2 * 1024 * 1024)
    stream_id = client.open_stream()
    largest = transfer(client, server, stream_id, 16 * 1024 * 1024)
    assert 3 * 1024 * 1024 // 2 < largest <= 2 * 1024 * 1024
    assert server.statistics().window_growth_bytes == 2 * 1024 * 1024 - INITIAL_WINDOW_BYTES


def test_window_growth_is_bounded_per_session() -> None:
    client, server = pair(max_window_growth_bytes=INITIAL_WINDOW_BYTES)
    first, second = client.open_stream(), client.open_stream()
    assert transfer(client, server, first, 8 * 1024 * 1024) > INITIAL_WINDOW_BYTES
    assert server.statistics().window_growth_bytes == INITIAL_WINDOW_BYTES
    assert transfer(client, server, second, 8 * 1024 * 1024) <= INITIAL_WINDOW_BYTES
    assert server.statistics().window_growth_bytes == INITIAL_WINDOW_BYTES
    client.reset_stream(first)
    pump(client, server)
    assert server.statistics().window_growth_bytes == 0


def test_a_new_bulk_stream_starts_at_the_window_the_session_learned() -> None:
    # At a 200 ms round trip, doubling a window from 256 KiB to 8 MiB takes five round
    # trips of every bulk transfer; a session that learned the window grants it to the
    # next stream that carries bulk data with its first update.
    client, server = pair(max_window_bytes=8 * 1024 * 1024)
    first = client.open_stream()
    transfer(client, server, first, 32 * 1024 * 1024)
    assert server.statistics().window_growth_bytes == 8 * 1024 * 1024 - INITIAL_WINDOW_BYTES
    client.close_stream(first)
    server.close_stream(first)
    pump(client, server)
    assert server.statistics().window_growth_bytes == 0  # the stream's growth returned

    second = client.open_stream()
    assert client.send_data(second, bytes(1 << 20)) == INITIAL_WINDOW_BYTES
    pump(client, server)
    server.acknowledge_received(second, WARM_AFTER_BYTES)  # one bulk frame read
    client_events, _ = pump(client, server)
    assert client_events == [SendWindowUpdated(second)]
    # the learned window, less what the server holds unread
    unread = INITIAL_WINDOW_BYTES - WARM_AFTER_BYTES
    assert client.send_window(second) == 8 * 1024 * 1024 - unread
    assert server.statistics().window_growth_bytes == 8 * 1024 * 1024 - INITIAL_WINDOW_BYTES

    # a stream of small messages is not granted it (nor takes the session's budget)
    third = client.open_stream()
    client.send_data(third, bytes(1000))
    pump(client, server)
    server.acknowledge_received(third, 1000)
    assert server.data_to_send() == b""
    assert client.send_window(third) == INITIAL_WINDOW_BYTES - 1000


def test_acknowledging_more_than_received_is_local_misuse() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    client.send_data(stream_id, b"abc")
    pump(client, server)
    with pytest.raises(YamuxStreamError):
        server.acknowledge_received(stream_id, 4)
    server.acknowledge_received(stream_id, 3)
    server.acknowledge_received(999, 10)  # forgotten or unknown: nothing to grant


def test_half_close_both_ways_then_stream_is_forgotten() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    client.send_data(stream_id, b"request")
    client.close_stream(stream_id)
    client.close_stream(stream_id)  # idempotent
    _, server_events = pump(client, server)
    assert server_events == [
        StreamOpened(stream_id),
        DataReceived(stream_id, b"request"),
        StreamEnded(stream_id),
    ]
    with pytest.raises(YamuxStreamError):
        client.send_data(stream_id, b"late")
    # The other direction stays open.
    server.send_data(stream_id, b"response")
    server.close_stream(stream_id)
    assert server.stream_ids() == ()
    client_events, _ = pump(client, server)
    assert client_events == [DataReceived(stream_id, b"response"), StreamEnded(stream_id)]
    assert client.stream_ids() == ()
    assert client.statistics().num_open_streams == 0
    with pytest.raises(YamuxStreamError):
        client.send_window(stream_id)


def test_server_closes_first() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    pump(client, server)
    server.close_stream(stream_id)
    client_events, _ = pump(client, server)
    assert client_events == [StreamEnded(stream_id)]
    client.send_data(stream_id, b"still allowed")
    client.close_stream(stream_id)
    _, server_events = pump(client, server)
    assert server_events == [DataReceived(stream_id, b"still allowed"), StreamEnded(stream_id)]
    assert client.stream_ids() == server.stream_ids() == ()


def test_reset_forgets_stream_on_both_sides() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    pump(client, server)
    server.send_data(stream_id, b"in flight")
    client.reset_stream(stream_id)
    client.reset_stream(stream_id)  # idempotent
    assert client.stream_ids() == ()
    client_events, server_events = pump(client, server)
    assert client_events == []  # data for a stream we reset is a race, not an error
    assert server_events == [StreamReset(stream_id)]
    assert server.stream_ids() == ()
    with pytest.raises(YamuxStreamError):
        server.send_data(stream_id, b"x")


def test_local_reset_mid_frame_drops_rest_of_body() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    client.send_data(stream_id, b"0123456789")
    wire = client.data_to_send()
    events = server.receive_data(wire[:-5])
    assert events[-1] == DataReceived(stream_id, b"01234")
    server.reset_stream(stream_id)
    assert server.receive_data(wire[-5:]) == []


def test_ping_pong() -> None:
    client, server = pair()
    client.ping(7)
    server.ping(8)
    client_events, server_events = pump(client, server)
    assert client_events == [PingReceived(8), PongReceived(7)]
    assert server_events == [PingReceived(7), PongReceived(8)]


def test_held_replies_coalesce_pongs_and_keep_resets_until_released() -> None:
    server = YamuxSession(is_client=False, max_streams=1)
    server.receive_data(frame(WINDOW_UPDATE, SYN, 1, 0))  # the one stream it allows
    server.data_to_send()
    server.hold_replies(True)
    pings = b"".join(frame(PING, SYN, 0, i) for i in range(5))
    refused = frame(WINDOW_UPDATE, SYN, 3, 0) + frame(WINDOW_UPDATE, SYN, 5, 0)
    events = server.receive_data(pings + refused)
    assert events[:5] == [PingReceived(i) for i in range(5)]
    assert events[5:] == [StreamRejected(3), StreamRejected(5)]
    assert server.data_to_send() == b""  # nothing queued while held
    assert server.holds_replies and server.num_held_resets == 2
    assert server.statistics().num_replies_held == 7
    server.hold_replies(False)  # the latest pong only, then the RSTs in order
    assert server.data_to_send() == (
        frame(WINDOW_UPDATE, ACK, 1, 0)  # (stream 1's ACK, owed until something is sent)
        + frame(PING, ACK, 0, 4)
        + frame(WINDOW_UPDATE, RST, 3, 0)
        + frame(WINDOW_UPDATE, RST, 5, 0)
    )
    assert not server.holds_replies


def test_replies_past_the_per_write_bound_are_held() -> None:
    server = YamuxSession(is_client=False)
    count = MAX_QUEUED_REPLIES + 10
    server.receive_data(b"".join(frame(PING, SYN, 0, i) for i in range(count)))
    queued = server.data_to_send()
    assert queued == b"".join(frame(PING, ACK, 0, i) for i in range(MAX_QUEUED_REPLIES))
    assert server.holds_replies
    server.hold_replies(False)
    assert server.data_to_send() == frame(PING, ACK, 0, count - 1)
    server.receive_data(frame(PING, SYN, 0, 99))  # a write later: answered at once again
    assert server.data_to_send() == frame(PING, ACK, 0, 99)


def test_go_away() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    pump(client, server)
    client.go_away()
    client.go_away()  # idempotent: one frame
    _, server_events = pump(client, server)
    assert server_events == [GoAwayReceived(GO_AWAY_NORMAL)]
    assert server.remote_went_away and not client.remote_went_away
    with pytest.raises(YamuxStreamError):
        server.open_stream()
    with pytest.raises(YamuxStreamError):
        client.open_stream()
    # A SYN after our go-away is refused with RST; open streams carry on.
    assert client.receive_data(frame(WINDOW_UPDATE, SYN, 4, 0)) == [StreamRejected(4)]
    assert client.data_to_send() == frame(WINDOW_UPDATE, RST, 4, 0)
    server.send_data(stream_id, b"ok")
    assert not client.is_closed
    client.reset_stream(stream_id)
    assert client.is_closed


def test_max_streams_rejects_extra_syn_without_killing_session() -> None:
    client, server = pair(max_streams=2)
    a, b, c = client.open_stream(), client.open_stream(), client.open_stream()
    client_events, server_events = pump(client, server)
    assert server_events == [StreamOpened(a), StreamOpened(b), StreamRejected(c)]
    assert client_events == [StreamReset(c)]
    assert server.statistics().num_streams_rejected == 1
    client.reset_stream(a)
    d = client.open_stream()
    _, server_events = pump(client, server)
    assert server_events == [StreamReset(a), StreamOpened(d)]


def test_local_open_is_bounded_too() -> None:
    client = YamuxSession(is_client=True, max_streams=1)
    client.open_stream()
    with pytest.raises(YamuxStreamError):
        client.open_stream()


def test_frames_for_closed_streams_are_ignored() -> None:
    server = YamuxSession(is_client=False)
    server.receive_data(frame(WINDOW_UPDATE, SYN, 1, 0))
    server.reset_stream(1)
    assert server.receive_data(frame(DATA, 0, 1, 3, b"abc") + frame(WINDOW_UPDATE, FIN, 1, 9)) == []
    own = server.open_stream()
    server.reset_stream(own)
    assert server.receive_data(frame(WINDOW_UPDATE, ACK, own, 0)) == []


REMOTE_FAULTS = {
    "bad version": frame(DATA, SYN, 1, 0, version=1),
    "unknown type": frame(4, 0, 0, 0),
    "data beyond window": frame(DATA, SYN, 1, INITIAL_WINDOW_BYTES + 1),
    "SYN with wrong parity": frame(WINDOW_UPDATE, SYN, 2, 0),
    "duplicate SYN": frame(WINDOW_UPDATE, SYN, 1, 0) * 2,
    "SYN reusing a closed id": frame(WINDOW_UPDATE, SYN, 1, 0)
    + frame(WINDOW_UPDATE, RST, 1, 0)
    + frame(WINDOW_UPDATE, SYN, 1, 0),
    "data after FIN": frame(WINDOW_UPDATE, SYN | FIN, 1, 0) + frame(DATA, 0, 1, 1, b"x"),
    "data on a stream never opened": frame(DATA, 0, 3, 1, b"x"),
    "window update for our stream never opened": frame(WINDOW_UPDATE, 0, 2, 5),
    "stream frame on stream 0": frame(DATA, 0, 0, 0),
    "ping on a stream": frame(PING, SYN, 1, 0),
    "send window overflow": frame(WINDOW_UPDATE, SYN, 1, 0)
    + frame(WINDOW_UPDATE, 0, 1, 0xFFFF_FFFF),
}


@pytest.mark.parametrize("wire", REMOTE_FAULTS.values(), ids=REMOTE_FAULTS.keys())
def test_remote_faults_kill_session_with_go_away(wire: bytes) -> None:
    server = YamuxSession(is_client=False)
    with pytest.raises(YamuxProtocolError):
        server.receive_data(wire)
    assert server.data_to_send().endswith(frame(GO_AWAY, 0, 0, GO_AWAY_PROTOCOL_ERROR))
    assert server.is_closed
    assert server.stream_ids() == ()
    with pytest.raises(YamuxStreamError):
        server.receive_data(frame(PING, SYN, 0, 1))
    with pytest.raises(YamuxStreamError):
        server.open_stream()


def test_out_of_order_syns_are_accepted() -> None:
    # go-yamux takes ids before it takes the send lock, so SYN 3 may precede SYN 1.
    server = YamuxSession(is_client=False)
    events = server.receive_data(frame(WINDOW_UPDATE, SYN, 3, 0) + frame(WINDOW_UPDATE, SYN, 1, 0))
    assert events == [StreamOpened(3), StreamOpened(1)]


def test_statistics_count_bytes() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    client.send_data(stream_id, b"12345")
    pump(client, server)
    client_stats, server_stats = client.statistics(), server.statistics()
    assert client_stats.num_data_bytes_sent == server_stats.num_data_bytes_received == 5
    assert client_stats.num_wire_bytes_sent == server_stats.num_wire_bytes_received == 12 + 17
    assert (client_stats.num_outbound_streams, server_stats.num_inbound_streams) == (1, 1)


@pytest.mark.parametrize(
    "kwargs", [{"max_streams": 0}, {"max_window_bytes": 1024}, {"max_window_growth_bytes": -1}]
)
def test_bad_config_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        YamuxSession(is_client=True, **kwargs)


def test_errors_say_whose_fault_it_is() -> None:
    assert issubclass(YamuxError, PeersError)
    assert issubclass(YamuxProtocolError, YamuxError) and issubclass(
        YamuxProtocolError, RemoteProtocolError
    )
    assert issubclass(YamuxStreamError, YamuxError) and issubclass(
        YamuxStreamError, LocalProtocolError
    )


def test_large_payloads_are_views_of_immutable_input_and_small_ones_copies() -> None:
    """A payload that is most of the ``bytes`` it arrived in is handed on as a view (no
    copy); a small one is copied, so it cannot pin the rest of its frame; input that may
    change later (a bytearray) is always copied."""
    server = YamuxSession(is_client=False)
    big, small = bytes(range(256)) * 200, b"tiny"
    syn = frame(WINDOW_UPDATE, SYN, 1, 0) + frame(WINDOW_UPDATE, SYN, 3, 0)
    server.receive_data(syn)
    # one immutable piece: a 51200-byte payload (shared) and a 4-byte one (copied)
    wire = frame(DATA, 0, 1, len(big), big) + frame(DATA, 0, 3, len(small), small)
    events = [e for e in server.receive_data(wire) if isinstance(e, DataReceived)]
    assert [type(e.data) for e in events] == [memoryview, bytes]
    assert [bytes(e.data) for e in events] == [big, small]
    view = events[0].data
    assert isinstance(view, memoryview) and view.readonly and view.obj is wire
    # the same payload from a mutable buffer is copied: changing the buffer changes nothing
    buffer = bytearray(frame(DATA, 0, 1, len(big), big))
    (event,) = [e for e in server.receive_data(buffer) if isinstance(e, DataReceived)]
    assert isinstance(event.data, bytes)
    buffer[20:30] = bytes(10)
    assert event.data == big
    # a payload split across two feeds: each part is judged against its own piece
    wire = frame(DATA, 0, 3, len(big), big)
    first = [e for e in server.receive_data(wire[:1000]) if isinstance(e, DataReceived)]
    rest = [e for e in server.receive_data(wire[1000:]) if isinstance(e, DataReceived)]
    assert [type(e.data) for e in first + rest] == [memoryview, memoryview]
    assert b"".join(bytes(e.data) for e in first + rest) == big
    # a small payload at the end of a large, mostly non-data piece is copied
    pings = b"".join(frame(PING, SYN, 0, n) for n in range(1000))
    wire = pings + frame(DATA, 0, 1, len(small), small)
    (event,) = [e for e in server.receive_data(wire) if isinstance(e, DataReceived)]
    assert isinstance(event.data, bytes) and event.data == small


def test_a_handed_over_buffer_gives_writable_views_of_large_payloads_only() -> None:
    """``owned=True`` (the Noise layer's fresh plaintexts): a mutable buffer is shared
    like immutable bytes, under the same at-least-half rule."""
    server = YamuxSession(is_client=False)
    server.receive_data(frame(WINDOW_UPDATE, SYN, 1, 0) + frame(WINDOW_UPDATE, SYN, 3, 0))
    big, small = bytes(range(256)) * 200, b"tiny"
    buffer = bytearray(frame(DATA, 0, 1, len(big), big) + frame(DATA, 0, 3, len(small), small))
    events = [e for e in server.receive_data(buffer, owned=True) if isinstance(e, DataReceived)]
    view, copy = events[0].data, events[1].data
    assert isinstance(view, memoryview) and not view.readonly and view.obj is buffer
    assert isinstance(copy, bytes) and copy == small
    assert bytes(view) == big


def test_send_pieces_makes_frames_of_views_within_the_payload_bound() -> None:
    """Pieces go out as if concatenated, in frames of at most the session's payload
    bound; a frame of at least VIEW_FRAME_BYTES holds views of the pieces (no copy), a
    smaller one is a copy the writer may not change afterwards."""
    client = YamuxSession(is_client=True, max_frame_payload_bytes=100_000)
    server = YamuxSession(is_client=False)
    stream_id = client.open_stream()
    server.receive_data(client.data_to_send())
    head, body = bytearray(b"head"), bytearray(os.urandom(230_000))
    assert client.send_pieces(stream_id, [head, b"", memoryview(body)]) == 230_004
    frames = client.frames_to_send()
    assert [sum(map(len, f)) - 12 for f in frames if isinstance(f, tuple)] == [
        100_000,
        100_000,
        30_004,
    ]
    assert all(isinstance(f, tuple) for f in frames)
    viewed = [p for f in frames if isinstance(f, tuple) for p in f[1:]]
    assert all(isinstance(p, memoryview) and p.obj in (head, body) for p in viewed)
    small = bytearray(b"small write")
    assert client.send_pieces(stream_id, [small]) == len(small)
    (copied,) = client.frames_to_send()
    small[:] = bytes(len(small))
    assert isinstance(copied, bytes) and copied.endswith(b"small write")
    wire = b"".join(p for f in frames for p in (f if isinstance(f, tuple) else (f,)))
    got = collect(server.receive_data(wire + copied))
    assert got == {stream_id: bytes(head) + bytes(body) + b"small write"}


def test_send_pieces_stops_at_the_window_even_inside_a_piece() -> None:
    client, server = pair()
    stream_id = client.open_stream()
    pieces = [os.urandom(100_000), os.urandom(100_000), os.urandom(100_000)]
    assert client.send_pieces(stream_id, pieces) == INITIAL_WINDOW_BYTES
    assert client.send_pieces(stream_id, [b"more"]) == 0
    _, server_events = pump(client, server)
    assert collect(server_events) == {stream_id: b"".join(pieces)[:INITIAL_WINDOW_BYTES]}


@pytest.mark.parametrize("bad", [0, -1, 1 << 32])
def test_a_frame_payload_bound_that_makes_no_sense_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="max_frame_payload_bytes"):
        YamuxSession(is_client=True, max_frame_payload_bytes=bad)
