"""``swarm dashboard``: its history (pure), its HTTP answers on a small in-process swarm
of crafted records, and the page in headless Chromium while a real local swarm trains
(processes on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from peers import KeyPair, PeerConfig
from peers.dht import BlockingDHT, DHTConfig, dht_time
from peers.dht.status import PeerStatus, RunStatus, ServedStatus
from swarm.dashboard.command import follow_swarm
from swarm.dashboard.history import (
    MAX_EVENTS,
    MAX_POINTS,
    MAX_RUNS,
    ROUNDS_EVENT_SECONDS,
    History,
)
from swarm.dashboard.server import CONTENT_SECURITY_POLICY, DashboardServer, finite, is_loopback
from swarm.status import publish_status
from swarm.status_view import SwarmView, summarize

SWARM = [sys.executable, "-m", "swarm.cli"]
LOCAL = ["--listen", "/ip4/127.0.0.1/tcp/0"]
LISTEN = PeerConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
HOSTILE = "<script>window.pwned=1</script><b>x</b>"
#: Far from the float limit each, infinite once two peers' claims are summed.
HUGE = 1.7e308
IDS = [KeyPair.generate().peer_id for _ in range(MAX_RUNS + 4)]

# --- history (pure) ---------------------------------------------------------------------


def _run(run_id: str, samples: int, rounds: int, failed: int = 0) -> RunStatus:
    return RunStatus(run_id, rounds, samples, 10.0, 0.5, 2, rounds, failed)


def _stage(num_stages: int) -> ServedStatus:
    return ServedStatus("stage", "lm", 0, num_stages, 0, 0)


def _view(now: float, records: Mapping[int, Sequence[RunStatus | ServedStatus]]) -> SwarmView:
    """A view of peers ``IDS[i]``, each publishing the runs and served modules given."""
    statuses = {}
    for i, parts in records.items():
        runs = tuple(p for p in parts if isinstance(p, RunStatus))
        served = tuple(p for p in parts if isinstance(p, ServedStatus))
        statuses[IDS[i]] = PeerStatus("swarmtrain/0.1.0", "public", now, runs, served, len(served))
    return summarize(statuses, [], now)


def _texts(history: History) -> list[str]:
    events = history.to_json()["events"]
    assert isinstance(events, list)
    return [e["text"] for e in events]  # newest first


def test_history_sees_rounds_failures_joins_leaves_and_uncovered_stages() -> None:
    history = History()
    history.update(_view(100.0, {0: (_run("a", 10, 1),), 2: (_stage(1),)}), 100.0)
    assert _texts(history) == []  # the first read is the baseline: nothing happened yet
    views: list[dict[int, tuple[RunStatus | ServedStatus, ...]]] = [
        {0: (_run("a", 50, 4, 1),), 1: (_run("b", 5, 0),), 2: (_stage(2),)},
        {0: (_run("a", 60, 6, 1),), 2: (_stage(2),)},
        {0: (_run("a", 70, 9, 1),), 2: (_stage(2),)},
    ]
    for i, records in enumerate(views):
        history.update(_view(102.0 + 2 * i, records), 102.0 + 2 * i)
    assert _texts(history) == [
        "run a: 5 rounds (epoch 9)",  # 2 then 3 rounds within a minute: one event
        f"peer {IDS[1]} left",
        "pipeline lm: no server for stage 1",  # once, while it stays uncovered
        "run a: 1 round failed",
        "run a: 3 rounds (epoch 4)",
        f"peer {IDS[1]} appeared",
    ]
    newest = history.to_json()["events"]
    assert isinstance(newest, list) and (newest[0]["since"], newest[0]["time"]) == (104.0, 106.0)
    later = 104.0 + ROUNDS_EVENT_SECONDS
    history.update(_view(later, {0: (_run("a", 71, 10, 1),), 2: (_stage(2),)}), later)
    assert _texts(history)[:2] == ["run a: 1 round (epoch 10)", "run a: 5 rounds (epoch 9)"]
    series = history.to_json()["series"]
    assert isinstance(series, dict)
    assert series["a"]["samples"] == [10, 50, 60, 70, 71] and series["b"]["samples"] == [5]


def test_history_is_bounded_whatever_the_peers_publish() -> None:
    history = History()
    for i in range(MAX_POINTS + 10):  # a peer flapping in and out, a run that never stops
        records: dict[int, list[RunStatus | ServedStatus]] = {0: [_run("a", i, i, i)]}
        if i % 2:
            records[1] = [_stage(2)]
        history.update(_view(float(i), records), float(i))
    assert len(history.series["a"]) == MAX_POINTS
    assert len(history.events) == MAX_EVENTS


def test_runs_published_once_do_not_take_the_real_runs_chart() -> None:
    history = History()
    for i in range(3 * MAX_RUNS):  # a new junk run every read, next to the real one
        records = {0: (_run("real", i, i),), 1: (_run("real", i, i),), 2: (_run(f"junk{i}", 1, 0),)}
        history.update(_view(float(i), records), float(i))
        assert len(history.series) <= MAX_RUNS
        # what the history compares with the next read is only what this read holds
        assert set(history._rounds) == {"real", f"junk{i}"}
    assert "real" in history.series and len(history.series["real"]) == 3 * MAX_RUNS
    # More runs at once than charts: the runs with the fewest peers go without.
    crowd = {i: (_run(f"run{i}", 1, 0),) for i in range(MAX_RUNS + 1)}
    crowd[MAX_RUNS + 1] = (_run("run0", 1, 0),)  # run0 has two peers
    history.update(_view(1000.0, crowd), 1000.0)
    assert len(history.series) == MAX_RUNS and "run0" in history.series
    assert "real" not in history.series  # no longer reported: dropped first


def test_non_finite_figures_become_null_and_loopback_is_recognised() -> None:
    assert finite({"a": [1.0, float("inf"), (float("nan"), 2)], "b": "x"}) == {
        "a": [1.0, None, [None, 2]],
        "b": "x",
    }
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "192.0.2.1", "evil.example", "localhost.evil.example", ""):
        assert not is_loopback(host), host


# --- HTTP, in-process, on a swarm of crafted records ------------------------------------


def _get(
    url: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _raw(url: str, request: bytes) -> bytes:
    """What the server at ``url`` answers to the bytes ``request`` (read until it closes)."""
    host, port = urllib.parse.urlsplit(url).netloc.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(65536):  # ends when the server closes: one request each
            reply += chunk
    return reply


def _strict_json(body: bytes) -> dict[str, Any]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads(body, parse_constant=refuse)
    assert isinstance(data, dict)
    return data


def _api(url: str, done: Callable[[dict[str, Any]], bool], seconds: float = 60) -> dict[str, Any]:
    """``/api/view`` once ``done(view)`` holds; polls every 0.25 s for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    data: dict[str, Any] = {}
    while time.monotonic() < deadline:
        data = _strict_json(_get(url + "api/view")[2])
        if data["view"] is not None and done(data["view"]):
            return data
        time.sleep(0.25)
    raise AssertionError(f"the view never got there: {data}")


def _crafted(now: float) -> list[PeerStatus]:
    """Three peers: one of each reachability, a stage of two served, and a run whose
    claimed throughput and loss, each finite, overflow once summed or averaged."""
    big = RunStatus("big", 1, 1, HUGE, HUGE, 2, 0, 0)
    return [
        PeerStatus("swarmtrain/0.1.0", "public", now, (_run("alpha", 100, 3), big)),
        PeerStatus("swarmtrain/0.1.0", "private", now, (_run("alpha", 50, 3), big)),
        PeerStatus("swarmtrain/0.1.0", "relayed", now, (), (_stage(2),), 1),
    ]


@pytest.fixture
def crafted_dashboard() -> Iterator[tuple[str, str]]:
    """A bootstrap node, three nodes publishing :func:`_crafted` records, and a
    dashboard (server and poller) in this process; yields its URL and the bootstrap's."""
    with contextlib.ExitStack() as stack:
        boot = stack.enter_context(BlockingDHT(peer_config=LISTEN))
        maddr = str(boot.peer.listen_addrs[0])
        joined = DHTConfig(initial_peers=(maddr,))
        for status in _crafted(dht_time()):
            node = stack.enter_context(BlockingDHT(config=joined, peer_config=LISTEN))
            assert node.peer.run(publish_status(node.node, status, 60.0), timeout=30)
        client = stack.enter_context(
            BlockingDHT(
                config=DHTConfig(initial_peers=(maddr,), client_mode=True),
                peer_config=PeerConfig(listen_addrs=()),
            )
        )
        server = DashboardServer()
        port = server.start("127.0.0.1", 0)
        stack.callback(server.close)
        poller = client.peer.submit(follow_swarm(client.node, server, asyncio.Event(), 0.5, maddr))
        stack.callback(poller.cancel)  # first out: before the server and the nodes close
        yield f"http://127.0.0.1:{port}/", maddr


def test_the_server_answers_the_view_and_nothing_else(crafted_dashboard: tuple[str, str]) -> None:
    url, boot = crafted_dashboard
    data = _api(url, lambda v: len(v["peers"]) >= 4 and len(v["runs"]) == 2, seconds=30)
    view = data["view"]
    assert data["through"] == boot and data["refresh_seconds"] == 0.5
    reach = sorted(p["reachability"] for p in view["peers"] if p["agent"])
    assert reach == ["private", "public", "relayed"]
    assert boot.rsplit("/p2p/", 1)[1] in {p["peer_id"] for p in view["peers"]}
    alpha, big = sorted(view["runs"], key=lambda r: r["run_id"])
    assert (alpha["run_id"], alpha["samples"], alpha["num_peers"]) == ("alpha", 150, 2)
    assert big["samples_per_second"] is None and big["loss"] is None  # overflowed: unknown
    (pipe,) = view["pipelines"]
    assert pipe["missing"] == [1] and pipe["coverage"] == 0.5
    assert set(data["history"]["series"]) == {"alpha", "big"}

    status, headers, body = _get(url)
    assert status == 200 and b'<script src="/app.js"' in body and b"<script>" not in body
    assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    assert "unsafe" not in CONTENT_SECURITY_POLICY and "http" not in CONTENT_SECURITY_POLICY
    assert headers["X-Content-Type-Options"] == "nosniff"
    for path in ("app.js", "style.css", "index.html", "favicon.svg"):
        assert _get(url + path)[0] == 200, path
    for path in ("nothing", "api/nothing", "static/app.js", "../pyproject.toml", "%2e%2e/"):
        status, headers, _ = _get(url + path)
        assert status == 404 and headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    status, headers, body = _get(url + "api/view", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
    for method in ("POST", "PUT", "DELETE"):
        status, headers, _ = _get(url + "api/view", method=method)
        assert status == 405 and headers["Allow"] == "GET, HEAD", method
    reply = _raw(url, b"<script> /api/view HTTP/1.1\r\n\r\n")  # the stdlib's 501, our way
    assert reply.startswith(b"HTTP/1.0 501 ") and b"text/plain" in reply, reply
    assert f"Content-Security-Policy: {CONTENT_SECURITY_POLICY}".encode() in reply
    assert b"<html" not in _raw(url, b"GET / BOGUS/1.0\r\n\r\n").lower()
    # On loopback, a page of another site whose name resolves to 127.0.0.1 is refused.
    assert _get(url + "api/view", headers={"Host": "evil.example:80"})[0] == 403
    assert _get(url + "api/view", headers={"Host": "localhost:9999"})[0] == 200


def test_the_server_listens_on_ipv6_loopback() -> None:
    server = DashboardServer()
    try:
        port = server.start("::1", 0)
    except OSError as e:
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        status, _, body = _get(f"http://[::1]:{port}/api/view")
        assert status == 200 and _strict_json(body) == {"view": None, "history": None}
    finally:
        server.close()


def test_the_dashboard_imports_no_torch() -> None:
    code = "import sys, swarm.dashboard.command; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False"


# --- a real training swarm as processes, the page in headless Chromium -------------------


class Process:
    """A ``swarm`` command as a child process whose stdout and stderr are read by
    threads (so it never blocks on a full pipe) and searched with a deadline."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*SWARM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def line(self, pattern: str, timeout: float = 60.0) -> str:
        """Its first line (stdout or stderr, so far or within ``timeout`` s) matching
        ``pattern``."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.seen:
                if re.search(pattern, line):
                    return line
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc.poll() is not None and self.lines.empty()):
                break
            with contextlib.suppress(queue.Empty):
                self.seen.append(self.lines.get(timeout=min(left, 1.0)))
        raise AssertionError(f"no line matching {pattern!r} (exit {self.proc.poll()}): {self.seen}")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 10 s; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


@dataclasses.dataclass
class Swarm:
    boot: str
    url: str


@pytest.fixture(scope="module")
def training_swarm() -> Iterator[Swarm]:
    """A bootstrap peer, two trainers (digits, publishing their status every 2 s, the
    shortest interval) and a dashboard, all real processes."""
    processes: list[Process] = []

    def start(*args: str) -> Process:
        processes.append(Process(*args))
        return processes[-1]

    try:
        boot = start("bootstrap", *LOCAL, "--status-interval", "2").line(r"^/ip4/")
        train = ["train", *LOCAL, "--initial-peers", boot, "--num-peers", "2"]
        train += ["--num-samples", str(64 * 100_000), "--num-threads", "1"]
        for _ in range(2):
            start(*train, "--status-interval", "2", "--progress", "none")
        dashboard = start("dashboard", "--initial-peers", boot, "--port", "0", "--refresh", "0.5")
        url = dashboard.line(r"^dashboard: http://").split()[1]
        yield Swarm(boot, url)
    finally:
        for process in processes:  # only ours, by PID
            process.stop()


def test_the_dashboard_command_serves_the_training_swarm(training_swarm: Swarm) -> None:
    def both_trainers_counted(view: dict[str, Any]) -> bool:
        # Each trainer publishes on its own clock: a view can hold a run that one trainer
        # has reported and the other not yet.
        return len(view["peers"]) >= 3 and any(r["num_peers"] == 2 for r in view["runs"])

    data = _api(training_swarm.url, both_trainers_counted)
    assert data["refresh_seconds"] == 0.5 and data["through"] == training_swarm.boot
    (run,) = data["view"]["runs"]
    assert run["run_id"] == "demo" and run["num_peers"] == 2
    headers = _get(training_swarm.url)[1]
    assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY


def test_a_dashboard_bound_beyond_loopback_warns_and_stops_on_sigterm(
    training_swarm: Swarm,
) -> None:
    dashboard = Process(
        "dashboard", "--initial-peers", training_swarm.boot, "--host", "0.0.0.0", "--port", "0"
    )
    try:
        port = dashboard.line(r"^dashboard: http://").rsplit(":", 1)[1].strip("/")
        assert "anyone who can reach it" in dashboard.line(r"^warning: serving on 0\.0\.0\.0")
        # Not on loopback: no Host check (the warning said who can see it).
        url = f"http://127.0.0.1:{port}/"
        assert _get(url, headers={"Host": "dashboard.example"})[0] == 200
    finally:
        assert dashboard.stop() == 0


def _browser() -> tuple[Any, str]:
    """Playwright and a headless system Chromium, or a skip saying what is missing."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]' installs it)")
    return sync_playwright, executable


def _artifact(name: str, tmp_path: Path) -> Path:
    """Where a screenshot goes: $SWARMTRAIN_ARTIFACTS if set, else the test's tmp_path."""
    folder = Path(os.environ.get("SWARMTRAIN_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


_SAMPLES = '.run[data-run-id="demo"] .run-samples'


def test_the_page_lists_the_peers_and_the_sample_count_rises(
    training_swarm: Swarm, tmp_path: Path
) -> None:
    sync_playwright, executable = _browser()
    _api(training_swarm.url, lambda v: len(v["peers"]) >= 3 and v["runs"])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(training_swarm.url)
            # Conditions are functions: playwright evaluates a bare expression with the
            # page's eval, which the dashboard's CSP (no 'unsafe-eval') refuses.
            page.wait_for_function(
                "() => document.querySelectorAll('#peers tbody tr').length >= 3", timeout=30_000
            )
            shown = page.locator("#peers tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.peerId)"
            )
            assert training_swarm.boot.rsplit("/p2p/", 1)[1] in shown
            samples = page.locator(_SAMPLES)
            samples.wait_for(timeout=30_000)
            first = int(samples.inner_text().replace(",", ""))
            page.wait_for_function(  # bounded polling by the browser, 30 s at most
                f"""() => {{
                    const node = document.querySelector('{_SAMPLES}');
                    return node && Number(node.textContent.replace(/,/g, '')) > {first};
                }}""",
                timeout=30_000,
            )
            later = int(samples.inner_text().replace(",", ""))
            assert later > first
            page.wait_for_function(
                "() => document.querySelectorAll('.run polyline').length >= 2"
                " && document.querySelector('#events').textContent.includes('run demo:')",
                timeout=30_000,
            )
            assert "behind NAT" not in page.inner_text("#peers")  # loopback: none is
            shot = _artifact("dashboard.png", tmp_path)
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}; samples shown {first} -> {later}")
            assert not errors, errors  # the CSP refused nothing the page needs
        finally:
            browser.close()


def test_markup_in_a_peer_record_shows_as_text(training_swarm: Swarm, tmp_path: Path) -> None:
    sync_playwright, executable = _browser()
    expert = "ffn.<img src=x onerror=window.pwned=2>"
    with BlockingDHT(config=DHTConfig(initial_peers=(training_swarm.boot,))) as node:
        hostile = PeerStatus(
            agent=HOSTILE,
            reachability="private",
            time=dht_time(),
            runs=(RunStatus(HOSTILE, 1, 1, 1.0, 0.5, 1, 0, 0),),
            served=(ServedStatus("expert", expert, 0, 0, 0, 0),),
            num_served=1,
        )
        assert node.peer.run(publish_status(node.node, hostile, 60.0), timeout=30)
        _api(training_swarm.url, lambda v: any(r["run_id"] == HOSTILE for r in v["runs"]))
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(training_swarm.url)
                page.wait_for_function(
                    "() => document.querySelectorAll('.run').length >= 2", timeout=30_000
                )
                assert f"run {HOSTILE}" in page.locator(".run-id").all_inner_texts()
                assert HOSTILE in page.inner_text("#peers")  # its agent, and its run
                assert "behind NAT" in page.inner_text("#peers")
                assert expert in page.inner_text("#experts")
                assert page.evaluate("typeof window.pwned") == "undefined"
                assert page.locator("main script, main b, main img").count() == 0
                shot = _artifact("dashboard-markup.png", tmp_path)
                page.screenshot(path=str(shot))
                print(f"screenshot: {shot}")
            finally:
                browser.close()


def test_a_port_in_use_or_out_of_range_is_a_usage_error() -> None:
    peer = f"/ip4/127.0.0.1/tcp/9/p2p/{KeyPair.generate().peer_id}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, message in (
            (["--port", str(port)], f"--port {port}: cannot listen"),
            (["--port", "70000"], "must be a port in [0, 65535]"),
            (["--refresh", "0.1"], "must be at least 0.5 s"),
        ):
            out = subprocess.run(
                [*SWARM, "dashboard", "--initial-peers", peer, *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 2, (args, out.stderr)
            assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
            assert out.stdout == ""
