"""``swarm``'s flags: the set is pinned (adding, renaming or dropping a flag shows
here, on purpose), the flags made from config fields default to those fields, and a
command that needs no torch imports none to parse its flags."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from swarm import cli
from swarm.cli_fields import Flag, add_flags, field_docs, flag_values

_TRAINING = (
    "--allow --allow-file --announce --centered-clip --checkpoint --checkpoint-every "
    "--diloco --diloco-overlap --eval-every --identity --initial-peers --listen --local-batch-size "
    "--metrics --no-relay --num-peers --num-samples --num-threads --outer-lr --outer-momentum "
    "--progress --reachability --reducers-per-part --run-id --run-key --seed --status-interval "
    "--swarm-key --target-batch-size --task --trust-run-key"
)
#: Every command's flags (positional arguments by their metavar), sorted.
PINNED = {
    "bootstrap": (
        "--allow --allow-file --announce --identity --initial-peers --listen --metrics "
        "--no-relay --reachability --status-interval --swarm-key"
    ),
    "ping": "--count --identity --swarm-key --timeout MADDR",
    "status": "--initial-peers --json --swarm-key --timeout",
    "dashboard": "--host --initial-peers --port --refresh --swarm-key --timeout",
    "swarm-key": "PATH",
    "serve": (
        "--allow --allow-file --allow-trainer --allow-trainer-file --announce "
        "--announce-interval --clip-grad-norm --expert-pattern --hidden-dim --identity "
        "--initial-peers --linear-kernels --listen --lr --max-batch-size --metrics "
        "--module --no-relay --optimizer --reachability --seed --status-interval "
        "--swarm-key --uids"
    ),
    "serve-stage": (
        "--allow --allow-file --announce --announce-interval --asynchronous "
        "--average-interval --clip-grad-norm --identity --initial-peers --linear-kernels "
        "--listen --lr --max-batch-size --metrics --model --no-relay --optimizer "
        "--reachability --rebalance-interval --run-id --stage --status-interval --swarm-key "
        "--uid-prefix"
    ),
    "train": _TRAINING,
    "join": _TRAINING,
    "demo": "--num-peers --num-samples --seed --speed --task --timeout",
}


def _flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    sub = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    flags = {}
    for name, command in sub.choices.items():
        shown = [a for a in command._actions if a.help != argparse.SUPPRESS]
        words = (a.option_strings[0] if a.option_strings else a.metavar for a in shown)
        flags[name] = " ".join(sorted(w for w in words if w != "-h"))
    return flags


def test_every_commands_flags_are_pinned() -> None:
    assert _flags(cli.build_parser()) == PINNED


@pytest.mark.parametrize("command", ["train", "join"])
def test_train_and_join_default_to_the_trainer_config(command: str) -> None:
    from swarm.trainer import TrainerConfig

    peer = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEHcPYfshUhjJdxeGGP12Jikv4UWyTL12fnE2Yja3tfqH"
    words = [command, "--initial-peers", peer] if command == "join" else [command]
    args = cli.build_parser((command,)).parse_args(words)
    initial = (peer,) if command == "join" else ()
    assert cli._trainer_config(args) == TrainerConfig(initial_peers=initial)


def test_the_trainer_listens_where_the_bootstrap_command_does() -> None:
    """One default listen address for ``swarm train``, ``TrainerConfig`` and the
    hosting commands; a bare ``PeerConfig`` stays on loopback."""
    from peers.config import LOOPBACK_LISTEN_ADDRS, SWARM_LISTEN_ADDRS, PeerConfig
    from swarm.trainer import TrainerConfig

    assert TrainerConfig().listen == SWARM_LISTEN_ADDRS == ("/ip4/0.0.0.0/tcp/0",)
    args = cli.build_parser(("bootstrap",)).parse_args(["bootstrap"])
    peer_config, _ = cli._server_peer_config(args)
    assert peer_config.listen_addrs == SWARM_LISTEN_ADDRS
    assert PeerConfig().listen_addrs == LOOPBACK_LISTEN_ADDRS


def test_the_hosting_commands_default_to_their_configs() -> None:
    from swarm.experts.serve import ServeConfig
    from swarm.join_config import JoinConfig
    from swarm.pipeline import StageServerConfig, pipeline_model

    parser = cli.build_parser(("bootstrap", "serve", "serve-stage"))
    for command in ("bootstrap", "serve", "serve-stage"):
        words = [command, "--uids", "ffn.0"] if command == "serve" else [command]
        peer_config, _ = cli._server_peer_config(parser.parse_args(words))
        assert peer_config == JoinConfig().peer_config(), command
    served = cli._serve_config(parser.parse_args(["serve", "--uids", "ffn.0"]))
    assert served == ServeConfig(uids=("ffn.0",))
    stage = cli._stage_config(parser.parse_args(["serve-stage"]))
    assert stage == StageServerConfig(model=pipeline_model("digits"))


def test_diloco_flags_make_a_diloco_config_only_when_asked() -> None:
    from swarm.collaborative.config import DiLoCoConfig

    parser = cli.build_parser(("train",))
    assert cli._trainer_config(parser.parse_args(["train"])).diloco is None
    args = parser.parse_args(["train", "--diloco", "5", "--outer-lr", "0.5"])
    assert cli._trainer_config(args).diloco == DiLoCoConfig(inner_steps=5, outer_lr=0.5)
    args = parser.parse_args(["train", "--diloco", "5", "--diloco-overlap"])
    assert cli._trainer_config(args).diloco == DiLoCoConfig(inner_steps=5, overlap=True)


def test_demo_defaults_to_the_demo_config() -> None:
    from swarm.demo import DemoConfig

    args = cli.build_parser(("demo",)).parse_args(["demo"])
    values = flag_values(args, DemoConfig, cli._demo_flags())
    assert values.pop("num_peers") is None  # the config counts the cores itself
    default = DemoConfig()
    assert values == {k: getattr(default, k) for k in values}


@dataclasses.dataclass(frozen=True)
class _Example:
    rate: float = 0.5
    """How fast, per :data:`SCALE` units (``rate``). More words that help leaves out."""
    names: tuple[str, ...] = ("a", "b")
    """Names to use."""
    loud: bool = False
    """Say it. Twice."""
    relay: bool = True
    """Use relays."""
    path: Path | None = None
    """Where, e.g. a file."""


SCALE = 7


def test_a_field_gives_its_flag_its_name_default_and_first_sentence() -> None:
    assert field_docs(_Example)["rate"] == (
        "How fast, per 7 units (rate). More words that help leaves out."
    )
    parser = argparse.ArgumentParser()
    flags = (Flag("rate"), Flag("names"), Flag("loud"), Flag("relay"), Flag("path"))
    add_flags(parser, _Example, flags)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.dest != "help"}
    assert helps == {
        "--rate": "how fast, per 7 units (rate) (default 0.5)",
        "--names": "names to use (default a b); repeatable",
        "--loud": "say it",
        "--no-relay": "use relays",
        "--path": "where, e.g. a file",
    }
    assert flag_values(parser.parse_args([]), _Example, flags) == dataclasses.asdict(_Example())
    given = parser.parse_args(
        ["--rate", "2", "--names", "x", "--names", "y", "--loud", "--no-relay", "--path", "p"]
    )
    assert _Example(**flag_values(given, _Example, flags)) == _Example(
        2.0, ("x", "y"), True, False, Path("p")
    )


def test_ping_and_help_build_no_torch_command() -> None:
    code = (
        "import sys\n"
        "from swarm.cli import main\n"
        "for words in (['--help'], ['ping', '--help']):\n"
        "    try:\n"
        "        main(words)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"
