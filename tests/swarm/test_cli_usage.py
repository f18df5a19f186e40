"""User mistakes on the ``swarm`` command line: each one is a single line on stderr that
names the fix, exit code 2, nothing on stdout (no banner) and no traceback.

Most are checked in this process: ``main(argv)`` refuses them before anything starts
(:mod:`tests.swarm.cli_inprocess`), where a fresh ``python -m swarm.cli`` would import
torch again for each. Real processes (none trains or dials anything beyond loopback) stay
where the check needs one: the entry point itself (one bad flag); PyTorch missing, faked
in a fresh interpreter; a ``--metrics`` port held by another process; a ``--module``
factory, found wrong only once the server's peer and DHT have started; and
``--version``, which imports no torch (under a second)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from peers import KeyPair
from swarm.cli_usage import TORCH_INSTALL
from tests.swarm.cli_inprocess import INPROCESS_TIMEOUT, run_cli

SWARM = [sys.executable, "-m", "swarm.cli"]
LOCAL = ["--listen", "/ip4/127.0.0.1/tcp/0"]
#: An initial peer that never answers (no check here gets as far as dialing it).
DEAD_PEER = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEHcPYfshUhjJdxeGGP12Jikv4UWyTL12fnE2Yja3tfqH"
README = Path(__file__).resolve().parents[2] / "README.md"

# The command in a fresh interpreter in which importing torch fails, as on a machine
# where it was never installed (``sys.modules[name] = None`` makes the import raise).
_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
from swarm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _swarm(
    *args: str, without_torch: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", _WITHOUT_TORCH] if without_torch else SWARM
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def _assert_usage_error(out: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit code 2, one line on stderr holding ``message``, nothing printed before it."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "", out.stdout  # no banner, no address, no "training ..."
    assert "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr
    assert " error: " in out.stderr and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["join", "--initial-peers", "nonsense"], "--initial-peers: 'nonsense' is not a multiaddr"),
        (["train", "--initial-peers", "/ip4/1.2.3.4/tcp/x"], "is not a multiaddr"),
        (["train", *LOCAL, "--listen", "nonsense"], "--listen: 'nonsense' is not a multiaddr"),
        (["bootstrap", "--listen", "nonsense"], "--listen: 'nonsense' is not a multiaddr"),
        (["bootstrap", "--listen", "/ip4/127.0.0.1/udp/5"], "is not a TCP address; listen on"),
        (["bootstrap", "--announce", "/ip4/1.2.3.4/udp/1"], "is not a TCP address; announce"),
        (["status", "--initial-peers", "nonsense"], "--initial-peers: 'nonsense' is not a"),
        (["serve", "--uids", "ffn.0", "--initial-peers", "/dns/"], "is not a multiaddr"),
        (["serve-stage", "--listen", "/ip4/127.0.0.1"], "is not a TCP address"),
        (["ping", "/ip4/999.1.1.1/tcp/1"], "MADDR: '/ip4/999.1.1.1/tcp/1' is not a multiaddr"),
        # an initial peer is dialed by address and checked by identity: both are needed
        (["status", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "lacks the peer's /p2p/ID"),
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "lacks the peer's /p2p/ID"),
        (["dashboard", "--initial-peers", "/ip4/127.0.0.1/tcp/1"], "lacks the peer's /p2p/ID"),
    ],
)
@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_a_bad_multiaddr_exits_2_before_any_banner(args: list[str], message: str) -> None:
    out = run_cli(*args)
    _assert_usage_error(out, message)
    assert "e.g. /ip4/" in out.stderr  # what a good one looks like


def test_a_bad_flag_of_the_real_command_exits_2() -> None:
    # The checks in this file call main() in this process; this one runs `python -m
    # swarm.cli` itself, so that the entry point's exit code 2 (argparse's SystemExit)
    # and its one line on stderr stay covered.
    out = _swarm("bootstrap", "--listen", "nonsense")
    _assert_usage_error(out, "--listen: 'nonsense' is not a multiaddr")
    assert "e.g. /ip4/" in out.stderr


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_private_swarm_mistakes_exit_2_before_anything_starts(tmp_path: Path) -> None:
    """A bad --allow, a bad line in --allow-file (named by number), a missing file, and
    `swarm train --allow` with no bootstrap to join (a hosted one has a new ID each run)."""
    listed = tmp_path / "team.txt"
    listed.write_text("# the team\n12D3KooWnotapeerid\n")
    missing = tmp_path / "missing.txt"
    cases = [
        (["bootstrap", *LOCAL, "--allow", "nope"], "--allow: 'nope' is not a peer ID"),
        (["bootstrap", *LOCAL, "--allow-file", str(listed)], f"{listed}, line 2: "),
        (["serve-stage", *LOCAL, "--allow-file", str(missing)], "No such file or directory"),
        (
            ["join", "--initial-peers", DEAD_PEER, "--allow-file", str(missing)],
            "No such file or directory",
        ),
        (
            ["train", *LOCAL, "--allow", str(KeyPair.generate().peer_id)],
            "a private swarm cannot start from a bootstrap peer hosted here",
        ),
    ]
    for args, message in cases:
        _assert_usage_error(run_cli(*args), message)


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_a_bad_swarm_key_exits_2_before_anything_starts(tmp_path: Path) -> None:
    """A missing or malformed --swarm-key file, for a server, a trainer and a client."""
    bad = tmp_path / "bad.key"
    bad.write_text("/key/swarm/psk/1.0.0/\n/base16/\nabcd\n")
    missing = tmp_path / "missing.key"
    join = ["join", "--initial-peers", DEAD_PEER]
    cases = [
        (["bootstrap", *LOCAL, "--swarm-key", str(bad)], "a swarm key is 32 bytes, not 2"),
        ([*join, "--swarm-key", str(missing)], "cannot read swarm key"),
        (["ping", DEAD_PEER, "--swarm-key", str(bad)], "32 bytes"),
    ]
    for args, message in cases:
        out = run_cli(*args)
        _assert_usage_error(out, message)
        assert "swarm swarm-key PATH" in out.stderr


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_a_bad_peer_id_in_a_multiaddr_is_called_a_peer_id_not_a_cid() -> None:
    out = run_cli("join", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/nonsense")
    _assert_usage_error(out, "ends in /p2p/nonsense, which is not a peer ID")
    assert "CID" not in out.stderr


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_an_identity_in_a_missing_directory_exits_2(tmp_path: Path) -> None:
    key = tmp_path / "no-such-dir" / "boot.key"
    out = run_cli("bootstrap", *LOCAL, "--identity", str(key))
    _assert_usage_error(out, f"directory {key.parent} does not exist; create it")
    assert not key.parent.exists()


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_a_malformed_identity_exits_2(tmp_path: Path) -> None:
    key = tmp_path / "corrupt.key"
    key.write_bytes(b"definitely not a libp2p key")
    out = run_cli("bootstrap", *LOCAL, "--identity", str(key))
    _assert_usage_error(out, f"identity file {key} is not a valid libp2p key")
    assert "or a path where none exists to create one" in out.stderr


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_an_unreadable_identity_exits_2(tmp_path: Path) -> None:
    # a directory cannot be read as a file, whoever runs the test (root reads mode 000)
    out = run_cli("bootstrap", *LOCAL, "--identity", str(tmp_path))
    _assert_usage_error(out, f"cannot read identity file {tmp_path}")


@pytest.mark.parametrize("command", [["join", "--initial-peers", DEAD_PEER], ["train"]])
def test_train_without_torch_names_the_install_command(command: list[str]) -> None:
    out = _swarm(*command, *LOCAL, without_torch=True)
    _assert_usage_error(out, f"swarm {command[0]} needs PyTorch")
    assert f"install it with: {TORCH_INSTALL}" in out.stderr


def test_the_torch_install_command_is_the_one_the_readme_documents() -> None:
    documented = re.search(r"pip install -q (torch==\S+)", README.read_text())
    assert documented is not None and TORCH_INSTALL == f"pip install {documented[1]}"


_FACTORIES = """
from torch import nn

def module_only(hidden_dim):
    return nn.Linear(hidden_dim, hidden_dim)

def nothing(hidden_dim):
    return None
"""


@pytest.mark.parametrize(
    ("factory", "returned"), [("module_only", "returned a Linear;"), ("nothing", "returned None;")]
)
def test_a_module_factory_returning_the_wrong_thing_exits_2(
    tmp_path: Path, factory: str, returned: str
) -> None:
    # A real process: the factory is called, and found wrong, only after the server's
    # peer and DHT have started (so not in the test process).
    (tmp_path / "my_experts.py").write_text(_FACTORIES)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = _swarm(
        "serve",
        *LOCAL,
        "--uids",
        "ffn.0",
        "--hidden-dim",
        "8",
        "--module",
        f"my_experts:{factory}",
        env=env,
    )
    _assert_usage_error(out, f"module factory 'my_experts:{factory}' {returned}")
    assert "expected a tuple (torch.nn.Module, [TensorSpec, ...])" in out.stderr


def test_version_prints_the_package_version() -> None:
    out = _swarm("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"swarm {importlib.metadata.version('swarmtrain')}\n"


def test_no_command_says_it_runs_the_demo_and_where_help_is() -> None:
    # Without torch the demo stops at once, after the notice: it is the demo that starts.
    out = _swarm(without_torch=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    notice, error = out.stderr.splitlines()
    assert notice == (
        "swarm: no command given, so running the demo (swarm demo); swarm --help lists the commands"
    )
    assert error.startswith("swarm demo: error: swarm demo needs PyTorch")


def test_every_command_has_a_description_and_an_example_that_parses() -> None:
    import shlex

    from swarm.cli import EXAMPLES, build_parser

    parser = build_parser()
    real_peer = (
        "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWEHcPYfshUhjJdxeGGP12Jikv4UWyTL12fnE2Yja3tfqH"
    )
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == set(EXAMPLES)
    for name, command in commands.items():
        text = command.format_help()
        assert command.description and "example:" in text, name
        joined = " ".join(line.removesuffix("\\").strip() for line in EXAMPLES[name])
        for example in joined.split("swarm ")[1:]:
            words = shlex.split(
                example.split("#")[0].replace(
                    "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...", real_peer
                )
            )
            args = parser.parse_args(words)  # exits 2 (SystemExit) if an example is wrong
            assert args.command == name


def test_a_busy_metrics_port_exits_2_before_anything_starts() -> None:
    # Real processes: the port is held by another process (the test's), and the
    # command's event loop has taken SIGINT and SIGTERM when it finds it busy.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for command in (["bootstrap", *LOCAL], ["serve-stage", *LOCAL]):
            out = _swarm(*command, "--metrics", str(port))
            _assert_usage_error(out, f"--metrics 127.0.0.1:{port}: cannot listen")


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_a_bad_metrics_address_exits_2_before_anything_starts() -> None:
    out = run_cli("join", "--initial-peers", DEAD_PEER, "--metrics", "nope")
    _assert_usage_error(out, "'nope' is not PORT or HOST:PORT")


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_a_bad_run_key_exits_2_before_anything_starts(tmp_path: Path) -> None:
    """A run key file that is not a key, a trusted run key that is not a peer ID."""
    garbage = tmp_path / "op.key"
    garbage.write_bytes(b"not a key")
    join = ["join", "--initial-peers", DEAD_PEER]
    _assert_usage_error(run_cli("train", *LOCAL, "--run-key", str(garbage)), "--run-key: ")
    _assert_usage_error(
        run_cli(*join, "--trust-run-key", "nope"), "--trust-run-key: 'nope' is not a peer ID"
    )


_LOGS = """
import logging
from swarm.cli import _start_logging
_start_logging()
logging.getLogger("peers.relay").info("a relay slot reserved")
logging.getLogger("swarm.trainer").debug("a slot taken over")
logging.getLogger("multiaddr.transforms").debug("a dependency's chatter")
logging.getLogger("multiaddr.transforms").warning("a dependency's warning")
"""


@pytest.mark.parametrize(
    ("level", "shown", "hidden"),
    [
        (None, ["warning: a dependency's warning"], ["relay slot", "taken over", "chatter"]),
        ("info", [" INFO peers.relay: a relay slot reserved", "warning"], ["taken", "chatter"]),
        ("DEBUG", [" DEBUG swarm.trainer: a slot taken over", "relay slot"], ["chatter"]),
    ],
)
def test_swarm_log_level_shows_our_layers_decisions_not_our_dependencies(
    level: str | None, shown: list[str], hidden: list[str]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SWARM_LOG_LEVEL"}
    if level is not None:
        env["SWARM_LOG_LEVEL"] = level
    out = subprocess.run(
        [sys.executable, "-c", _LOGS], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    for text in shown:
        assert text in out.stderr, out.stderr
    for text in hidden:
        assert text not in out.stderr, out.stderr


def test_a_bad_swarm_log_level_exits_2_before_anything_starts() -> None:
    out = _swarm("ping", DEAD_PEER, env={**os.environ, "SWARM_LOG_LEVEL": "loud"})
    _assert_usage_error(out, "SWARM_LOG_LEVEL='loud': give one of debug, info, warning")
