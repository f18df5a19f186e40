"""A private swarm from the command line, as a team runs one: a bootstrap peer and two
trainers that list each other (``--identity``, ``--allow-file``) or share a swarm key
(``--swarm-key``) train one model, and a stranger that knows the bootstrap's address is
refused and told why it may be."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from peers import KeyPair
from peers.pnet import new_swarm_key, write_swarm_key

pytestmark = pytest.mark.timeout(240)

SWARM = [sys.executable, "-m", "swarm.cli"]
SAMPLES = ["--num-samples", "1280", "--listen", "/ip4/127.0.0.1/tcp/0", "--progress", "lines"]


@pytest.mark.parametrize("closed_by", ["allow-list", "swarm key"])
def test_members_train_together_and_a_stranger_cannot_join(tmp_path: Path, closed_by: str) -> None:
    keys = {name: tmp_path / f"{name}.key" for name in ("boot", "alice", "bob")}
    team = tmp_path / "team.txt"
    team.write_text(
        "".join(f"{KeyPair.load_or_create(k).peer_id}  # {n}\n" for n, k in keys.items())
    )
    private = ["--allow-file", str(team)]
    refusal = "a private swarm that does not allow our peer ID"
    if closed_by == "swarm key":
        write_swarm_key(tmp_path / "team.psk", new_swarm_key())
        private = ["--swarm-key", str(tmp_path / "team.psk")]
        refusal = "talks only to peers with its swarm key: --swarm-key PATH"
    identity = ["--identity", str(keys["boot"])]
    boot = subprocess.Popen(
        [*SWARM, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", *identity, *private],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert boot.stdout is not None
        addr = boot.stdout.readline().strip()  # bounded by the pytest timeout
        assert addr.endswith(str(KeyPair.load(keys["boot"]).peer_id)), addr
        join = [*SWARM, "join", "--initial-peers", addr, *SAMPLES]
        members = [
            subprocess.Popen(
                [*join, "--num-peers", "2", "--identity", str(keys[name]), *private],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name in ("alice", "bob")
        ]
        stranger = subprocess.run(join, capture_output=True, text=True, timeout=120)
        results = [m.communicate(timeout=180) for m in members]
    finally:
        boot.kill()
        boot.communicate(timeout=10)
    assert stranger.returncode == 1
    assert refusal in stranger.stderr, stranger.stderr
    assert "none of the 1 initial peers answered" in stranger.stderr
    for member, (out, err) in zip(members, results, strict=True):
        assert member.returncode == 0, out + err
        assert "done: 20 epochs" in out, out
        assert "(0 alone)" in out, out  # every step averaged with the other member
    metrics = {line for out, _ in results for line in out.splitlines() if "test metrics" in line}
    assert len(metrics) == 1, metrics  # one model
