"""The swarm's view from status records (pure), and ``swarm status`` on real peers."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time

from peers import KeyPair
from peers.dht import BlockingDHT, DHTConfig, dht_time
from peers.dht.status import PeerStatus, RunStatus, ServedStatus
from swarm.status import publish_status, read_statuses
from swarm.status_view import Contact, summarize
from tests.swarm.test_metrics import _status_json

SWARM = [sys.executable, "-m", "swarm.cli"]
NOW = 5000.0


def trainer(run: str, epoch: int, loss: float | None, rate: float, failed: int = 0) -> PeerStatus:
    runs = (RunStatus(run, epoch, 100 * epoch, rate, loss, 3, epoch, failed),)
    return PeerStatus(agent="swarmtrain/0.1.0", reachability="public", time=NOW - 1, runs=runs)


def server(*served: ServedStatus, reach: str = "private") -> PeerStatus:
    return PeerStatus("swarmtrain/0.1.0", reach, NOW - 2, served=served, num_served=len(served))


def test_runs_sum_throughput_and_take_medians_of_claims() -> None:
    ids = [KeyPair.generate().peer_id for _ in range(4)]
    statuses = {
        ids[0]: trainer("demo", 10, 0.5, 100.0),
        ids[1]: trainer("demo", 11, 0.4, 120.0, failed=2),
        ids[2]: trainer("demo", 10**9, 1e9, 80.0),  # a liar: moves neither median far
        ids[3]: trainer("other", 1, None, 5.0),
    }
    view = summarize(statuses, [], NOW)
    demo, other = view.runs
    assert (demo.run_id, demo.num_peers, demo.epoch, demo.loss) == ("demo", 3, 11, 0.5)
    assert demo.samples_per_second == 300.0 and demo.num_rounds_failed == 2
    assert demo.samples == 100 * (10 + 11 + 10**9) and demo.num_rounds == 10**9
    assert (other.epoch, other.loss) == (1, None)
    assert [p.seconds_ago for p in view.peers] == [1.0, 1.0, 1.0, 1.0]


def test_pipelines_show_coverage_and_the_stages_nobody_serves() -> None:
    ids = [KeyPair.generate().peer_id for _ in range(4)]
    statuses = {
        ids[0]: server(ServedStatus("stage", "lm", 0, 4, 5, 10)),
        ids[1]: server(ServedStatus("stage", "lm", 0, 4, 1, 10)),
        ids[2]: server(ServedStatus("stage", "lm", 2, 4, 0, 10), reach="relayed"),
        ids[3]: server(*(ServedStatus("expert", f"ffn.{i}", 0, 0, i, 7) for i in range(3))),
    }
    view = summarize(statuses, [], NOW)
    (lm,) = view.pipelines
    assert lm.servers == (2, 0, 1, 0) and lm.queued == (6, 0, 0, 0)
    assert lm.coverage == 0.5 and lm.missing == (1, 3)
    assert [(e.uid, e.num_servers, e.queued) for e in view.experts] == [
        ("ffn.0", 1, 0),
        ("ffn.1", 1, 1),
        ("ffn.2", 1, 2),
    ]
    text = "\n".join(view.lines())
    assert "lm" in text and "50%" in text and "no server for stage 1, 3" in text
    assert "behind NAT" in text and "private" not in text  # as the dashboard says it
    as_json = json.loads(json.dumps(view.to_json()))
    assert as_json["pipelines"][0]["missing"] == [1, 3]
    assert {p["reachability"] for p in as_json["peers"]} == {"private", "relayed"}


def test_peers_without_a_record_are_listed_as_unknown_with_their_addresses() -> None:
    known, silent = KeyPair.generate().peer_id, KeyPair.generate().peer_id
    contacts = [
        Contact(silent, ("/ip4/198.18.0.1/tcp/1",), None),
        Contact(known, ("/ip4/198.18.0.2/tcp/2",), 3.0),
    ]
    view = summarize({known: trainer("demo", 1, 0.3, 1.0)}, contacts, NOW)
    rows = {r.peer_id: r for r in view.peers}
    assert rows[str(silent)].reachability == "unknown" and rows[str(silent)].seconds_ago is None
    assert rows[str(known)].addrs == ("/ip4/198.18.0.2/tcp/2",)
    assert rows[str(known)].runs == ("demo",)
    assert view.peers[-1].peer_id == str(silent)  # never heard of last


def test_swarm_status_shows_runs_stages_experts_and_reachability() -> None:
    """A bootstrap process publishing its status, three in-process peers publishing
    theirs (a trainer whose run id is markup, a stage server, an expert server), and
    ``swarm status`` (text and --json) as a user runs it."""
    boot = subprocess.Popen(
        [*SWARM, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--status-interval", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    nodes: list[BlockingDHT] = []
    try:
        assert boot.stdout is not None
        addr = boot.stdout.readline().strip()  # bounded by the pytest timeout
        hostile = "<script>alert(1)</script>"
        published = [
            PeerStatus(
                "swarmtrain/0.1.0",
                "public",
                0.0,
                (RunStatus(hostile, 4, 512, 90.0, 0.25, 2, 4, 1),),
            ),
            PeerStatus(
                "swarmtrain/0.1.0",
                "relayed",
                0.0,
                (),
                (ServedStatus("stage", "lm", 1, 3, 2, 9),),
                1,
            ),
            PeerStatus(
                "swarmtrain/0.1.0",
                "private",
                0.0,
                (),
                (ServedStatus("expert", "ffn.0", 0, 0, 0, 5),),
                1,
            ),
        ]
        for status in published:
            node = BlockingDHT(config=DHTConfig(initial_peers=(addr,)))
            nodes.append(node)
            fresh = dataclasses.replace(status, time=dht_time())
            assert node.peer.run(publish_status(node.node, fresh, 60.0), timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the bootstrap's own record, every 2 s
            found = nodes[0].peer.run(read_statuses(nodes[0].node), timeout=30)
            if len(found) == 4:
                break
            time.sleep(0.5)
        assert len(found) == 4  # the bootstrap's own record too
        view = _status_json(addr, lambda view: len(view["peers"]) >= 4)
        assert len(view["peers"]) >= 4
        reach = {p["peer_id"]: p["reachability"] for p in view["peers"]}
        assert [reach[str(n.peer.peer_id)] for n in nodes] == ["public", "relayed", "private"]
        boot_id = addr.rsplit("/p2p/", 1)[1]
        assert reach[boot_id] == "unknown"  # loopback only: nobody dialed it back
        (run,) = view["runs"]
        assert (run["run_id"], run["epoch"], run["loss"], run["num_rounds_failed"]) == (
            hostile,
            4,
            0.25,
            1,
        )
        (pipe,) = view["pipelines"]
        assert (pipe["uid_prefix"], pipe["servers"], pipe["missing"]) == ("lm", [0, 1, 0], [0, 2])
        assert [e["uid"] for e in view["experts"]] == ["ffn.0"]
        text = subprocess.run(
            [*SWARM, "status", "--initial-peers", addr], capture_output=True, text=True, timeout=60
        )
        assert text.returncode == 0, text.stderr
        assert "1 runs, 1 experts, 1 pipelines" in text.stdout
        assert "no server for stage 0, 2" in text.stdout and hostile in text.stdout
    finally:
        for node in nodes:
            node.close()
        boot.send_signal(signal.SIGTERM)
        try:
            boot.wait(timeout=10)
        finally:
            if boot.poll() is None:
                boot.kill()
            boot.communicate(timeout=10)
