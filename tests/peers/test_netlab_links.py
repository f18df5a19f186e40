"""Link shapes in the lab: latency (one way, up and down apart, with jitter), loss and
asymmetric bandwidth on a node's link, through NAT routers too. Each check is a bound
the shape must produce (a delayed link never answers sooner than its delay), never a
tight timing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from peers.netlab import Lab, Node, PublicHost, lab_available
from peers.netlab.delay_line import Direction, LineSettings
from tests.peers.test_netlab import (
    CLIENT,
    REFLECTOR,
    SERVER_PORT,
    SINK,
    SOURCE,
    Program,
    serve,
)

AVAILABLE, REASON = lab_available()
needs_lab = pytest.mark.skipif(not AVAILABLE, reason=REASON)
pytestmark = pytest.mark.timeout(60)

#: Echo every byte back on each connection (one at a time).
ECHO = """
import json, socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(20)
print(json.dumps({"event": "ready"}), flush=True)
while True:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)
"""

#: Connect, then time ``n`` one-byte round trips; report the smallest and the median.
PINGER = """
import json, socket, statistics, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    s.sendall(b"p")
    s.recv(1)
    rtts.append((time.perf_counter() - t) * 1000)
print(json.dumps({"event": "rtt", "min_ms": min(rtts), "median_ms": statistics.median(rtts)}))
"""


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab() as built:
        yield built


def _rtt_ms(client: Node, server: PublicHost, port: int = SERVER_PORT) -> float:
    """The smallest of five TCP round trips from ``client`` to an echo on ``server``."""
    report = Program(client, PINGER, server.address, port, 5).expect("rtt")
    print(f"round trip {report['min_ms']:.2f} ms (median {report['median_ms']:.2f})")
    return float(report["min_ms"])


# --- the line's own logic, without a lab --------------------------------------------


def test_frames_leave_after_their_delay_in_the_order_they_came() -> None:
    import random

    direction = Direction(random.Random(1))
    direction.delay, direction.jitter = 0.040, 0.030
    for i in range(100):
        direction.arrive(bytes([i]), now=i * 0.001)
    assert direction.due(0.039) == []
    out = direction.due(10.0)
    assert out == [bytes([i]) for i in range(100)]  # jitter never reorders
    assert direction.next_due() is None


def test_a_lossy_direction_drops_about_its_share() -> None:
    import random

    direction = Direction(random.Random(2))
    direction.loss = 0.25
    for _ in range(4000):
        direction.arrive(b"x", now=0.0)
    assert 800 < direction.num_dropped < 1200  # binomial: 1000 +- 27 (sd)
    assert len(direction.due(0.0)) == 4000 - direction.num_dropped


@pytest.mark.parametrize(
    "bad",
    [{"a_to_b_ms": -1}, {"b_to_a_ms": 20_000}, {"jitter_ms": "5"}, {"loss": 1.5}],
)
def test_settings_out_of_range_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        LineSettings(**bad)  # type: ignore[arg-type]


# --- in the lab ---------------------------------------------------------------------


@needs_lab
def test_a_delayed_link_adds_its_delay_to_every_round_trip_and_can_change(lab: Lab) -> None:
    far, near = lab.add_public_host("far"), lab.add_public_host("near")
    serve(near, ECHO, SERVER_PORT)
    lab.delay(far, one_way_ms=40)
    assert _rtt_ms(far, near) >= 80  # up 40, down 40: nothing arrives early
    lab.delay(far, up_ms=60, down_ms=0)  # asymmetric
    assert _rtt_ms(far, near) >= 60
    lab.delay(far, one_way_ms=0)  # the line stays in and passes frames at once
    assert _rtt_ms(far, near) < 60  # (about 0.1 ms; the bound only tells it apart)
    with pytest.raises(ValueError, match="loss"):
        lab.delay(far, loss=2.0)  # refused before the line hears of it
    assert _rtt_ms(far, near) < 60  # and the line keeps passing frames


@needs_lab
def test_a_malformed_settings_line_is_refused_and_the_line_keeps_serving(lab: Lab) -> None:
    from peers.netlab.commands import NetlabError

    far, near = lab.add_public_host("far"), lab.add_public_host("near")
    serve(near, ECHO, SERVER_PORT)
    lab.delay(far, one_way_ms=30)
    line = lab._lines[far.name]
    assert line.popen.stdin is not None
    for garbage in ("not json\n", '{"loss": 7}\n', '{"bogus": 1}\n'):
        line.popen.stdin.write(garbage)
        line.popen.stdin.flush()
        with pytest.raises(NetlabError, match="refused"):
            line._expect("applied")
    assert _rtt_ms(far, near) >= 60  # still up, with the settings it had


@needs_lab
def test_two_delayed_ends_add_up_and_jitter_adds_at_most_its_bound(lab: Lab) -> None:
    a, b = lab.add_public_host("a"), lab.add_public_host("b")
    lab.delay(a, one_way_ms=20, jitter_ms=10)
    lab.delay(b, one_way_ms=15)
    serve(b, ECHO, SERVER_PORT)
    assert _rtt_ms(a, b) >= 2 * (20 + 15)


@needs_lab
def test_a_delayed_router_delays_its_lan_and_nat_still_works(lab: Lab) -> None:
    server = lab.add_public_host("server")
    router = lab.add_home_router("home")
    laptop = lab.add_lan_host(router, "laptop")
    lab.delay(router, one_way_ms=25)
    serve(server, REFLECTOR, SERVER_PORT, 1)
    seen = Program(laptop, CLIENT, server.address, SERVER_PORT, 0, 5).expect("connected")
    assert seen["seen_as"][0] == router.address  # translated, as without the line
    serve(server, ECHO, SERVER_PORT + 1)
    assert _rtt_ms(laptop, server, SERVER_PORT + 1) >= 50


@needs_lab
def test_data_crosses_a_lossy_link_intact_and_a_total_loss_is_silence(lab: Lab) -> None:
    a, b = lab.add_public_host("a"), lab.add_public_host("b")
    lab.delay(a, one_way_ms=2, loss=0.05)
    sink = serve(b, SINK, SERVER_PORT)
    Program(a, SOURCE, b.address, SERVER_PORT, 2_000_000)
    assert sink.expect("received")["bytes"] == 2_000_000  # TCP retransmitted the losses
    lab.delay(a, loss=1.0)
    probe = Program(a, CLIENT, b.address, SERVER_PORT + 1, 0, 1.0)
    assert probe.report()["event"] == "timeout"


@needs_lab
def test_cut_and_restore_work_with_a_delay_line_in_the_link(lab: Lab) -> None:
    a, b = lab.add_public_host("a"), lab.add_public_host("b")
    lab.cut(b)
    lab.delay(b, one_way_ms=5)  # the line goes in while cut: the cut moves with the link
    probe = Program(a, CLIENT, b.address, SERVER_PORT, 0, 1.0)
    assert probe.report()["event"] == "timeout"
    lab.restore(b)
    serve(b, REFLECTOR, SERVER_PORT, 1)
    Program(a, CLIENT, b.address, SERVER_PORT, 0, 5).expect("connected")
    lab.cut(b)
    probe = Program(a, CLIENT, b.address, SERVER_PORT, 0, 1.0)
    assert probe.report()["event"] == "timeout"


@needs_lab
def test_an_asymmetric_line_caps_each_direction_apart(lab: Lab) -> None:
    from tests.peers.test_netlab import _rate_mbit

    home, other = lab.add_public_host("home"), lab.add_public_host("other")
    lab.shape(home, up_mbit=8, down_mbit=64)
    up, down = _rate_mbit(home, other), _rate_mbit(other, home)
    print(f"up {up:.1f} Mbit/s, down {down:.1f} Mbit/s")
    assert up < 16 and down > 16  # each at about its own cap, far apart
    with pytest.raises(ValueError, match="not both"):
        lab.shape(home, rate_mbit=10, up_mbit=5)
