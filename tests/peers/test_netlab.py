"""The namespace lab: real namespaces, real NAT, tiny socket programs in each host.

Each program is a few lines of Python run with ``host.popen`` that prints one JSON
object per event; the test reads those lines with bounded waits. Servers print
``ready`` once listening, so no test sleeps to wait for one.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from peers.netlab import Lab, NatType, Node, PublicHost, enter_namespace, lab_available
from peers.netlab.namespaces import list_namespaces, next_name, pid_alive, stale_namespaces
from peers.netlab.nat import router_ruleset
from peers.netlab.shaping import burst_bytes, tbf_args

AVAILABLE, REASON = lab_available()
needs_lab = pytest.mark.skipif(not AVAILABLE, reason=REASON)
pytestmark = pytest.mark.timeout(30)

#: Seconds a tiny program may take to start and report: Python starts in a fraction of
#: a second, the margin is for a loaded 2-core CI machine.
REPORT_TIMEOUT = 10.0
#: Seconds a connect may take before it counts as dropped: on a veth a SYN-ACK comes
#: back in well under a millisecond, so one second without one means nothing answered.
DROPPED_AFTER_SECONDS = 1.0
SERVER_PORT = 7000
CLIENT_PORT = 40000

# --- the tiny programs --------------------------------------------------------------

#: Accept ``n`` connections on ``port``; tell each peer, and the test, the address it
#: came from (what a STUN server does); then wait for each to close.
REFLECTOR = """
import json, socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
server = socket.create_server(("0.0.0.0", port))
server.settimeout(10)
print(json.dumps({"event": "ready"}), flush=True)
conns = []
for _ in range(n):
    conn, (ip, peer_port) = server.accept()
    conn.settimeout(10)
    conn.sendall(f"{ip} {peer_port}\\n".encode())
    print(json.dumps({"event": "peer", "ip": ip, "port": peer_port}), flush=True)
    conns.append(conn)
for conn in conns:
    conn.recv(1)
"""

#: Connect to ``ip:port`` (from local port ``local_port`` unless 0); report what came
#: back, or whether the connect was refused or timed out.
CLIENT = """
import json, socket, sys
ip, port, local_port, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
if local_port:
    s.bind(("0.0.0.0", local_port))
s.settimeout(timeout)
try:
    s.connect((ip, port))
except TimeoutError:
    print(json.dumps({"event": "timeout"}), flush=True)
except ConnectionRefusedError:
    print(json.dumps({"event": "refused"}), flush=True)
else:
    line = s.makefile().readline().split()
    print(json.dumps({"event": "connected", "seen_as": [line[0], int(line[1])]}), flush=True)
"""

#: From one local port, connect to every ``ip:port`` in turn, keeping each connection
#: open, and report the source address each server saw: the NAT's mappings.
MAPPINGS = """
import json, socket, sys
local_port, targets = int(sys.argv[1]), sys.argv[2:]
seen, socks = [], []
for target in targets:
    ip, port = target.split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", local_port))
    s.settimeout(5)
    s.connect((ip, int(port)))
    line = s.makefile().readline().split()
    seen.append([line[0], int(line[1])])
    socks.append(s)
print(json.dumps({"event": "mappings", "seen_as": seen}), flush=True)
"""

#: Accept two peers; tell each the other's address as seen from here (its external
#: mapping); then wait for both to close.
RENDEZVOUS = """
import json, socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(10)
print(json.dumps({"event": "ready"}), flush=True)
(a, a_addr), (b, b_addr) = server.accept(), server.accept()
a.sendall(f"{b_addr[0]} {b_addr[1]}\\n".encode())
b.sendall(f"{a_addr[0]} {a_addr[1]}\\n".encode())
for conn in (a, b):
    conn.settimeout(10)
    conn.recv(1)
"""

#: TCP hole punching: from local port ``local_port``, learn the peer's external address
#: from the rendezvous server, wait ``late`` seconds (the injected fault: a slow peer),
#: then connect() to it until it works or ``budget`` seconds pass; report the outcome
#: and how many attempts it took. Both peers run this at once, so their SYNs cross: a
#: TCP simultaneous open (RFC 9293 section 3.5).
PUNCH = """
import json, socket, sys, time
rv_ip, rv_port, local_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
budget, late = float(sys.argv[4]), float(sys.argv[5])
def bound_socket():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", local_port))
    return s
rv = bound_socket()
rv.settimeout(5)
rv.connect((rv_ip, rv_port))
peer_ip, peer_port = rv.makefile().readline().split()
time.sleep(late)
deadline = time.monotonic() + budget
attempts, errors = 0, []
while time.monotonic() < deadline:
    attempts += 1
    s = bound_socket()
    s.settimeout(min(1.0, max(0.01, deadline - time.monotonic())))
    try:
        s.connect((peer_ip, int(peer_port)))
    except OSError as e:
        errors.append(type(e).__name__)
        s.close()
        time.sleep(0.05)  # pace retries after a fast failure (an RST): not a sync
        continue
    s.settimeout(5)
    s.sendall(b"hello")
    reply = s.recv(5)
    print(json.dumps({"event": "punched", "attempts": attempts, "peer": [peer_ip, int(peer_port)],
                      "reply": reply.decode(), "errors": errors}), flush=True)
    break
else:
    print(json.dumps({"event": "failed", "attempts": attempts, "errors": errors}), flush=True)
rv.close()
"""

#: Receive until EOF and report the rate from the first byte to the last.
SINK = """
import json, socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
server.settimeout(10)
print(json.dumps({"event": "ready"}), flush=True)
conn, _ = server.accept()
conn.settimeout(10)
total, first = 0, None
while chunk := conn.recv(65536):
    first = first or time.monotonic()
    total += len(chunk)
seconds = time.monotonic() - first
print(json.dumps({"event": "received", "bytes": total, "seconds": seconds}), flush=True)
"""

#: Send ``size`` bytes to ``ip:port`` and close.
SOURCE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(bytes(int(sys.argv[3])))
s.close()
"""


class Program:
    """One tiny program in a lab host, with its JSON reports read on a thread."""

    def __init__(self, host: Node, source: str, *args: object) -> None:
        self.popen = host.popen(
            [sys.executable, "-c", source, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        with contextlib.suppress(OSError, ValueError):  # the lab closed the pipe
            for line in self.popen.stdout:
                self._lines.put(line)
        self._lines.put(None)

    def report(self, timeout: float = REPORT_TIMEOUT) -> dict[str, Any]:
        """The next JSON line; fails the test if none comes in time or it exits first."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"program reported nothing in {timeout} s")
        if line is None:
            _, stderr = self.popen.communicate(timeout=timeout)
            pytest.fail(f"program exited ({self.popen.returncode}) without a report: {stderr}")
        report: dict[str, Any] = json.loads(line)
        return report

    def expect(self, event: str, timeout: float = REPORT_TIMEOUT) -> dict[str, Any]:
        report = self.report(timeout)
        assert report["event"] == event, report
        return report


def serve(host: Node, source: str, *args: object) -> Program:
    """Start a server program and wait until it listens."""
    program = Program(host, source, *args)
    program.expect("ready")
    return program


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab() as built:
        yield built


# --- reachability -------------------------------------------------------------------


@needs_lab
def test_public_host_reaches_public_host(lab: Lab) -> None:
    a, b = lab.add_public_host("a"), lab.add_public_host("b")
    server = serve(b, REFLECTOR, SERVER_PORT, 1)
    client = Program(a, CLIENT, b.address, SERVER_PORT, 0, 5)
    assert client.expect("connected")["seen_as"][0] == a.address
    assert server.expect("peer")["ip"] == a.address


def _connect_from(namespace: str, address: str, port: int, done: Any) -> None:
    enter_namespace(namespace)
    with socket.create_connection((address, port), timeout=5) as conn:
        done.put(conn.getsockname()[0])


@needs_lab
def test_a_multiprocessing_child_enters_a_hosts_namespace(lab: Lab) -> None:
    a, b = lab.add_public_host("a"), lab.add_public_host("b")
    server = serve(b, REFLECTOR, SERVER_PORT, 1)
    context = multiprocessing.get_context("spawn")
    done = context.Queue()
    child = context.Process(target=_connect_from, args=(a.namespace, b.address, SERVER_PORT, done))
    child.start()
    try:
        assert done.get(timeout=30) == a.address  # the host's address, not the machine's
        assert server.expect("peer")["ip"] == a.address
    finally:
        child.join(10)
    assert child.exitcode == 0
    with pytest.raises(OSError, match="no network namespace"):
        enter_namespace("stl-no-such-namespace")


@needs_lab
def test_lan_host_reaches_public_host_as_its_routers_wan_address(lab: Lab) -> None:
    server_host = lab.add_public_host("server")
    router = lab.add_home_router("home")
    laptop = lab.add_lan_host(router, "laptop")
    assert laptop.address == "198.19.0.2"
    assert laptop.router is router
    server = serve(server_host, REFLECTOR, SERVER_PORT, 1)
    client = Program(laptop, CLIENT, server_host.address, SERVER_PORT, 0, 5)
    client.expect("connected")
    assert server.expect("peer")["ip"] == router.wan_address != laptop.address


@needs_lab
def test_unsolicited_inbound_is_dropped_not_refused(lab: Lab) -> None:
    outsider, other = lab.add_public_host("outsider"), lab.add_public_host("other")
    router = lab.add_home_router("home")
    laptop = lab.add_lan_host(router, "laptop")
    # A server listens behind the NAT, so only the NAT can keep the outsider out.
    serve(laptop, REFLECTOR, SERVER_PORT, 1)
    probe = Program(outsider, CLIENT, router.wan_address, SERVER_PORT, 0, DROPPED_AFTER_SECONDS)
    assert probe.report()["event"] == "timeout"
    # The control: a public host with nothing listening refuses at once.
    control = Program(outsider, CLIENT, other.address, SERVER_PORT, 0, DROPPED_AFTER_SECONDS)
    assert control.report()["event"] == "refused"


@needs_lab
def test_two_lans_share_one_address_and_both_reach_the_internet(lab: Lab) -> None:
    server_host = lab.add_public_host("server")
    homes = [lab.add_home_router(f"home{i}") for i in range(2)]
    laptops = [lab.add_lan_host(home, f"laptop{i}") for i, home in enumerate(homes)]
    assert laptops[0].address == laptops[1].address == "198.19.0.2"
    server = serve(server_host, REFLECTOR, SERVER_PORT, 2)
    for laptop in laptops:
        Program(laptop, CLIENT, server_host.address, SERVER_PORT, 0, 5).expect("connected")
    seen = {server.expect("peer")["ip"], server.expect("peer")["ip"]}
    assert seen == {home.wan_address for home in homes}


@needs_lab
def test_no_interface_of_the_machine_itself_leads_into_the_lab(lab: Lab) -> None:
    lab.add_lan_host(lab.add_home_router("home"), "laptop")
    lab.add_public_host("server")
    # A veth whose other end is in a named namespace shows "link-netns NAME".
    own_links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    leads_in = [n for n in lab.namespaces if re.search(rf"link-netns {n}(?!\S)", own_links)]
    assert not leads_in, own_links


@needs_lab
def test_second_lan_host_gets_the_next_address(lab: Lab) -> None:
    router = lab.add_home_router("home")
    first, second = lab.add_lan_host(router, "a"), lab.add_lan_host(router, "b")
    assert (first.address, second.address) == ("198.19.0.2", "198.19.0.3")
    serve(second, REFLECTOR, SERVER_PORT, 1)
    client = Program(first, CLIENT, second.address, SERVER_PORT, 0, 5)
    assert client.expect("connected")["seen_as"][0] == first.address  # no NAT on the LAN


@needs_lab
def test_only_routers_forward_and_lab_links_are_ipv4_only(lab: Lab) -> None:
    host = lab.add_public_host("host")
    router = lab.add_home_router("home")
    laptop = lab.add_lan_host(router, "laptop")
    for node, forwarding in ((host, "0"), (router, "1"), (laptop, "0")):
        assert node.run(["sysctl", "-n", "net.ipv4.ip_forward"]).stdout.strip() == forwarding
        assert "inet6" not in node.run(["ip", "-6", "addr", "show", "dev", node.uplink]).stdout


# --- NAT mapping behaviour ----------------------------------------------------------


def _mappings(lab: Lab, nat: NatType) -> list[tuple[str, int]]:
    servers = [lab.add_public_host(f"server{i}") for i in range(2)]
    laptop = lab.add_lan_host(lab.add_home_router("home", nat=nat), "laptop")
    for server in servers:
        serve(server, REFLECTOR, SERVER_PORT, 1)
    targets = [f"{server.address}:{SERVER_PORT}" for server in servers]
    report = Program(laptop, MAPPINGS, CLIENT_PORT, *targets).expect("mappings")
    return [(ip, port) for ip, port in report["seen_as"]]


@needs_lab
def test_endpoint_independent_nat_keeps_one_external_port_per_local_port(lab: Lab) -> None:
    first, second = _mappings(lab, "endpoint-independent")
    assert first == second
    assert first[1] == CLIENT_PORT  # Linux masquerade keeps a free source port


@needs_lab
def test_symmetric_nat_maps_each_destination_to_its_own_port(lab: Lab) -> None:
    first, second = _mappings(lab, "symmetric")
    assert first[0] == second[0]
    # fully-random picks each port at random: equal by chance once in ~64,000 runs.
    assert first[1] != second[1]


# --- hole punching ------------------------------------------------------------------

#: Seconds each peer keeps trying to punch through; a working punch succeeds within
#: an attempt or two, so this only bounds how long the failing case takes.
PUNCH_BUDGET_SECONDS = 3.0
#: How late the slow peer starts punching: past the first attempt's connect timeout
#: (one second) of the punctual one, so that one's first attempt has failed by then.
LATE_SECONDS = 1.5


def _punch(
    lab: Lab, nat: NatType, *, late_seconds: float = 0.0
) -> tuple[list[dict[str, Any]], list[str]]:
    """Both LAN hosts punch to each other, the second ``late_seconds`` after the first;
    their reports, and their routers' WAN addresses."""
    rendezvous = lab.add_public_host("rendezvous")
    routers = [lab.add_home_router(f"home{i}", nat=nat) for i in range(2)]
    peers = [lab.add_lan_host(router, f"peer{i}") for i, router in enumerate(routers)]
    serve(rendezvous, RENDEZVOUS, SERVER_PORT)
    programs = [
        Program(
            peer, PUNCH, rendezvous.address, SERVER_PORT, CLIENT_PORT, PUNCH_BUDGET_SECONDS, late
        )
        for peer, late in zip(peers, (0.0, late_seconds), strict=True)
    ]
    wait = REPORT_TIMEOUT + PUNCH_BUDGET_SECONDS + late_seconds
    reports = [program.report(wait) for program in programs]
    print(f"simultaneous open through {nat} NATs:", reports)
    return reports, [router.wan_address for router in routers]


@needs_lab
def test_tcp_simultaneous_open_through_two_endpoint_independent_nats(lab: Lab) -> None:
    reports, wan_addresses = _punch(lab, "endpoint-independent")
    assert [r["event"] for r in reports] == ["punched", "punched"], reports
    assert [r["reply"] for r in reports] == ["hello", "hello"]
    # Each dialled the other's router, at the port the rendezvous server saw.
    assert [r["peer"] for r in reports] == [
        [wan_addresses[1], CLIENT_PORT],
        [wan_addresses[0], CLIENT_PORT],
    ]


@needs_lab
def test_simultaneous_open_survives_a_peer_that_starts_late(lab: Lab) -> None:
    # The punctual peer's first SYN is dropped by the far router and its connect times
    # out; its retry, from the same port, keeps its own mapping open, and the late
    # peer's first SYN gets through it.
    punctual, late = _punch(lab, "endpoint-independent", late_seconds=LATE_SECONDS)[0]
    assert (punctual["event"], late["event"]) == ("punched", "punched"), (punctual, late)
    assert punctual["attempts"] >= 2
    assert "TimeoutError" in punctual["errors"]


@needs_lab
def test_tcp_simultaneous_open_fails_through_symmetric_nats(lab: Lab) -> None:
    reports, _ = _punch(lab, "symmetric")
    assert [r["event"] for r in reports] == ["failed", "failed"], reports


# --- shaping and cutting ------------------------------------------------------------

RATE_MBIT = 16.0
TRANSFER_BYTES = 1_500_000  # 0.75 s at 16 Mbit/s: long enough that the burst is noise


def _rate_mbit(sender: Node, receiver: PublicHost) -> float:
    sink = serve(receiver, SINK, SERVER_PORT)
    Program(sender, SOURCE, receiver.address, SERVER_PORT, TRANSFER_BYTES)
    report = sink.expect("received")
    assert report["bytes"] == TRANSFER_BYTES
    return float(report["bytes"] * 8 / report["seconds"] / 1e6)


@needs_lab
def test_a_capped_link_runs_at_about_its_rate(lab: Lab) -> None:
    capped = lab.add_public_host("capped", rate_mbit=RATE_MBIT)
    free = lab.add_public_host("free")
    up, down = _rate_mbit(capped, free), _rate_mbit(free, capped)
    print(f"capped at {RATE_MBIT} Mbit/s: up {up:.1f}, down {down:.1f}")
    # Unshaped, a veth carries gigabits per second; a loose bound, never a tight timing.
    assert up < 2 * RATE_MBIT
    assert down < 2 * RATE_MBIT


@needs_lab
def test_cut_drops_silently_and_restore_reconnects(lab: Lab) -> None:
    a, b = lab.add_public_host("a"), lab.add_public_host("b")
    lab.cut(b)
    lab.cut(b)  # idempotent
    probe = Program(a, CLIENT, b.address, SERVER_PORT, 0, DROPPED_AFTER_SECONDS)
    assert probe.report()["event"] == "timeout"
    lab.restore(b)
    serve(b, REFLECTOR, SERVER_PORT, 1)
    Program(a, CLIENT, b.address, SERVER_PORT, 0, 5).expect("connected")


# --- teardown -----------------------------------------------------------------------


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether ``pid`` has exited within ``timeout`` (it is not our child to wait for)."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@needs_lab
def test_teardown_removes_everything_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), Lab() as lab:
        host = lab.add_home_router("home")
        sleeper = host.popen([sys.executable, "-c", "import time; time.sleep(60)"])
        lab.add_lan_host(host, "laptop")
        names = lab.namespaces
        assert all(re.fullmatch(rf"stl{os.getpid()}-\d+", name) for name in names), names
        assert set(names) <= set(list_namespaces())
        raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())
    assert sleeper.poll() is not None


#: A process that builds a lab, starts a sleeper in it, reports, then waits for stdin.
OWNER = """
import json, sys
from peers.netlab import Lab
lab = Lab()
host = lab.add_lan_host(lab.add_home_router("home"), "laptop")
sleeper = host.popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(json.dumps({"namespaces": lab.namespaces, "sleeper": sleeper.pid}), flush=True)
if sys.argv[1] == "wait":
    sys.stdin.read()
"""


def _owner(mode: str) -> tuple[subprocess.Popen[bytes], list[str], int]:
    """A process (in no namespace) owning a lab; its namespaces and its sleeper's PID."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert owner.stdout is not None
    ready, _, _ = select.select([owner.stdout], [], [], REPORT_TIMEOUT)
    assert ready, f"the owner reported nothing in {REPORT_TIMEOUT} s"
    report = json.loads(owner.stdout.readline() or b"{}")  # the line is written at once
    assert report, f"owner exited with {owner.wait(REPORT_TIMEOUT)}"
    return owner, report["namespaces"], report["sleeper"]


@needs_lab
def test_sigterm_of_the_owner_tears_its_lab_down() -> None:
    owner, names, sleeper = _owner("wait")
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(10) == -signal.SIGTERM  # it still dies of the signal
    assert not set(names) & set(list_namespaces())
    assert _gone(sleeper)


@needs_lab
def test_normal_exit_without_close_tears_the_lab_down() -> None:
    owner, names, sleeper = _owner("exit")
    assert owner.wait(10) == 0
    assert not set(names) & set(list_namespaces())
    assert _gone(sleeper)


@needs_lab
def test_a_new_lab_removes_the_namespaces_of_a_killed_one() -> None:
    owner, names, sleeper = _owner("wait")
    owner.kill()  # SIGKILL: no handler runs, the namespaces and the sleeper stay
    owner.wait(10)
    assert set(names) <= set(list_namespaces())
    assert pid_alive(sleeper)
    with Lab() as lab:
        assert set(names) <= set(lab.removed_stale)
        assert not set(names) & set(list_namespaces())
        assert _gone(sleeper)


def test_stale_namespaces_are_ours_with_a_dead_owner() -> None:
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait(10)
    names = [
        f"stl{dead.pid}-3",  # ours, owner dead
        next_name(),  # ours, owner alive (this process)
        f"stl{os.getppid()}-0",  # ours, owner alive
        f"other{dead.pid}-3",  # not ours
        f"stl{dead.pid}",  # not our pattern
    ]
    assert stale_namespaces(names) == [f"stl{dead.pid}-3"]


# --- the pure parts -----------------------------------------------------------------


def test_symmetric_nat_is_fully_random_masquerade_and_eim_plain() -> None:
    eim = router_ruleset("endpoint-independent", wan_interface="wan0")
    symmetric = router_ruleset("symmetric", wan_interface="wan0")
    assert 'oifname "wan0" masquerade\n' in eim
    assert 'oifname "wan0" masquerade fully-random\n' in symmetric
    for ruleset in (eim, symmetric):  # unsolicited inbound dropped where it could land
        assert ruleset.count('iifname "wan0" counter drop') == 2
    with pytest.raises(ValueError, match="nat must be one of"):
        router_ruleset("full-cone", wan_interface="wan0")  # type: ignore[arg-type]


def test_tbf_bucket_holds_ten_milliseconds_but_at_least_32_kib() -> None:
    assert burst_bytes(1.0) == 32 * 1024
    assert burst_bytes(1000.0) == 1_250_000
    assert tbf_args("eth0", 16.0) == [
        *("qdisc", "replace", "dev", "eth0", "root", "tbf"),
        *("rate", "16000kbit", "burst", "32768", "latency", "50ms"),
    ]
    with pytest.raises(ValueError, match="positive"):
        tbf_args("eth0", 0.0)
