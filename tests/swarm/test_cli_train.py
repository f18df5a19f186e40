"""``swarm train``, ``swarm join`` and ``swarm demo`` as a user runs them: real processes
on loopback, reduced sizes. The command-line mistakes, refused before anything starts,
are checked in this process (``main(argv)``, :mod:`tests.swarm.cli_inprocess`), one of
them in a real process too."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peers.identity import KeyPair
from peers.pnet import new_swarm_key, write_swarm_key
from swarm.checkpoint import read_state
from tests.swarm.cli_inprocess import INPROCESS_TIMEOUT, run_cli

SWARM = [sys.executable, "-m", "swarm.cli"]
LOCAL = ["--listen", "/ip4/127.0.0.1/tcp/0"]
#: Where the user's own task modules of the usage checks are (bad_tasks.py).
TASKS_FOR_CLI = Path(__file__).parent / "tasks_for_cli"


def test_demo_trains_a_local_swarm_and_compares_it_with_the_baseline() -> None:
    out = subprocess.run(
        [*SWARM, "demo", "--num-peers", "2", "--num-samples", str(64 * 30)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    boot = re.search(r"bootstrap peer \(this process\): (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\S+)", text)
    assert boot is not None, text
    assert f"join --initial-peers {boot.group(1)} --task digits --run-id demo" in text
    assert "[####################] 100%  samples 1,920/1,920" in text  # not a TTY: plain lines
    assert re.search(r"test accuracy\s+\d+\.\d%\s+\d+\.\d%", text), text
    assert re.search(r"optimizer steps\s+30\s+30", text), text
    assert re.search(r"training samples\s+1,920\s+1,920", text), text
    assert "demo finished in" in text


def test_the_speed_demo_trains_the_transformer_to_the_same_model_as_one_process() -> None:
    """``swarm demo --speed`` (three steps here): one trainer per core splits each batch
    of 1024; the models are the same, the table has both training times and the bytes
    (how the times compare is measured in docs/benchmarks.md, not asserted)."""
    out = subprocess.run(
        [*SWARM, "demo", "--speed", "--num-samples", str(1024 * 3)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "peers train the 'charlm' task together" in text
    assert re.search(r"global batch\s+1024\s+same", text), text
    assert re.search(r"optimizer steps\s+3\s+3", text), text
    loss = re.search(r"test loss\s+(\d\.\d+)\s+(\d\.\d+)", text)
    assert loss is not None and loss.group(1) == loss.group(2), text
    assert re.search(r"training time\s+\d+\.\d+ s\s+\d+\.\d+ s", text), text
    assert re.search(r"bytes sent\s+\d", text), text
    assert "hold the same model" in text
    assert re.search(r"trained \d+\.\d+x faster than one process|took \d+\.\dx as long", text)
    assert "warning" not in out.stderr, out.stderr


def _summary(stdout: str, epochs: int) -> None:
    assert f"done: {epochs} epochs, {epochs * 64:,} global samples" in stdout, stdout
    assert re.search(r"test metrics: loss \d\.\d+, accuracy \d+\.\d%", stdout), stdout


def _start(*args: str) -> subprocess.Popen[str]:
    """``swarm ARGS`` with its output piped, as text."""
    return subprocess.Popen(
        [*SWARM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize("private", [False, True], ids=["open", "swarm-key-and-run-key"])
def test_train_starts_a_swarm_and_join_trains_with_it(tmp_path: Path, private: bool) -> None:
    """The printed join command, pasted, trains with the first peer. Private: the first
    peer holds a swarm key and the run key; the command it prints carries
    ``--swarm-key`` and ``--trust-run-key`` (the key's peer ID, never the key), and
    works as printed."""
    sizes = ["--num-peers", "2", "--num-samples", str(64 * 20), "--num-threads", "1"]
    keys: list[str] = []
    if private:
        write_swarm_key(tmp_path / "team.psk", new_swarm_key())
        keys = ["--swarm-key", str(tmp_path / "team.psk"), "--run-key", str(tmp_path / "op.key")]
    first = _start("train", *LOCAL, *sizes, *keys)
    second: subprocess.Popen[str] | None = None
    try:
        assert first.stdout is not None
        head = []
        for line in first.stdout:  # bounded by the pytest timeout
            head.append(line)
            found = re.search(r" (join --initial-peers \S+ --task digits --run-id demo.*)", line)
            if found:
                break
        else:
            raise AssertionError(f"no join command printed: {''.join(head)}")
        if private:
            run_key = KeyPair.load(tmp_path / "op.key").peer_id
            assert f"--trust-run-key {run_key}" in found.group(1), found.group(1)
            assert "--run-key" not in found.group(1).replace("--trust-run-key", "")
            assert f"--swarm-key {tmp_path / 'team.psk'}" in found.group(1)
        # the printed command as a volunteer pastes it: no rank, no swarm size
        second = _start(*found.group(1).split(), *LOCAL, "--num-threads", "1")
        out_first, err_first = first.communicate(timeout=150)
        out_second, err_second = second.communicate(timeout=60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    assert first.returncode == 0, err_first
    assert second.returncode == 0, err_second
    _summary(out_first, 20)
    _summary(out_second, 20)
    peers = re.findall(r"peers (\d)", out_first + out_second)
    assert "2" in peers  # they saw each other
    assert "state loads" in out_second and "Traceback" not in err_first + err_second


def test_a_late_joiner_loads_the_state_the_run_key_signed(tmp_path: Path) -> None:
    """The operator's peer (``--run-key``) trains alone; a volunteer that pastes the
    printed join command (``--trust-run-key``, the key's peer ID) after epoch 10 loads
    the state the operator's peer signed, from it alone, and says so. Both are stopped
    then: the run is long, so that the operator's peer is still there to serve."""
    train = ["train", *LOCAL, "--num-samples", str(64 * 5000), "--num-threads", "1"]
    first = _start(*train, "--run-key", str(tmp_path / "op.key"), "--progress", "lines")
    second: subprocess.Popen[str] | None = None
    try:
        assert first.stdout is not None
        command = None
        for line in first.stdout:  # bounded by the pytest timeout
            found = re.search(r" (join --initial-peers \S+ .*)", line)
            command = found.group(1) if found else command
            samples = re.search(r"samples ([\d,]+)/", line)
            if command and samples and int(samples.group(1).replace(",", "")) >= 64 * 10:
                break
        assert command is not None, "no join command printed"
        run_key = KeyPair.load(tmp_path / "op.key").peer_id
        assert f"--trust-run-key {run_key}" in command, command
        second = _start(*command.split(), *LOCAL, "--num-threads", "1", "--progress", "lines")
        assert second.stdout is not None
        joined = ""
        for line in second.stdout:  # bounded by the pytest timeout
            joined += line
            if "loaded the swarm's state" in line or "samples" in line:
                break
        second.kill()  # it has shown what it loaded; the rest is ordinary training
        out_second, err_second = second.communicate(timeout=10)
        first.kill()
        _, err_first = first.communicate(timeout=10)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=10)
    loaded = re.search(r"loaded the swarm's state \(signed by the run key\) at epoch (\d+)", joined)
    assert loaded is not None and int(loaded.group(1)) >= 10, joined + out_second + err_second
    assert "Traceback" not in err_first + err_second


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--num-peers", "5000"], "error: num_peers must be <= 4096, got 5000"),
        (
            [
                "join",
                "--initial-peers",
                "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWEHcPYfshUhjJdxeGGP12Jikv4UWyTL12fnE2Yja3tfqH",
                "--rank",
                "1",
            ],
            "unrecognized",
        ),
        (["train", "--task", "imagenet"], "error: unknown task 'imagenet'"),
        (
            ["train", "--task", "no_such_module:make"],
            "error: cannot load task 'no_such_module:make'",
        ),
        (["train", "--task", "bad_tasks:missing"], "error: cannot load task 'bad_tasks:missing'"),
        (
            ["train", "--task", "bad_tasks:NOT_CALLABLE"],
            "is not callable (a int): name a Task subclass",
        ),
        (["train", "--task", "bad_tasks:raises"], "raised RuntimeError('no data here')"),
        (
            [
                "join",
                "--initial-peers",
                "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWEHcPYfshUhjJdxeGGP12Jikv4UWyTL12fnE2Yja3tfqH",
                "--task",
                "bad_tasks:returns_a_dict",
            ],
            "returned a dict, not a swarm.tasks.Task",
        ),
        (["demo", "--task", "bad_tasks:raises"], "raised RuntimeError('no data here')"),
        (["train", "--run-id", "a/b"], "error: run_id must be a non-empty string without '/'"),
        (["train", "--diloco", "0"], "error: argument --diloco: must be at least 1"),
        (["train", "--outer-momentum", "1.5", "--diloco", "5"], "error: need outer_lr > 0"),
        (["train", "--diloco-overlap"], "error: --diloco-overlap needs --diloco H"),
        (["train", "--diloco", "5", "--diloco-overlap=on"], "--diloco-overlap: ignored explicit"),
        (["train", "--num-samples", "-1"], "error: argument --num-samples"),
        (["train", "--eval-every", "-3"], "error: argument --eval-every: must be at least 0"),
        (["join", "--eval-every", "often"], "error: argument --eval-every"),
        (["join"], "error: the following arguments are required: --initial-peers"),
        (["join", "--reachability", "sideways"], "argument --reachability: invalid choice"),
        (
            ["train", "--announce", "/ip4/1.2.3.4"],
            "argument --announce: '/ip4/1.2.3.4' is not a TCP",
        ),
        (["demo", "--num-peers", "1"], "error: num_peers must be in [2, 16], got 1"),
        (["demo", "--task", "imagenet"], "error: unknown task 'imagenet'"),
        (["demo", "--timeout", "0"], "error: argument --timeout: must be positive"),
        (["train", "--centered-clip=yes"], "argument --centered-clip: ignored explicit argument"),
        (["train", "--reducers-per-part", "2"], "argument --reducers-per-part: invalid choice"),
    ],
)
@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_bad_flags_fail_with_a_clear_error_and_exit_code_2(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # where the user's own task modules are found (bad_tasks.py): the working directory,
    # which `python -m swarm.cli` puts on the path; in this process, put there
    monkeypatch.chdir(TASKS_FOR_CLI)
    monkeypatch.syspath_prepend(str(TASKS_FOR_CLI))
    out = run_cli(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_a_bad_flag_of_the_real_command_exits_2() -> None:
    # The checks above call main() in this process; this one runs `python -m swarm.cli`
    # itself, so that the entry point's exit code 2 stays covered, and a user's task
    # module is found in the working directory as a user runs it.
    out = subprocess.run(
        [*SWARM, "train", "--task", "bad_tasks:raises"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TASKS_FOR_CLI,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "raised RuntimeError('no data here')" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == "", out.stdout + out.stderr


def test_join_with_no_reachable_peer_fails_clearly() -> None:
    dead = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWEHcPYfshUhjJdxeGGP12Jikv4UWyTL12fnE2Yja3tfqH"
    out = subprocess.run(
        [*SWARM, "join", "--initial-peers", dead, *LOCAL],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "error: none of the 1 initial peers answered" in out.stderr
    assert "Traceback" not in out.stderr


def test_sigterm_mid_run_saves_a_checkpoint_that_resumes_to_the_same_model(
    tmp_path: Path,
) -> None:
    """One peer alone (every epoch steps alone, so the run is deterministic): SIGTERM
    after epoch 40 of 120 saves the checkpoint; the run that resumes from it says so and
    ends with the model of a run never interrupted, to the last printed digit. With
    --checkpoint-every 25 the file is also written on the way (its epoch is checked)."""
    ck = tmp_path / "run.ck"
    train = [*SWARM, "train", *LOCAL, "--num-samples", str(64 * 120), "--checkpoint", str(ck)]
    proc = subprocess.Popen(
        [*train, "--checkpoint-every", "25", "--progress", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # bounded by the pytest timeout
        if line.startswith("{") and json.loads(line).get("epoch", 0) >= 40:
            break
    assert ck.exists()  # written at epoch 25
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    saved = int(read_state(ck)["metadata"]["counters"]["epoch"])
    assert 40 <= saved < 120, saved
    resumed = subprocess.run(train, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {ck} at epoch {saved}" in resumed.stdout + resumed.stderr
    straight = subprocess.run(
        [*train[:-2], "--checkpoint", str(tmp_path / "other.ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    metrics = [re.search(r"test metrics: .*", r.stdout) for r in (resumed, straight)]
    assert all(m is not None for m in metrics), (resumed.stdout, straight.stdout)
    assert metrics[0].group(0) == metrics[1].group(0)  # type: ignore[union-attr]


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_an_unwritable_checkpoint_path_is_a_usage_error_before_training(tmp_path: Path) -> None:
    for path, message in (
        (tmp_path / "missing" / "run.ck", "does not exist; create it"),
        (tmp_path, "is a directory"),
    ):
        out = run_cli("train", *LOCAL, "--checkpoint", str(path))
        assert out.returncode == 2, out.stderr
        assert message in out.stderr and out.stdout == "", out.stdout + out.stderr
    out = run_cli("train", *LOCAL, "--checkpoint-every", "5")
    assert out.returncode == 2 and "checkpoint_every needs a checkpoint path" in out.stderr


def _two_free_ports() -> int:
    """A port P with P + 1 free too (bounded tries; both are checked, not held)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two consecutive free ports")


def test_a_fixed_listen_port_hosts_the_bootstrap_and_the_trainer_takes_the_next() -> None:
    port = _two_free_ports()
    out = subprocess.run(
        [*SWARM, "train", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--num-samples", "320"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"--initial-peers /ip4/127.0.0.1/tcp/{port}/p2p/" in out.stdout
    assert "loopback only: other machines cannot join" in out.stdout
    _summary(out.stdout, 5)


def test_next_ports_shifts_fixed_ports_only() -> None:
    from swarm.errors import TaskError
    from swarm.train_command import next_ports

    assert next_ports(["/ip4/0.0.0.0/tcp/4001", "/ip6/::/tcp/0", "/ip4/1.2.3.4/tcp/9"]) == (
        "/ip4/0.0.0.0/tcp/4002",
        "/ip6/::/tcp/0",
        "/ip4/1.2.3.4/tcp/10",
    )
    with pytest.raises(TaskError, match="the trainer takes the next port"):
        next_ports(["/ip4/0.0.0.0/tcp/65535"])
