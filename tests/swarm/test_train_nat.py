"""``swarm train`` and ``swarm join`` across home routers (the namespace lab).

The scenario of the report that opened the NAT work: a public peer runs ``swarm train``,
and two laptops, each behind its own home router and both with the same private
address, run ``swarm join``. Before address hygiene they announced that shared private
address, dialed each other's routers' LANs by mistake and split the swarm; now they find
themselves behind NAT, announce no direct address, take part as clients, and the three
end with one model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from peers.netlab import Lab, PublicHost, lab_available

AVAILABLE, REASON = lab_available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=REASON), pytest.mark.timeout(300)]

SWARM = [sys.executable, "-m", "swarm.cli"]
STEPS = 50
SIZES = ["--num-peers", "3", "--num-samples", str(64 * STEPS), "--num-threads", "1"]
#: ``swarm train`` hosts a bootstrap peer besides its trainer, both on ``--listen``: a
#: fixed port would be taken twice, so the public peer takes free ports.
SERVER_LISTEN = ["--listen", "/ip4/0.0.0.0/tcp/0", "--progress", "lines"]
LAPTOP_LISTEN = ["--listen", "/ip4/0.0.0.0/tcp/4001", "--progress", "lines"]


def start_public_trainer(
    server: PublicHost, sizes: list[str]
) -> tuple[subprocess.Popen[str], list[str], str]:
    """``swarm train`` on a public host: the process, what it printed up to its join
    command, and the address that command names."""
    proc = server.popen(
        [*SWARM, "train", *SERVER_LISTEN, "--rank", "0", *sizes],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    head = []
    for line in proc.stdout:  # bounded by the pytest timeout
        head.append(line)
        found = re.search(r" join --initial-peers (/ip4/198\.18\.\S+)", line)
        if found:
            return proc, head, found.group(1)
    raise AssertionError(f"no join command printed: {''.join(head)}")


def test_two_laptops_behind_nat_with_one_private_address_train_with_a_public_peer() -> None:
    with Lab() as lab:
        server = lab.add_public_host("server")
        laptops = [
            lab.add_lan_host(lab.add_home_router("home1", nat="endpoint-independent"), "laptop1"),
            lab.add_lan_host(lab.add_home_router("home2", nat="symmetric"), "laptop2"),
        ]
        first, head, join_addr = start_public_trainer(server, SIZES)
        joiners = [
            laptop.popen(
                [
                    *SWARM,
                    "join",
                    "--initial-peers",
                    join_addr,
                    *LAPTOP_LISTEN,
                    "--rank",
                    str(rank),
                    *SIZES,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank, laptop in enumerate(laptops, 1)
        ]
        out_first, err_first = first.communicate(timeout=240)
        results = [proc.communicate(timeout=120) for proc in joiners]
    assert first.returncode == 0, err_first
    outputs = ["".join(head) + out_first, *(out for out, _ in results)]
    for proc, (out, err) in zip(joiners, results, strict=True):
        assert proc.returncode == 0, out + err
        assert re.search(r"behind NAT( \([^)]*\))?: reachable through", out), out
    for out in outputs:
        assert f"done: {STEPS} epochs" in out, out
        assert "the swarm split" not in out, out
    metrics = [re.search(r"test metrics: loss (\S+), accuracy (\S+)", out) for out in outputs]
    assert all(m is not None for m in metrics), outputs
    # One model: gradient averaging makes every peer's parameters the same.
    assert len({m.groups() for m in metrics if m is not None}) == 1, metrics


def test_a_laptop_killed_mid_training_costs_the_others_nothing() -> None:
    sizes = ["--num-peers", "4", "--num-samples", str(64 * STEPS), "--num-threads", "1"]
    with Lab() as lab:
        server = lab.add_public_host("server")
        kinds = ("endpoint-independent", "endpoint-independent", "symmetric")
        laptops = [
            lab.add_lan_host(lab.add_home_router(f"home{i}", nat=kind), f"laptop{i}")
            for i, kind in enumerate(kinds, 1)
        ]
        first, head, join_addr = start_public_trainer(server, sizes)
        joiners = []
        for rank, laptop in enumerate(laptops, 1):
            progress = "json" if rank == 3 else "lines"
            argv = [*SWARM, "join", "--initial-peers", join_addr, *sizes]
            argv += ["--listen", "/ip4/0.0.0.0/tcp/4001", "--progress", progress]
            argv += ["--rank", str(rank)]
            joiners.append(
                laptop.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        victim = joiners[2]  # behind the symmetric NAT: reached through nobody but itself
        assert victim.stdout is not None
        for line in victim.stdout:  # bounded by the pytest timeout
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("samples", 0) >= 64 * 15:
                break
        victim.kill()  # SIGKILL, a laptop whose lid closed mid-round
        victim.communicate(timeout=30)
        out_first, err_first = first.communicate(timeout=240)
        results = [proc.communicate(timeout=120) for proc in joiners[:2]]
    assert first.returncode == 0, err_first
    outputs = ["".join(head) + out_first, *(out for out, _ in results)]
    for proc, (out, err) in zip(joiners[:2], results, strict=True):
        assert proc.returncode == 0, out + err
    for out in outputs:
        assert f"done: {STEPS} epochs" in out, out
    metrics = [re.search(r"test metrics: loss (\S+), accuracy (\S+)", out) for out in outputs]
    assert all(m is not None for m in metrics), outputs
    assert len({m.groups() for m in metrics if m is not None}) == 1, metrics
