"""Pipeline benchmark (issue 19): synchronous stages against one process, and the
square-cube law.

**Throughput.** Four models, each on 3 stage servers (one process per stage, one torch
thread each, on 127.0.0.1), driven by ``RemoteSequential.train_step`` with ``in_flight``
micro-batches in flight, against the same model trained on the same micro-batches in
this process on one thread. ``wide``: an MLP of three 512 -> 2048 -> 512 stages;
``charlm256``: the ``charlm`` transformer at width 256 (3 blocks, one per stage, context
64, next-character loss on the task's data); ``charlm512``: the same at width 512, the
compute-heavy one (its compute per token grows as the width squared, what crosses a
stage boundary as the width: see the square-cube figure); ``offcpu``: stages that compute off the
CPU, as on an accelerator (``_offcpu_stages.py``: a linear layer, then 4 ms held in the
forward and 8 ms in the backward), whose limit is GPipe's schedule, 2x at 4
micro-batches through 3 stages, not this machine's cores. Both modes: synchronous (the
stages step once per ``train_step``, on the batch's gradient; locally, the micro-batches'
gradients accumulated and one step) and asynchronous (each server steps on every
backward; locally, a step per micro-batch). Ratio = local seconds / pipeline seconds
(> 1: the pipeline is faster). The physical limit of the first three here is 2x: three
servers and the client share two cores (3x with a machine per stage).

**The square-cube law** (SWARM, Ryabinin et al. 2023): a transformer's compute per
token grows as ``d_model ** 2``, what crosses a stage boundary as ``d_model``, so the
share of a step spent communicating falls as the model widens. Measured: the charlm
transformer at widths 64 to 512, synchronous, one micro-batch in flight (no overlap),
3 servers; the share of a step's wall time that is not the servers' own compute
(``1 - sum of the servers' compute seconds / wall seconds``: RPCs, serialization and
the client, whose loss is small). The ratio ``square_cube_comm_share_...`` is the
smallest width's share over the largest's (> 1: the share falls, as the law says).

hivemind has no pipeline to set beside it (its SWARM code lives outside the package);
the local model is the limit each pipeline is measured against.

    .venv/bin/python benchmarks/bench_pipeline.py --quick   # about 2 minutes
    .venv/bin/python benchmarks/bench_pipeline.py           # about 8 minutes
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module

from _common import BenchError, emit_result, timed_steps

#: Seconds a child has to import its stack and start.
STARTUP_TIMEOUT = 120.0
#: Seconds one stage call, or one step's end, may take before the run is broken.
CALL_TIMEOUT = 120.0
CONTEXT = 64


@dataclass(frozen=True, kw_only=True)
class Plan:
    steps: int
    """Timed steps per model and mode (after ``warmup`` steps)."""
    warmup: int = 2
    widths: tuple[int, ...]
    """Transformer widths of the square-cube figure."""
    square_steps: int


QUICK = Plan(steps=4, widths=(64, 256), square_steps=4)
FULL = Plan(steps=12, widths=(64, 128, 256, 512), square_steps=10)


@dataclass(frozen=True, kw_only=True)
class Model:
    name: str
    options: dict[str, Any]
    """The stage servers' model options (``swarm.pipeline.testing``)."""
    micro_batch: int
    in_flight: int


MODELS = (
    Model(name="wide", options={"widths": [[512, 2048, 512]] * 3}, micro_batch=64, in_flight=4),
    Model(
        name="charlm256",
        options={"charlm": {"d_model": 256, "num_heads": 4, "context": CONTEXT}},
        micro_batch=8,
        in_flight=4,
    ),
    # The compute-heavy transformer: serving costs little beside its compute.
    Model(
        name="charlm512",
        options={"charlm": {"d_model": 512, "num_heads": 8, "context": CONTEXT}},
        micro_batch=8,
        in_flight=4,
    ),
    # Stages that compute off the CPU (_offcpu_stages.py): the pipeline's schedule,
    # apart from the two cores that the CPU-bound models above overcommit.
    Model(
        name="offcpu",
        options={"model": "_offcpu_stages:OFFCPU_STAGES", "widths": [[512]]},
        micro_batch=64,
        in_flight=4,
    ),
)


def _build(options: dict[str, Any]) -> Any:
    from swarm.pipeline.testing import config_from_options

    return config_from_options(options).model


def _batches(model: Model, count: int) -> list[list[Any]]:
    import torch

    if "charlm" not in model.options:
        gen = torch.Generator().manual_seed(0)
        width = model.options["widths"][0][0]
        return [
            [
                (
                    torch.randn(model.micro_batch, width, generator=gen),
                    torch.randint(0, 512, (model.micro_batch,), generator=gen),
                )
                for _ in range(model.in_flight)
            ]
            for _ in range(count)
        ]
    from swarm.tasks import get_task
    from swarm.tasks.charlm import CharLMConfig, CharLMTask

    assert get_task("charlm")  # the task's corpus is on this machine
    task = CharLMTask(CharLMConfig(context=CONTEXT))
    data = task.batches(rank=0, num_peers=1, batch_size=model.micro_batch, seed=0)
    return [[next(data) for _ in range(model.in_flight)] for _ in range(count)]


def _loss(outputs: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def local_seconds(
    model: Model,
    steps: list[Any],
    warmup: int,
    synchronous: bool,
    losses: list[float] | None = None,
) -> float:
    """The model in this process, one thread: accumulate then step, or step each (each
    micro-batch's loss appended to ``losses``)."""
    import torch

    local = _build(model.options).build_local()
    optimizer = torch.optim.Adam(local.parameters(), lr=1e-3)

    def train(step: list[Any]) -> None:
        for x, y in step:
            loss = _loss(local(x), y)
            if losses is not None:
                losses.append(loss.item())
            if synchronous:
                (loss / len(step)).backward()
            else:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        if synchronous:
            optimizer.step()
            optimizer.zero_grad()

    return timed_steps(steps, warmup, train)


@dataclass(frozen=True)
class PipelineRun:
    seconds: float
    compute_seconds: float
    """The servers' compute over the timed steps, summed."""
    losses: list[float]
    """Every micro-batch's loss, warm-up included."""


def pipeline_seconds(model: Model, steps: list[Any], warmup: int, synchronous: bool) -> PipelineRun:
    from peers.dht import BlockingDHT, DHTConfig
    from peers.testing import LocalSwarm
    from swarm.experts import ExpertCallConfig
    from swarm.pipeline import PipelineConfig, RemoteSequential

    options: dict[str, Any] = {
        **model.options,
        "optimizer": "adam",
        "lr": 1e-3,
        "average_interval": 3600.0,  # one server per stage: no replicas to average
        "max_batch_size": model.micro_batch * model.in_flight,
        "synchronous": synchronous,
        "clip": "none",
    }
    with LocalSwarm(startup_timeout=STARTUP_TIMEOUT) as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        boot.wait_report("joined", STARTUP_TIMEOUT)
        servers = swarm.start(
            3,
            target="swarm.pipeline.testing:stage_server",
            options={**options, "initial_peers": [boot.maddr]},
            per_peer_options=[{"stage": i} for i in range(3)],
        )
        for server in servers:
            server.wait_report("serving", STARTUP_TIMEOUT)

        def compute() -> float:
            total = 0.0
            for server in servers:
                server.send({"op": "stats"})
                total += server.wait_report("stats", STARTUP_TIMEOUT)["compute_seconds"]
            return total

        calls = ExpertCallConfig(forward_timeout=CALL_TIMEOUT, backward_timeout=CALL_TIMEOUT)
        config = PipelineConfig(
            num_stages=3, calls=calls, seed=0, synchronous=synchronous, step_timeout=CALL_TIMEOUT
        )
        with BlockingDHT(config=DHTConfig(initial_peers=(boot.maddr,))) as dht:
            pipeline = RemoteSequential(dht, config)
            losses: list[float] = []
            for step in steps[:warmup]:
                losses += pipeline.train_step(step, _loss)
            before = compute()
            seconds = timed_steps(
                steps[warmup:], 0, lambda step: losses.extend(pipeline.train_step(step, _loss))
            )
            spent = compute() - before
            if pipeline.statistics().num_failed_calls:
                raise BenchError(f"pipeline calls failed: {pipeline.statistics()}")
    return PipelineRun(seconds, spent, losses)


def check_synchronous(model: Model, steps: list[Any], run: PipelineRun) -> None:
    """A synchronous pipeline trains as the local model does: the same losses at every
    micro-batch, within 0.1% (else what was timed is not that training)."""
    expected: list[float] = []
    local_seconds(model, steps, 0, True, expected)
    # relative: Adam magnifies the sums' float rounding (other orders than one process's)
    worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(run.losses, expected, strict=True))
    if worst > 1e-3:
        raise BenchError(
            f"{model.name}: the pipeline's losses differ from one process's by {worst}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and widths")
    parser.add_argument(
        "--models", default=",".join(m.name for m in MODELS), help="of the throughput figure"
    )
    parser.add_argument("--widths", help="of the square-cube figure, e.g. 64,256")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in MODELS})
    if unknown:
        parser.error(
            f"unknown model(s) {', '.join(unknown)}: give some of {[m.name for m in MODELS]}"
        )
    widths = plan.widths
    if args.widths:
        try:
            widths = tuple(int(w) for w in args.widths.split(","))
        except ValueError:
            parser.error(f"--widths {args.widths}: give widths like 64,256")
        if any(w < 4 or w % 4 for w in widths):
            parser.error(f"--widths {args.widths}: each a multiple of the 4 heads")

    import torch

    torch.set_num_threads(1)
    # where the stage servers import ``_offcpu_stages`` from
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    print("throughput: 3 stage servers (1 process each) against one process, 1 thread each")
    for model in (m for m in MODELS if m.name in names):
        steps = _batches(model, plan.warmup + plan.steps)
        samples = plan.steps * model.in_flight * model.micro_batch
        for synchronous in (True, False):
            mode = "sync" if synchronous else "async"
            local = local_seconds(model, steps, plan.warmup, synchronous)
            run = pipeline_seconds(model, steps, plan.warmup, synchronous)
            if synchronous:
                check_synchronous(model, steps, run)
            # again, after: the quieter of the two (the machine is shared)
            local = min(local, local_seconds(model, steps, plan.warmup, synchronous))
            figures[f"pipeline_{model.name}_{mode}_samples_per_s"] = round(samples / run.seconds, 1)
            figures[f"local_{model.name}_{mode}_samples_per_s"] = round(samples / local, 1)
            ratios[f"pipeline_vs_local_{model.name}_{mode}"] = round(local / run.seconds, 3)
            print(
                f"  {model.name} {mode}: pipeline {samples / run.seconds:.0f} samples/s, "
                f"local {samples / local:.0f} samples/s ({local / run.seconds:.2f}x; "
                f"{model.in_flight} micro-batches of {model.micro_batch} per step)",
                flush=True,
            )

    print("square-cube: charlm, synchronous, 1 micro-batch of 8 in flight, 3 servers")
    shares: dict[int, float] = {}
    for width in widths:
        model = Model(
            name=f"charlm{width}",
            options={"charlm": {"d_model": width, "num_heads": 4, "context": CONTEXT}},
            micro_batch=8,
            in_flight=1,
        )
        steps = _batches(model, plan.warmup + plan.square_steps)
        run = pipeline_seconds(model, steps, plan.warmup, True)
        share = max(0.0, 1.0 - run.compute_seconds / run.seconds)
        shares[width] = share
        figures[f"square_cube_d{width}_step_seconds"] = round(run.seconds / plan.square_steps, 4)
        figures[f"square_cube_d{width}_comm_share"] = round(share, 3)
        print(
            f"  d_model {width}: {run.seconds / plan.square_steps * 1000:.0f} ms a step, "
            f"servers computing {run.compute_seconds / run.seconds:.0%} of it, "
            f"communication and serving {share:.0%}",
            flush=True,
        )
    low, high = min(shares), max(shares)
    if low != high and shares[high] > 0:
        ratios[f"square_cube_comm_share_d{low}_over_d{high}"] = round(shares[low] / shares[high], 3)
    emit_result("pipeline", figures, ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
