"""``swarm serve-stage``: pipeline stage servers started from the command line, as an
operator runs them, and a client training through them. Its command-line mistakes are
checked in this process (``main(argv)``, :mod:`tests.swarm.cli_inprocess`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from peers.dht import BlockingDHT, DHTConfig
from swarm.pipeline import (
    DIGITS_STAGES,
    MLPStages,
    PipelineConfig,
    RemoteSequential,
    pipeline_model,
)
from swarm.status import gather_view
from swarm.tasks import get_task
from tests.swarm.cli_inprocess import INPROCESS_TIMEOUT, run_cli

SWARM = [sys.executable, "-m", "swarm.cli"]
LISTEN = ("--listen", "/ip4/127.0.0.1/tcp/0")


def _start(*args: str) -> tuple[subprocess.Popen[str], str, str]:
    """A serve-stage process, its first multiaddr and its 'serving' line."""
    proc = subprocess.Popen(
        [
            *SWARM,
            "serve-stage",
            *LISTEN,
            "--announce-interval",
            "1",
            "--status-interval",
            "2",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    maddr = proc.stdout.readline().strip()  # bounded by the pytest timeout
    if not maddr.startswith("/ip4/127.0.0.1/tcp/"):
        proc.kill()
        raise AssertionError(proc.communicate(timeout=10))
    serving = proc.stdout.readline().strip()
    return proc, maddr, serving


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "synchronous"])
def test_three_stage_servers_from_the_cli_take_every_stage_and_train(
    processes: list[subprocess.Popen[str]], synchronous: bool
) -> None:
    torch.set_num_threads(1)
    # synchronous: one step per train_step (on its 4 micro-batches), not one per backward
    mode = ("--lr", "1e-2") if synchronous else ("--asynchronous", "--lr", "3e-3")
    first, maddr, serving = _start("--stage", "1", *mode)
    processes.append(first)
    assert serving == "serving stage.1 of 3 stages"
    stages = {1}
    for _ in range(2):  # each newcomer takes a stage nobody serves yet
        proc, _, serving = _start("--initial-peers", maddr, *mode)
        processes.append(proc)
        stages.add(int(serving.split()[1].split(".")[1]))
    assert stages == {0, 1, 2}

    task = get_task("digits")
    with BlockingDHT(config=DHTConfig(initial_peers=(maddr,))) as dht:
        model = RemoteSequential(dht, PipelineConfig(num_stages=3, synchronous=synchronous))
        batches = task.batches(rank=0, num_peers=1, batch_size=32, seed=0)
        with torch.no_grad():
            before = float(F.cross_entropy(model(task.test_inputs), task.test_targets))
        for _ in range(25):
            model.train_step([next(batches) for _ in range(4)], F.cross_entropy)
        assert model.statistics().num_steps == (25 if synchronous else 0)
        with torch.no_grad():
            after = float(F.cross_entropy(model(task.test_inputs), task.test_targets))
        print("test loss before and after", before, after)
        # Their status records show the pipeline covered, each stage having worked.
        deadline, pipelines = time.monotonic() + 30, ()
        while time.monotonic() < deadline:
            view = dht.peer.run(gather_view(dht.node), timeout=30)
            pipelines = view.pipelines
            if pipelines and pipelines[0].servers == (1, 1, 1):
                break
            time.sleep(0.5)
    assert after < 0.5 * before, (before, after)
    assert [(p.uid_prefix, p.servers, p.coverage) for p in pipelines] == [("stage", (1, 1, 1), 1.0)]

    for proc in processes:
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(timeout=30) for proc in processes] == [0, 0, 0]


@pytest.mark.timeout(INPROCESS_TIMEOUT)
def test_serve_stage_refuses_bad_models_and_stages_with_clear_errors() -> None:
    for args, message in (
        (("--model", "nosuchmodel"), "neither built in ['charlm', 'digits'] nor MODULE:ATTRIBUTE"),
        (("--model", "swarm.pipeline:NOPE"), "cannot load pipeline model"),
        (("--model", "swarm.pipeline:pressures"), "building pipeline model"),
        (("--stage", "7"), "stage 7 is outside [0, 3)"),
        (("--stage", "first"), "must be a stage index or auto"),
        (("--run-id", "a/b"), "run_id must be a non-empty string without '/'"),
        (("--average-interval", "-1"), "must be positive"),
        (("--uid-prefix", "bad prefix!"), "invalid expert name 'bad prefix!'"),
    ):
        out = run_cli("serve-stage", *LISTEN, *args)
        assert out.returncode == 2, (args, out.stderr)
        assert message in out.stderr, (args, out.stderr)


class SmallStages(MLPStages):
    """A model class an operator might name (built with no arguments)."""

    def __init__(self) -> None:
        super().__init__(widths=((4, 8), (8, 2)))


class NoStages:
    num_stages = 0

    def build_stage(self, stage: int) -> None:
        del stage

    def build_local(self) -> None:
        pass


NO_STAGES = NoStages()


def test_pipeline_models_resolve_by_name_or_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pipeline_model("digits") is DIGITS_STAGES
    assert pipeline_model("swarm.pipeline:DIGITS_STAGES") is DIGITS_STAGES
    built = pipeline_model(f"{__name__}:SmallStages")  # a class is instantiated
    assert isinstance(built, SmallStages) and built.num_stages == 2
    with pytest.raises(ValueError, match="not a pipeline model"):
        pipeline_model("swarm.pipeline:__name__")
    with pytest.raises(ValueError, match=r"num_stages=0, not an int in \[1, 256\]"):
        pipeline_model(f"{__name__}:NO_STAGES")
    (tmp_path / "broken_models.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"cannot load pipeline model.*boom at import"):
        pipeline_model("broken_models:MODEL")
    with pytest.raises(ValueError, match="cannot load pipeline model"):
        pipeline_model(".relative:MODEL")
