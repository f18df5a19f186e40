"""Remote expert benchmark: ours (``swarm.experts``) against hivemind's MoE server.

One expert, the same module on both sides: hivemind's "ffn" (Linear 1024 -> 4096, GELU,
Linear 4096 -> 1024, residual LayerNorm) with Adam (torch's fused implementation, which
``swarm serve`` builds, in all three systems; ``--plain-adam`` for the per-op one), one
server process and one client process per system on 127.0.0.1 (started with
multiprocessing's ``spawn``), torch on one thread in every process. Ours:
``ExpertServer`` + ``RemoteExpert``; hivemind: ``hivemind.moe.Server.create(expert_cls=
"ffn")`` + its ``RemoteExpert``. The local module (the same FFN and Adam in one process,
no network) is the zero-network limit.

Our server computes its Linear layers with oneDNN where a probe finds that faster than
torch's kernels (``swarm.experts.kernels``; ``--linear-kernels``); hivemind's server and
"local" compute with torch's. Where ours uses oneDNN, "local, our kernels" (the same
module and Adam in one process, with oneDNN and our server's kept heap) is our server's
zero-network limit, so a reader can tell what the kernels bring from what the serving
brings.

For batch sizes 1, 16 and 256: median latency of a forward (``torch.no_grad()``) and of a
forward+backward (the client backpropagates a fixed gradient; the server recomputes the
forward, backpropagates and steps Adam, as both systems do), timed in the client after
a warm-up; samples/s = batch / median. Each repetition starts fresh clients; within it
the systems take turns of a few calls each (rotating the order across repetitions), so
load from other work on a shared machine falls on all of them alike; figures are
medians over all timed calls of all repetitions. The run ends with one JSON line;
ratios are oriented so > 1 means ours is better (hivemind's latency over ours; our
throughput over hivemind's).

A second section measures pipelines (``swarm.pipeline``): training throughput
(samples/s of forward, backward and optimizer step) of a 3-stage MLP on 3 stage servers
(one per stage, each its own process), driven by ``RemoteSequential.train_step`` with
several micro-batches in flight, against the same model trained on the same micro-batches
in one process (``pipeline_vs_local_*`` ratios: > 1 means the pipeline is faster). Two
models: ``digits`` (the tests' 64 -> 128 | 128 -> 256 -> 128 | 128 -> 10) and ``wide``
(three 512 -> 2048 -> 512 stages), with synthetic data.

    .venv/bin/python benchmarks/bench_experts.py --quick   # 1 rep, about a minute
    .venv/bin/python benchmarks/bench_experts.py           # 3 reps, a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
from _common import (
    LOOPBACK,
    BenchError,
    Placement,
    descendants,
    emit_result,
    importable_hivemind,
    median,
    print_table,
    receive_from,
    remove_shared_memory_of,
    stop_pids,
    timed_steps,
)
from _common import PipeChild as Child
from _experts_peers import child_entry

#: Seconds a child has to import its stack and start (hivemind starts p2pd, a DHT
#: process and its handler processes).
STARTUP_TIMEOUT = 120.0
#: Seconds one measurement command may take.
MEASURE_TIMEOUT = 300.0
#: Seconds a child gets to stop after being asked, before it is terminated.
STOP_GRACE = 15.0
#: Seconds one pipeline stage call may take before the run is declared broken.
CALL_TIMEOUT = 60.0
SYSTEMS = ("ours", "hivemind", "local", "local_server_kernels")
#: Table headers of the systems.
HEADERS = {
    "ours": "ours",
    "hivemind": "hivemind",
    "local": "local",
    "local_server_kernels": "local, our kernels",
}
MODES = ("forward", "forward_backward")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How much to measure."""

    batches: tuple[int, ...] = (1, 16, 256)
    """Batch sizes."""
    calls: dict[int, int]
    """Timed calls per repetition, mode and system, by batch size."""
    warmup: dict[int, int]
    """Untimed calls before them."""
    num_reps: int
    """Repetitions (fresh clients each); figures pool their calls."""


QUICK = Plan(calls={1: 20, 16: 10, 256: 4}, warmup={1: 3, 16: 2, 256: 1}, num_reps=1)
FULL = Plan(calls={1: 100, 16: 40, 256: 10}, warmup={1: 10, 16: 5, 256: 2}, num_reps=3)


class Fleet:
    """Every child this run started; stops each, and what it started, by PID."""

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("spawn")
        self.children: list[Child] = []

    def start(self, role: str, options: dict[str, Any] | None = None) -> tuple[Child, Any]:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=child_entry, args=(role, theirs, options or {}), name=role, daemon=False
        )
        process.start()
        theirs.close()
        child = Child(role, process, ours)
        self.children.append(child)
        return child, self.receive(child, STARTUP_TIMEOUT)

    def receive(self, child: Child, timeout: float) -> Any:
        return receive_from(child, timeout)

    def measure(self, child: Child, options: dict[str, Any]) -> list[float]:
        child.conn.send(("measure", options))
        seconds: list[float] = self.receive(child, MEASURE_TIMEOUT)
        return seconds

    def stop(self, child: Child) -> None:
        tree = descendants(child.process.pid) if child.process.pid else []
        with contextlib.suppress(OSError, ValueError):
            child.conn.send(("stop", None))
        child.process.join(STOP_GRACE)
        if child.process.is_alive():
            child.process.terminate()
            child.process.join(5.0)
        if child.process.is_alive():
            child.process.kill()
            child.process.join(5.0)
        with contextlib.suppress(OSError):
            child.conn.close()
        stop_pids(tree)
        stop_pids(child.daemon_pids)
        if child.process.pid:
            remove_shared_memory_of([child.process.pid])
        self.children.remove(child)

    def close(self) -> None:
        for child in list(self.children):
            self.stop(child)


Results = dict[tuple[str, str, int], list[float]]  # (system, mode, batch) -> seconds


#: Timed calls per turn: systems take turns in slices this long, so a load that comes and
#: goes on a shared machine falls on all of them alike.
CALLS_PER_TURN = 5


def _drop_hivemind(servers: dict[str, Any], notes: list[str], where: str, error: Exception) -> None:
    notes.append(f"hivemind failed {where}; dropped: {error}")
    print(f"hivemind failed {where}, measuring without it: {error}", file=sys.stderr)
    servers.pop("hivemind", None)


def _repetition(
    fleet: Fleet,
    plan: Plan,
    order: list[str],
    servers: dict[str, Any],
    rep: int,
    notes: list[str],
    results: Results,
) -> None:
    """Fresh clients for every system; then, for each batch size and mode, the systems
    take turns of ``CALLS_PER_TURN`` timed calls (each turn after its own warm-up)."""
    clients: dict[str, Child] = {}
    try:
        for system in order:
            role = "local" if system.startswith("local") else f"{system}_client"
            try:
                clients[system], _ = fleet.start(role, servers[system])
            except BenchError as e:
                if system != "hivemind":
                    raise
                _drop_hivemind(servers, notes, f"to start a client in repetition {rep + 1}", e)
        for batch in plan.batches:
            for mode in MODES:
                left = plan.calls[batch]
                while left > 0:
                    calls = min(CALLS_PER_TURN, left)
                    left -= calls
                    for system in [s for s in order if s in clients]:
                        options = {
                            "mode": mode,
                            "batch": batch,
                            "calls": calls,
                            "warmup": plan.warmup[batch],
                        }
                        try:
                            seconds = fleet.measure(clients[system], options)
                        except BenchError as e:
                            if system != "hivemind":
                                raise
                            _drop_hivemind(servers, notes, f"in repetition {rep + 1}", e)
                            fleet.stop(clients.pop(system))
                            continue
                        results.setdefault((system, mode, batch), []).extend(seconds)
                line = "  ".join(
                    f"{s} {median(results[(s, mode, batch)]) * 1e3:.1f}"
                    for s in order
                    if (s, mode, batch) in results
                )
                label = "fwd" if mode == "forward" else "fwd+bwd"
                print(
                    f"  rep {rep + 1}/{plan.num_reps} {label} batch {batch}: {line} (ms)",
                    flush=True,
                )
    finally:
        for client in clients.values():
            fleet.stop(client)


def measure(
    plan: Plan,
    systems: list[str],
    notes: list[str],
    *,
    fused: bool,
    kernels: str,
    placement: Placement = LOOPBACK,
) -> tuple[Results, str]:
    """``fused``: every system steps torch's fused Adam (else its plain, per-op one);
    ``kernels``: our server's ``linear_kernels``. Returns the results and the kernels our
    server's Linear layers used; "local_server_kernels" runs only if they are not
    torch's (else it would be "local" again). Servers run at ``placement``'s rank 0,
    clients at rank 1; the local module (no network) runs where this process does."""
    results: Results = {}
    fleet = Fleet()
    used = "torch"
    try:
        servers: dict[str, Any] = {"local": {"fused_adam": fused}}
        for system in systems:
            if system.startswith("local"):
                continue
            options = {
                "fused_adam": fused,
                "linear_kernels": kernels,
                "namespace": placement.namespace(0),
                "host": placement.host(0),
            }
            try:
                _, servers[system] = fleet.start(f"{system}_server", options)
                servers[system]["namespace"] = placement.namespace(1)
            except BenchError as e:
                if system != "hivemind":
                    raise
                notes.append(f"hivemind could not start: {e}")
                print(f"hivemind could not start, measuring without it: {e}", file=sys.stderr)
        used = servers["ours"]["kernels"]
        if used != "torch":
            servers["local_server_kernels"] = {"fused_adam": fused, "linear_kernels": used}
        print(f"  our server's Linear layers compute with {used}'s kernels", flush=True)
        for rep in range(plan.num_reps):
            order = [s for s in systems if s in servers]
            shift = rep % len(order)
            _repetition(fleet, plan, order[shift:] + order[:shift], servers, rep, notes, results)
    finally:
        fleet.close()
    return results, used


# --- pipelines: a 3-stage model on 3 stage servers vs the same model in one process -----

PIPELINE_MODELS: dict[str, tuple[tuple[int, ...], ...]] = {
    "digits": ((64, 128), (128, 256, 128), (128, 10)),
    "wide": ((512, 2048, 512),) * 3,
}


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """How much pipeline training to time."""

    steps: dict[str, int]
    """Timed steps per model; each step trains ``in_flight`` micro-batches."""
    warmup_steps: int = 2
    micro_batch: int = 32
    in_flight: int = 4


QUICK_PIPELINE = PipelinePlan(steps={"digits": 10, "wide": 3})
FULL_PIPELINE = PipelinePlan(steps={"digits": 60, "wide": 15})


def _local_seconds(
    widths: tuple[tuple[int, ...], ...], steps: list[Any], warmup: int, kernels: str
) -> float:
    import torch
    import torch.nn.functional as F

    from swarm.experts.kernels import use_linear_kernels
    from swarm.pipeline import MLPStages

    local = MLPStages(widths=widths).build_local()
    use_linear_kernels(local, kernels)  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(local.parameters(), lr=0.01)

    def train(step: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for x, y in step:  # one micro-batch after the other: one process, one thread
            optimizer.zero_grad()
            F.cross_entropy(local(x), y).backward()
            optimizer.step()

    return timed_steps(steps, warmup, train)


def _pipeline_seconds(
    widths: tuple[tuple[int, ...], ...], steps: list[Any], plan: PipelinePlan, kernels: str
) -> float:
    import torch.nn.functional as F

    from peers.dht import BlockingDHT, DHTConfig
    from peers.testing import LocalSwarm
    from swarm.experts import ExpertCallConfig
    from swarm.pipeline import PipelineConfig, RemoteSequential

    options: dict[str, Any] = {
        "widths": [list(w) for w in widths],
        "optimizer": "sgd",
        "lr": 0.01,
        "average_interval": 3600.0,  # one server per stage: no replicas to average
        "max_batch_size": plan.micro_batch * plan.in_flight,
        "linear_kernels": kernels,
        "synchronous": False,  # a step per backward, as measured before (bench_pipeline.py)
    }
    with LocalSwarm(startup_timeout=STARTUP_TIMEOUT) as swarm:
        (boot,) = swarm.start(1, target="peers.dht.testing:dht_node")
        boot.wait_report("joined", STARTUP_TIMEOUT)
        servers = swarm.start(
            len(widths),
            target="swarm.pipeline.testing:stage_server",
            options={**options, "initial_peers": [boot.maddr]},
            per_peer_options=[{"stage": i} for i in range(len(widths))],
        )
        for server in servers:
            server.wait_report("serving", STARTUP_TIMEOUT)
        calls = ExpertCallConfig(forward_timeout=CALL_TIMEOUT, backward_timeout=CALL_TIMEOUT)
        config = PipelineConfig(num_stages=len(widths), calls=calls, seed=0, synchronous=False)
        with BlockingDHT(config=DHTConfig(initial_peers=(boot.maddr,))) as dht:
            pipeline = RemoteSequential(dht, config)
            seconds = timed_steps(
                steps, plan.warmup_steps, lambda step: pipeline.train_step(step, F.cross_entropy)
            )
            if pipeline.statistics().num_failed_calls:
                raise BenchError(f"pipeline calls failed: {pipeline.statistics()}")
    return seconds


def measure_pipeline(plan: PipelinePlan, kernels: str) -> tuple[dict[str, float], dict[str, float]]:
    """Samples/s of the pipeline and of the local model, per model; their ratios. The
    stage servers and the local model both compute with ``kernels``, so the ratio is
    the pipeline's, not the kernels'."""
    import torch

    from swarm.experts.kernels import onednn_is_faster

    torch.set_num_threads(1)
    if kernels == "auto":  # decided once, here, for the servers and the local model alike
        kernels = "onednn" if onednn_is_faster() else "torch"
    figures: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for name, widths in PIPELINE_MODELS.items():
        gen = torch.Generator().manual_seed(0)
        steps = [
            [
                (
                    torch.randn(plan.micro_batch, widths[0][0], generator=gen),
                    torch.randint(0, widths[-1][-1], (plan.micro_batch,), generator=gen),
                )
                for _ in range(plan.in_flight)
            ]
            for _ in range(plan.warmup_steps + plan.steps[name])
        ]
        local_s = _local_seconds(widths, steps, plan.warmup_steps, kernels)
        pipeline_s = _pipeline_seconds(widths, steps, plan, kernels)
        # again, after: the quieter of the two (the machine is shared)
        local_s = min(local_s, _local_seconds(widths, steps, plan.warmup_steps, kernels))
        samples = plan.steps[name] * plan.in_flight * plan.micro_batch
        figures[f"pipeline_{name}_samples_per_s"] = round(samples / pipeline_s, 1)
        figures[f"local_{name}_samples_per_s"] = round(samples / local_s, 1)
        ratios[f"pipeline_vs_local_{name}"] = round(local_s / pipeline_s, 3)
        print(
            f"  pipeline {name}: {samples / pipeline_s:.0f} samples/s on 3 stage servers, "
            f"local {samples / local_s:.0f} samples/s ({local_s / pipeline_s:.2f}x)",
            flush=True,
        )
    return figures, ratios


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced run, under a minute")
    parser.add_argument("--no-hivemind", action="store_true", help="measure ours only")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the pipeline section")
    parser.add_argument(
        "--plain-adam",
        action="store_true",
        help="every system steps torch's plain Adam instead of the fused one (how runs "
        "before 2026-11-30 measured)",
    )
    parser.add_argument(
        "--linear-kernels",
        choices=["auto", "torch", "onednn"],
        default="auto",
        help="our servers' Linear kernels (swarm.experts.kernels; 'torch' measures as runs "
        "before 2026-12-01 did); hivemind and 'local' always use torch's (auto)",
    )
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    notes: list[str] = []
    version, why = (
        (None, "disabled with --no-hivemind")
        if args.no_hivemind
        else importable_hivemind("hivemind.moe", STARTUP_TIMEOUT)
    )
    if version is None:
        notes.append(why)
        print(f"hivemind: not measured: {why}", file=sys.stderr)
    mode = "quick" if args.quick else "full"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"experts benchmark ({mode}): ffn {1024}x{4096}, loopback, 1 torch thread per process, "
        f"{os.cpu_count()} CPUs, load average {load:.2f}; hivemind {version or 'absent'}; "
        f"{'plain' if args.plain_adam else 'fused'} Adam in every system"
    )
    began = time.monotonic()
    systems = [s for s in SYSTEMS if s != "hivemind" or version]
    results, used = measure(
        plan, systems, notes, fused=not args.plain_adam, kernels=args.linear_kernels
    )
    total_s = time.monotonic() - began

    def med(system: str, mode: str, batch: int) -> float | None:
        values = results.get((system, mode, batch))
        return median(values) if values else None

    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    rows = [["measurement", *(HEADERS[s] for s in SYSTEMS), "ratio"]]
    for batch in plan.batches:
        for kind in MODES:
            label = "fwd" if kind == "forward" else "fwd+bwd"
            for system in SYSTEMS:
                value = med(system, kind, batch)
                if value is not None:
                    figures[f"{kind}_ms_b{batch}_{system}"] = round(value * 1e3, 3)
                    figures[f"{kind}_samples_per_s_b{batch}_{system}"] = round(batch / value, 1)
            ratio = _ratio(med("hivemind", kind, batch), med("ours", kind, batch))
            key = f"{'latency' if batch < 256 else 'throughput'}_{kind}_b{batch}"
            if ratio is not None:
                ratios[key] = ratio
            cells = [med(s, kind, batch) for s in SYSTEMS]
            rows.append(
                [f"{label} batch {batch} (ms)"]
                + [f"{c * 1e3:.2f}" if c else "-" for c in cells]
                + [f"{ratio:.2f}x" if ratio else "-"]
            )
            if batch == max(plan.batches):
                rows.append(
                    [f"{label} batch {batch} (samples/s)"]
                    + [f"{batch / c:.0f}" if c else "-" for c in cells]
                    + [""]
                )
    print_table(
        f"medians over {plan.num_reps} reps; ratio = hivemind / ours (> 1: ours better)", rows
    )
    if not args.no_pipeline:
        pipeline_plan = QUICK_PIPELINE if args.quick else FULL_PIPELINE
        print(
            f"pipelines: 3 stage servers (1 process each) vs one process, "
            f"{pipeline_plan.in_flight} micro-batches of {pipeline_plan.micro_batch} in flight"
        )
        pipeline_figures, pipeline_ratios = measure_pipeline(pipeline_plan, args.linear_kernels)
        figures.update(pipeline_figures)
        ratios.update(pipeline_ratios)
        total_s = time.monotonic() - began
    for note in notes:
        print(f"note: {note}")
    print(f"total {total_s:.1f} s")
    emit_result(
        "experts",
        figures,
        ratios,
        mode=mode,
        hivemind=version,
        linear_kernels=used,
        load_average=round(load, 2),
        notes=notes,
        plan={k: v for k, v in asdict(plan).items()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
