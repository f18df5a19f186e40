"""Metrics (``swarm.metrics``, ``--metrics``): the families a scrape builds, a peer and
its DHT scraped over HTTP from another thread while the loop serves, and a training
peer started from the command line whose samples and rounds rise between scrapes."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from peers import Peer
from peers.dht import DHT, DHTConfig
from peers.traffic import TrafficBook
from swarm.collaborative.config import OptimizerStatistics
from swarm.metrics import (
    MetricsServer,
    TrainingSnapshot,
    dht_families,
    loop_runner,
    parse_metrics_address,
    peer_families,
    traffic_families,
)

SWARM = [sys.executable, "-m", "swarm.cli"]
LOCAL = ["--listen", "/ip4/127.0.0.1/tcp/0"]


def _scrape(port: int) -> dict[str, float]:
    """Every sample of ``/metrics`` on ``port``, by name (labels joined in)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


@pytest.mark.parametrize(
    ("text", "expected"),
    [("9100", ("127.0.0.1", 9100)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:9", ("::1", 9))],
)
def test_metrics_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_metrics_address(text) == expected


@pytest.mark.parametrize("text", ["", "x", "host:", ":9100", "1:70000", "a:b"])
def test_bad_metrics_addresses_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not PORT or HOST:PORT"):
        parse_metrics_address(text)


def test_a_peer_and_its_dht_are_scraped_from_another_thread_while_the_loop_serves() -> None:
    """The scrape runs on the HTTP server's thread; the statistics are read on the loop,
    which keeps serving: a second peer joins between two scrapes, and both show it."""

    async def main() -> None:
        async with Peer() as a, DHT(a, DHTConfig()) as dht_a:
            server = MetricsServer()
            server.add_loop_source(
                loop_runner(asyncio.get_running_loop()),
                lambda: peer_families(a.statistics()) + dht_families(dht_a.statistics()),
            )
            port = server.start("127.0.0.1", 0)
            try:
                before = await asyncio.to_thread(_scrape, port)
                assert before["swarm_peer_connections"] == 0
                assert before["swarm_dht_contacts"] == 0
                config = DHTConfig(initial_peers=(str(a.listen_addrs[0]),))
                async with Peer() as b, DHT(b, config):
                    after = await asyncio.to_thread(_scrape, port)
                assert after["swarm_peer_connections"] == 1
                assert after["swarm_dht_contacts"] == 1
                assert after["swarm_dht_rpcs_served_total{rpc=find_node}"] >= 1
                find_node = "protocol=/swarmtrain/dht/find-node/1.0.0"
                assert after[f"swarm_peer_protocol_bytes_received_total{{{find_node}}}"] > 0
                assert after[f"swarm_peer_protocol_bytes_sent_total{{{find_node}}}"] > 0
                assert server.sample("swarm_peer_connections") is not None  # from Python too
            finally:
                server.close()

    asyncio.run(main())


def test_call_latencies_are_a_histogram_by_protocol() -> None:
    book = TrafficBook()
    for seconds in (0.002, 0.2, 3.0):
        book.call_ended("/p/1", seconds, failed=seconds > 1)
    server = MetricsServer()
    server.add_source(lambda: traffic_families(book.snapshot()))
    labels = {"protocol": "/p/1"}
    assert server.sample("swarm_peer_call_seconds_count", labels) == 3
    assert server.sample("swarm_peer_call_seconds_sum", labels) == pytest.approx(3.202)
    assert server.sample("swarm_peer_call_seconds_bucket", {**labels, "le": "0.0025"}) == 1
    assert server.sample("swarm_peer_call_seconds_bucket", {**labels, "le": "0.25"}) == 2
    assert server.sample("swarm_peer_call_seconds_bucket", {**labels, "le": "+Inf"}) == 3
    assert server.sample("swarm_peer_call_failures_total", labels) == 1
    assert server.sample("swarm_peer_stream_call_seconds_count", labels) is None
    book.stream_call_ended("/p/1", 0.7, failed=True)
    assert server.sample("swarm_peer_stream_call_seconds_count", labels) == 1
    assert server.sample("swarm_peer_stream_call_seconds_bucket", {**labels, "le": "0.5"}) == 0
    assert server.sample("swarm_peer_stream_call_failures_total", labels) == 1
    assert server.sample("swarm_peer_call_seconds_count", labels) == 3  # unary ones apart


def test_training_metrics_appear_with_the_first_step() -> None:
    snapshot = TrainingSnapshot()
    assert snapshot.families() == []
    stats: Any = OptimizerStatistics(
        epoch=3,
        local_steps=7,
        local_samples=448,
        num_rounds=2,
        num_rounds_alone=1,
        num_state_loads=0,
        num_splits=0,
        bytes_sent=1000,
        num_peers=2,
        samples_per_second=120.5,
        num_rounds_not_agreed=1,
        num_rounds_without_group=0,
        round_seconds=0.25,
        matchmaking_seconds=0.1,
        allreduce_seconds=0.15,
        wait_seconds=2.5,
        reducer_spread=1000.0,
    )
    snapshot.publish(stats, 0.75)
    server = MetricsServer()
    server.add_source(snapshot.families)
    assert server.sample("swarm_train_epoch") == 3
    assert server.sample("swarm_train_local_samples_total") == 448
    assert server.sample("swarm_train_rounds_total") == 2
    assert server.sample("swarm_train_loss") == 0.75
    assert server.sample("swarm_train_rounds_not_agreed_total") == 1
    assert server.sample("swarm_train_round_seconds_total") == 0.25
    assert server.sample("swarm_train_matchmaking_seconds_total") == 0.1
    assert server.sample("swarm_train_allreduce_seconds_total") == 0.15
    assert server.sample("swarm_train_wait_seconds_total") == 2.5
    assert server.sample("swarm_train_reducer_spread") == 1000.0


def test_a_training_peer_started_with_metrics_shows_samples_and_rounds_rising() -> None:
    """``swarm train --metrics 0`` and a joiner: scraped twice, a second apart, while
    they train, the first peer's samples and averaging rounds rise; its connections
    and DHT show the other peer."""
    train = [*SWARM, "train", *LOCAL, "--num-samples", str(64 * 3000), "--num-threads", "1"]
    first = subprocess.Popen(
        [*train, "--num-peers", "2", "--metrics", "0", "--status-interval", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second: subprocess.Popen[str] | None = None
    try:
        assert first.stdout is not None and first.stderr is not None
        port = None
        for line in first.stderr:  # bounded by the pytest timeout
            found = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None
        command = None
        for line in first.stdout:
            found = re.search(r" (join --initial-peers \S+ .*)", line)
            if found:
                command = found.group(1)
                break
        assert command is not None
        second = subprocess.Popen(
            [*SWARM, *command.split(), *LOCAL, "--num-threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        early: dict[str, float] = {}
        while time.monotonic() < deadline:  # until both train (rounds with a peer)
            early = _scrape(port)
            if early.get("swarm_train_rounds_total", 0) >= 1:
                break
            time.sleep(0.2)
        time.sleep(1.0)
        late = _scrape(port)
        status = _status_json(
            command.split()[2], lambda view: any(run["samples"] for run in view["runs"])
        )
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    for name in (
        "swarm_train_local_samples_total",
        "swarm_train_rounds_total",
        "swarm_train_round_seconds_total",
    ):
        assert late[name] > early[name] > 0, (name, early, late)
    # Every round in the duration histogram too, each one in some bucket.
    assert late["swarm_train_round_duration_seconds_count"] == late["swarm_train_rounds_total"]
    assert (
        late["swarm_train_round_duration_seconds_bucket{le=+Inf}"]
        == late["swarm_train_rounds_total"]
    )
    assert late["swarm_train_round_duration_seconds_sum"] == pytest.approx(
        late["swarm_train_round_seconds_total"]
    )
    assert late["swarm_train_peers"] == 2
    assert late["swarm_peer_connections"] >= 1 and late["swarm_dht_contacts"] >= 1
    assert late["swarm_peer_relayed_connections"] == 0  # loopback: all direct
    (run,) = status["runs"]  # the first peer's status record, as `swarm status` shows it
    assert run["run_id"] == "demo" and run["samples"] > 0 and run["loss"] is not None
    # Both trainers and the first one's hosted bootstrap publish their records.
    assert sum(1 for p in status["peers"] if p["agent"].startswith("swarmtrain/")) == 3


def _status_json(addr: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``swarm status --json`` through ``addr``, until ``done`` says the view is what
    the test waits for (at most 30 s of tries)."""
    view: dict[str, Any] = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = subprocess.run(
            [*SWARM, "status", "--initial-peers", addr, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        view = json.loads(out.stdout)
        if done(view):
            break
        time.sleep(0.5)
    return view
