"""The ``swarm`` command as a user runs it: real processes, real sockets. Its bad options,
refused before anything starts, are checked in this process (``main(argv)``,
:mod:`tests.swarm.cli_inprocess`); test_cli_usage.py runs one in a real process."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from peers import KeyPair
from tests.swarm.cli_inprocess import INPROCESS_TIMEOUT, run_cli

SWARM = [sys.executable, "-m", "swarm.cli"]


def _start_bootstrap(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [*SWARM, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()  # bounded by the pytest timeout
    if not first:
        proc.kill()
        raise AssertionError(f"bootstrap printed nothing: {proc.communicate(timeout=10)}")
    return proc, [first]


@pytest.fixture
def bootstrap(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    key = tmp_path / "boot.key"
    proc, addrs = _start_bootstrap("--identity", str(key))
    try:
        yield proc, addrs[0], key
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_bootstrap_prints_full_multiaddr_with_persistent_identity(
    bootstrap: tuple[subprocess.Popen[str], str, Path],
) -> None:
    proc, addr, key = bootstrap
    identity = KeyPair.load(key)
    assert addr.startswith("/ip4/127.0.0.1/tcp/")
    assert addr.endswith(f"/p2p/{identity.peer_id}")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_a_loopback_only_bootstrap_warns_that_other_machines_cannot_reach_it() -> None:
    proc, _ = _start_bootstrap()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=10)
    assert "warning: only loopback addresses: peers on other machines cannot reach" in stderr


def test_bootstrap_exits_zero_on_sigint(tmp_path: Path) -> None:
    proc, _ = _start_bootstrap()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 0
    proc.communicate(timeout=10)


def test_ping_prints_peer_protocols_and_rtts(
    bootstrap: tuple[subprocess.Popen[str], str, Path],
) -> None:
    _, addr, key = bootstrap
    out = subprocess.run(
        [*SWARM, "ping", addr, "--count", "2"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert f"peer:      {KeyPair.load(key).peer_id}" in out.stdout
    assert "/ipfs/ping/1.0.0" in out.stdout and "/swarmtrain/echo/1.0.0" in out.stdout
    assert "security:  /swarmtrain/noise-aesgcm/2.0.0" in out.stdout  # ours with ours
    assert out.stdout.count(" ms") == 2


def test_ping_wrong_peer_id_fails_clearly(
    bootstrap: tuple[subprocess.Popen[str], str, Path],
) -> None:
    _, addr, _ = bootstrap
    impostor = KeyPair.generate().peer_id
    wrong = addr.rsplit("/p2p/", 1)[0] + f"/p2p/{impostor}"
    out = subprocess.run([*SWARM, "ping", wrong], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "but the remote is" in out.stderr
    assert str(impostor) in out.stderr


def test_a_private_bootstrap_answers_its_members_only(tmp_path: Path) -> None:
    """``--allow-file`` (with a comment and a blank line) and ``--allow``: a listed key
    pings it; a stranger is hung up on right after its handshake and told why that
    may be, and the bootstrap keeps serving its members."""
    member, other = KeyPair.generate(), KeyPair.generate()
    member.save(tmp_path / "member.key")
    allow_file = tmp_path / "team.txt"
    allow_file.write_text(f"# the team\n{member.peer_id}  # alice\n\n")
    proc, addrs = _start_bootstrap("--allow-file", str(allow_file), "--allow", str(other.peer_id))
    _member_stranger_member(
        proc,
        [*SWARM, "ping", addrs[0], "--count", "1"],
        ["--identity", str(tmp_path / "member.key")],
        "a private swarm that does not allow our peer ID",
    )


def _member_stranger_member(
    bootstrap: subprocess.Popen[str], ping: list[str], member: list[str], refusal: str
) -> None:
    """Ping ``bootstrap`` as a member (``ping`` + ``member``), as a stranger (told
    ``refusal``), and as a member again: it keeps serving. Stops it."""
    try:
        for args, code in (([*ping, *member], 0), (ping, 1), ([*ping, *member], 0)):
            out = subprocess.run(args, capture_output=True, text=True, timeout=60)
            assert out.returncode == code, out.stderr
            if code == 0:
                assert "ping 1:" in out.stdout
            else:
                assert refusal in out.stderr
    finally:
        bootstrap.kill()
        bootstrap.communicate(timeout=10)


def test_a_private_network_bootstrap_answers_key_holders_only(tmp_path: Path) -> None:
    """``swarm swarm-key`` makes a key (never over an existing file); a bootstrap with
    ``--swarm-key`` answers a ping that has the key, not one without (told why), and
    keeps serving."""
    key = tmp_path / "team.key"
    made = subprocess.run([*SWARM, "swarm-key", str(key)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert f"--swarm-key {key}" in made.stdout
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    again = subprocess.run([*SWARM, "swarm-key", str(key)], capture_output=True, text=True)
    assert again.returncode == 2 and "give a path where no file exists" in again.stderr
    proc, addrs = _start_bootstrap("--swarm-key", str(key))
    _member_stranger_member(
        proc,
        [*SWARM, "ping", addrs[0], "--count", "1", "--timeout", "5"],
        ["--swarm-key", str(key)],
        "--swarm-key PATH",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ping_unreachable_fails_clearly() -> None:
    port = _free_port()
    out = subprocess.run(
        [*SWARM, "ping", f"/ip4/127.0.0.1/tcp/{port}"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert "cannot connect" in out.stderr and str(port) in out.stderr


def test_ping_handshake_failure_fails_clearly() -> None:
    # A TCP server that is not libp2p: it answers with an HTTP response and closes.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve_once() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.settimeout(30)
            while conn.recv(4096):  # hold the connection until the client gives up
                pass

    thread = threading.Thread(target=serve_once, daemon=True)
    thread.start()
    try:
        out = subprocess.run(
            [*SWARM, "ping", f"/ip4/127.0.0.1/tcp/{port}", "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        thread.join(10)
        server.close()
    assert out.returncode == 1
    assert "multistream" in out.stderr or "handshake" in out.stderr


def test_help_lists_every_command() -> None:
    # `swarm demo` itself (a local training swarm) is tested in test_cli_train.py
    out = subprocess.run([*SWARM, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("bootstrap", "ping", "status", "train", "join", "demo"):
        assert command in out.stdout


def test_bootstrap_on_an_address_it_cannot_bind_fails_clearly() -> None:
    # a well-formed address that is not this machine's: found when binding, so exit 1
    # (malformed ones exit 2 before anything starts: test_cli_usage.py)
    out = subprocess.run(
        [*SWARM, "bootstrap", "--listen", "/ip4/203.0.113.7/tcp/0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr


@pytest.mark.parametrize("args", [["--count", "0"], ["--count", "x"], ["--timeout", "-1"]])
@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_ping_rejects_bad_options(args: list[str]) -> None:
    out = run_cli("ping", "/ip4/127.0.0.1/tcp/1", *args)
    assert out.returncode == 2 and "error: argument" in out.stderr


def test_second_bootstrap_joins_and_status_lists_both(tmp_path: Path) -> None:
    first, (first_addr,) = _start_bootstrap()
    second, (second_addr,) = _start_bootstrap("--initial-peers", first_addr)
    try:
        dead = (
            first_addr.rsplit("/tcp/", 1)[0]
            + f"/tcp/{_free_port()}/p2p/{KeyPair.generate().peer_id}"
        )
        out = subprocess.run(
            [*SWARM, "status", "--initial-peers", dead, first_addr, "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert f"warning: initial peer {dead} did not answer" in out.stderr
        for addr in (first_addr, second_addr):
            peer_id = addr.rsplit("/p2p/", 1)[1]
            line = next(line for line in out.stdout.splitlines() if line.startswith(peer_id))
            assert "s ago" in line and addr in line  # full PeerID, last seen, addresses
    finally:
        for proc in (first, second):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            proc.communicate(timeout=10)


def test_status_with_no_reachable_initial_peer_fails_clearly() -> None:
    dead = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{KeyPair.generate().peer_id}"
    out = subprocess.run(
        [*SWARM, "status", "--initial-peers", dead, "--timeout", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "error: none of the 1 initial peers answered" in out.stderr and dead in out.stderr
    assert "Traceback" not in out.stderr
