"""``swarm serve``: hosting experts from the command line, as a user runs it. Its bad
configurations, refused before anything starts, are checked in this process
(``main(argv)``, :mod:`tests.swarm.cli_inprocess`)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
import torch

from peers import BlockingPeer, PeerConfig, PeerID
from swarm.experts import ExpertCallConfig, ExpertLocation, RemoteExpert
from tests.swarm.cli_inprocess import INPROCESS_TIMEOUT, run_cli
from tests.swarm.test_metrics import _scrape, _status_json

SWARM = [sys.executable, "-m", "swarm.cli"]


def test_serve_hosts_experts_until_sigterm() -> None:
    """Three experts served; one called forward and backward; ``--metrics`` shows the
    call's samples for that module (and none for the others)."""
    proc = subprocess.Popen(
        [
            *SWARM,
            "serve",
            *("--module", "linear", "--hidden-dim", "8", "--uids", "lin.0"),
            *("--expert-pattern", "lin.[1:3]", "--listen", "/ip4/127.0.0.1/tcp/0"),
            *("--optimizer", "sgd", "--lr", "0.1", "--seed", "0", "--metrics", "0"),
            *("--status-interval", "2"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        metrics = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/", proc.stderr.readline())
        assert metrics is not None
        maddr = proc.stdout.readline().strip()  # bounded by the pytest timeout
        assert maddr.startswith("/ip4/127.0.0.1/tcp/"), proc.stderr.read() if proc.stderr else ""
        assert proc.stdout.readline().strip() == "serving 3 experts: lin.0 lin.1 lin.2"
        peer_id = maddr.rsplit("/", 1)[1]
        with BlockingPeer(PeerConfig(listen_addrs=())) as client:
            client.connect(maddr, timeout=10)
            location = ExpertLocation("lin.2", PeerID.from_base58(peer_id))
            expert = RemoteExpert(location, client, ExpertCallConfig(forward_timeout=10))
            x = torch.randn(3, 8, requires_grad=True)
            out = expert(x)
            assert isinstance(out, torch.Tensor) and out.shape == (3, 8)
            out.sum().backward()
            assert x.grad is not None
            scraped = _scrape(int(metrics.group(1)))  # while the client is connected
        assert scraped["swarm_server_forward_samples_total{module=lin.2}"] == 3
        assert scraped["swarm_server_backward_samples_total{module=lin.2}"] == 3
        assert scraped["swarm_server_forward_samples_total{module=lin.0}"] == 0
        for direction in ("forward", "backward"):  # each request timed, queue to result
            key = f"swarm_server_call_seconds_count{{direction={direction},module=lin.2}}"
            assert scraped[key] == 1
        assert "swarm_server_call_seconds_count{direction=forward,module=lin.0}" not in scraped
        assert scraped["swarm_peer_connections"] >= 1
        status = _status_json(maddr, lambda view: any(e["num_batches"] for e in view["experts"]))
        assert [(e["uid"], e["num_servers"]) for e in status["experts"]] == [
            ("lin.0", 1),
            ("lin.1", 1),
            ("lin.2", 1),
        ]
        assert [e["num_batches"] > 0 for e in status["experts"]] == [False, False, True]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_serve_refuses_a_bad_config_with_a_clear_error() -> None:
    out = run_cli("serve", "--uids", "ffn")
    assert out.returncode == 2
    assert "invalid expert uid 'ffn'" in out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--uids", "ffn.0", "--linear-kernels", "mkl"],
        ["serve-stage", "--linear-kernels", ""],
    ],
)
@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_an_unknown_linear_kernel_is_refused_before_anything_starts(args: list[str]) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    assert "--linear-kernels: invalid choice" in out.stderr
