"""``swarm dashboard``: its history (pure), its HTTP answers, and the page in headless
Chromium while a real local swarm trains (processes on loopback)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peers import KeyPair
from peers.dht import BlockingDHT, DHTConfig, dht_time
from peers.dht.status import PeerStatus, RunStatus, ServedStatus
from swarm.dashboard.history import MAX_EVENTS, MAX_POINTS, History
from swarm.dashboard.server import CONTENT_SECURITY_POLICY
from swarm.status import publish_status
from swarm.status_view import summarize

SWARM = [sys.executable, "-m", "swarm.cli"]
LOCAL = ["--listen", "/ip4/127.0.0.1/tcp/0"]
HOSTILE = "<script>window.pwned=1</script><b>x</b>"


def _view(runs: dict[str, tuple[int, int, int]], peers: int, missing_stage: bool, now: float):  # type: ignore[no-untyped-def]
    ids = [KeyPair.generate().peer_id for _ in range(peers)]
    statuses = {}
    for i, (run_id, (samples, rounds, failed)) in enumerate(runs.items()):
        run = RunStatus(run_id, rounds, samples, 10.0, 0.5, 2, rounds, failed)
        statuses[ids[i]] = PeerStatus("swarmtrain/0.1.0", "public", now, (run,))
    stage = ServedStatus("stage", "lm", 0, 2 if missing_stage else 1, 0, 0)
    statuses[ids[-1]] = PeerStatus("swarmtrain/0.1.0", "relayed", now, (), (stage,), 1)
    return summarize(statuses, [], now), ids


def test_history_keeps_series_and_sees_rounds_failures_joins_and_leaves() -> None:
    history = History()
    first, _ = _view({"a": (10, 1, 0)}, 2, False, 100.0)
    history.update(first, 100.0)
    assert history.to_json()["events"] == []  # nothing changed yet: no events
    later, _ = _view({"a": (50, 4, 1), "b": (5, 0, 0)}, 3, True, 102.0)
    history.update(later, 102.0)
    events = history.to_json()["events"]
    assert isinstance(events, list)
    texts = [e["text"] for e in events]
    assert "run a: 3 rounds (epoch 4)" in texts and "run a: 1 rounds failed" in texts
    assert "pipeline lm: no server for stage 1" in texts
    assert sum(t.endswith("appeared") for t in texts) == 3
    assert sum(t.endswith("left") for t in texts) == 2
    again, _ = _view({"a": (60, 6, 1), "b": (6, 0, 0)}, 3, True, 104.0)
    history.update(again, 104.0)
    newest = history.to_json()["events"]
    assert isinstance(newest, list) and newest[0]["text"] == "run a: 2 rounds (epoch 6)"
    history.update(_view({"a": (70, 9, 1)}, 2, True, 106.0)[0], 106.0)
    history.update(_view({"a": (80, 10, 1)}, 2, True, 106.0)[0], 108.0)
    merged = history.to_json()["events"]
    assert isinstance(merged, list) and merged[0]["text"] == "run a: 1 rounds (epoch 10)"
    series = history.to_json()["series"]
    assert isinstance(series, dict)
    assert series["a"]["samples"] == [10, 50, 60, 70, 80] and series["b"]["samples"] == [5, 6]


def test_history_is_bounded() -> None:
    history = History()
    for i in range(MAX_POINTS + 10):
        view, _ = _view({"a": (i, i, i)}, 2, i % 2 == 0, float(i))
        history.update(view, float(i))
    assert len(history.series["a"]) == MAX_POINTS
    assert len(history.events) == MAX_EVENTS


@dataclasses.dataclass
class Swarm:
    boot: str
    url: str
    processes: list[subprocess.Popen[str]]


def _line(proc: subprocess.Popen[str], pattern: str) -> str:
    """The first stdout line of ``proc`` matching ``pattern`` (bounded by the pytest timeout)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(pattern, line):
            return line.strip()
    raise AssertionError(f"no line matching {pattern!r}: exited {proc.poll()}")


@pytest.fixture(scope="module")
def training_swarm() -> Iterator[Swarm]:
    """A bootstrap peer, two trainers (digits) and a dashboard, all real processes."""
    processes: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*SWARM, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        processes.append(proc)
        return proc

    try:
        boot = _line(start("bootstrap", *LOCAL, "--status-interval", "2"), r"^/ip4/")
        train = ["train", *LOCAL, "--initial-peers", boot, "--num-peers", "2"]
        train += [
            "--num-samples",
            str(64 * 100_000),
            "--num-threads",
            "1",
            "--status-interval",
            "2",
        ]
        for _ in range(2):
            start(*train, "--progress", "none")
        dashboard = start("dashboard", "--initial-peers", boot, "--port", "0", "--refresh", "0.5")
        url = _line(dashboard, r"^dashboard: http://").split()[1]
        yield Swarm(boot, url, processes)
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _api(swarm: Swarm, done: Any) -> dict[str, Any]:
    """``/api/view`` once ``done(view)`` holds (at most 60 s of tries)."""
    deadline = time.monotonic() + 60
    data: dict[str, Any] = {}
    while time.monotonic() < deadline:
        data = json.loads(_get(swarm.url + "api/view")[2])
        if data["view"] is not None and done(data["view"]):
            return data
        time.sleep(0.5)
    raise AssertionError(f"the view never got there: {data}")


def test_the_dashboard_serves_the_view_and_its_page_with_a_strict_policy(
    training_swarm: Swarm,
) -> None:
    data = _api(training_swarm, lambda v: len(v["peers"]) >= 3 and v["runs"])
    assert data["refresh_seconds"] == 0.5 and data["through"] == training_swarm.boot
    (run,) = data["view"]["runs"]
    assert run["run_id"] == "demo" and run["num_peers"] == 2
    status, headers, body = _get(training_swarm.url)
    assert status == 200 and b'<script src="/app.js"' in body
    assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in body.decode()
    assert _get(training_swarm.url + "app.js")[0] == 200
    assert _get(training_swarm.url + "style.css")[0] == 200
    assert _get(training_swarm.url + "../etc/passwd")[0] == 404
    assert _get(training_swarm.url + "api/nothing")[0] == 404


def _browser() -> Any:
    """A headless system Chromium through playwright, or a skip saying what is missing."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium on PATH (.ci/run installs Debian's)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (the test extra installs it)")
    return sync_playwright, executable


def _artifact(name: str, tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SWARMTRAIN_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def test_the_page_lists_the_peers_and_the_sample_count_rises(
    training_swarm: Swarm, tmp_path: Path
) -> None:
    sync_playwright, executable = _browser()
    _api(training_swarm, lambda v: len(v["peers"]) >= 3 and v["runs"])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(training_swarm.url)
            page.wait_for_function(
                "document.querySelectorAll('#peers tbody tr').length >= 3", timeout=30_000
            )
            shown = page.locator("#peers tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.peerId)"
            )
            boot_id = training_swarm.boot.rsplit("/p2p/", 1)[1]
            assert boot_id in shown
            samples = page.locator('.run[data-run-id="demo"] .run-samples')
            samples.wait_for(timeout=30_000)
            first = int(samples.inner_text().replace(",", ""))
            page.wait_for_function(
                f"""() => {{
                    const node = document.querySelector('.run[data-run-id="demo"] .run-samples');
                    return node && Number(node.textContent.replace(/,/g, '')) > {first};
                }}""",
                timeout=30_000,
            )
            later = int(samples.inner_text().replace(",", ""))
            assert later > first
            assert "behind NAT" not in page.inner_text("#peers")  # loopback: none is
            shot = _artifact("dashboard.png", tmp_path)
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}; samples {first} -> {later}")
            assert not errors, errors
        finally:
            browser.close()


def test_markup_in_a_peer_record_shows_as_text(training_swarm: Swarm, tmp_path: Path) -> None:
    sync_playwright, executable = _browser()
    with BlockingDHT(config=DHTConfig(initial_peers=(training_swarm.boot,))) as node:
        hostile = PeerStatus(
            agent=HOSTILE[:64],
            reachability="private",
            time=dht_time(),
            runs=(RunStatus(HOSTILE[:64], 1, 1, 1.0, 0.5, 1, 0, 0),),
            served=(ServedStatus("expert", "ffn.<img src=x onerror=alert(1)>"[:64], 0, 0, 0, 0),),
            num_served=1,
        )
        assert node.peer.run(publish_status(node.node, hostile, 60.0), timeout=30)
        _api(training_swarm, lambda v: any(r["run_id"] == HOSTILE for r in v["runs"]))
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(training_swarm.url)
                page.wait_for_function(
                    "document.querySelectorAll('.run').length >= 2", timeout=30_000
                )
                texts = page.locator(".run-id").all_inner_texts()
                assert f"run {HOSTILE}" in texts
                assert page.evaluate("typeof window.pwned") == "undefined"
                assert page.locator("#runs b, #runs script, #experts img").count() == 0
                assert HOSTILE in page.inner_text("#peers")
                assert "ffn.<img src=x onerror=alert(1)>" in page.inner_text("#experts")
                page.screenshot(path=str(_artifact("dashboard-markup.png", tmp_path)))
            finally:
                browser.close()


def test_a_port_in_use_or_out_of_range_is_a_usage_error() -> None:
    import socket

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
