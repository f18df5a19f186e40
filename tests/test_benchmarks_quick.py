"""Smoke tests of the benchmarks: each runs end to end at a tiny size and ends with its
JSON line. Timing is never asserted (CONTRIBUTING.md, "Benchmarks"); correctness checks
inside a benchmark are, since a benchmark that measures a wrong result measures
nothing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HAVE_HIVEMIND = importlib.util.find_spec("hivemind") is not None


def _run(script: str, *args: str, timeout: float) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(240)
def test_allreduce_benchmark_runs_and_checks_results() -> None:
    args = ["--quick", "--sizes", "256K", "--rounds", "1", "--step-rounds", "1"]
    if not HAVE_HIVEMIND:
        args.append("--no-hivemind")  # ours and the raw TCP limit still run
    result = _run("bench_allreduce.py", *args, timeout=220)
    assert result["benchmark"] == "allreduce"
    figures, ratios, notes = result["figures"], result["ratios"], result["notes"]
    assert isinstance(figures, dict) and isinstance(ratios, dict) and isinstance(notes, list)
    for codec in ("none", "float16", "uint8"):
        assert f"256K_{codec}_round_seconds_ours" in figures
        assert f"256K_{codec}_step_seconds_ours" in figures
        # A ratio is given only for a result that passed its check against the true mean.
        assert f"256K_{codec}_fraction_of_bound" in ratios
    assert figures["256K_raw_per_peer_MB_per_s"] > 0
    assert not [n for n in notes if str(n).startswith("ours") and "WRONG" in str(n)]


@pytest.mark.timeout(300)
def test_nat_benchmark_runs() -> None:
    from peers.netlab import lab_available

    # The smallest run that still goes through every part (training in the lab with
    # public peers only: laptops behind NAT training are tests/swarm/test_train_nat.py's).
    lab = ["--train-steps", "12", "--punch-trials", "1", "--scenarios", "public"]
    args = ["--quick", *lab] if lab_available()[0] else ["--quick", "--no-lab"]
    result = _run("bench_nat.py", *args, timeout=280)
    assert result["benchmark"] == "nat"
    ratios = result["ratios"]
    assert isinstance(ratios, dict)
    assert 0 < ratios["relayed_throughput_fraction_of_direct"]
    if "--no-lab" not in args:
        assert "hole_punch_success_fraction" in ratios
        assert result["figures"]["training_samples_per_s_public"] > 0


@pytest.mark.timeout(120)
def test_long_fat_pipe_measurement_runs() -> None:
    from peers.netlab import lab_available

    result = _run(
        "measure_long_fat_pipe.py", "--quick", "--megabytes", "2", "--reps", "2", timeout=100
    )
    assert result["benchmark"] == "long_fat_pipe"
    if not lab_available()[0]:
        assert result["skipped"]
        return
    figures, ratios = result["figures"], result["ratios"]
    assert isinstance(figures, dict) and isinstance(ratios, dict)
    assert figures["default_buffers_both_threaded_MB_per_s"] > 0
    assert 0 < ratios["default_buffers_both_ours_fraction_of_link"] <= 1


@pytest.mark.skipif(not HAVE_HIVEMIND, reason="the baseline column is hivemind's serializer")
def test_msgpack_bomb_benchmark_runs() -> None:
    result = _run("bench_msgpack_bomb.py", "--quick", timeout=200)
    assert result["benchmark"] == "msgpack_bomb"
    figures = result["figures"]
    assert isinstance(figures, dict)
    assert figures["ours"]["refused"] and not figures["hivemind"]["refused"]


@pytest.mark.timeout(200)
def test_handshake_flood_benchmark_runs() -> None:
    from peers import limits
    from peers.netlab import lab_available

    args = ["--quick", "--seconds", "1"] + ([] if HAVE_HIVEMIND else ["--no-hivemind"])
    result = _run("bench_handshake_flood.py", *args, timeout=180)
    assert result["benchmark"] == "handshake_flood"
    if not lab_available()[0]:
        return
    figures, ratios = result["figures"], result["ratios"]
    assert isinstance(figures, dict) and isinstance(ratios, dict)
    # The rate binds: over a flood of s >= 1 seconds the flooder completes at most the
    # burst plus s times the rate; and an honest host was served during the flood.
    bound = limits.HANDSHAKE_BURST_PER_IP + limits.HANDSHAKE_RATE_PER_IP + 1
    assert 0 < figures["ours_handshakes_per_s"] <= bound
    assert figures["ours_honest_ping_seconds"] > 0  # NaN when the ping failed
    if HAVE_HIVEMIND:
        assert "flood_cpu" in ratios


@pytest.mark.timeout(240)
def test_pipeline_benchmark_runs_and_checks_the_synchronous_losses() -> None:
    result = _run(
        "bench_pipeline.py", "--quick", "--models", "wide,offcpu", "--widths", "64", timeout=220
    )
    assert result["benchmark"] == "pipeline"
    figures, ratios = result["figures"], result["ratios"]
    assert isinstance(figures, dict) and isinstance(ratios, dict)
    assert set(ratios) == {
        f"pipeline_vs_local_{model}_{mode}"
        for model in ("wide", "offcpu")
        for mode in ("sync", "async")
    }
    assert 0 <= figures["square_cube_d64_comm_share"] <= 1


@pytest.mark.parametrize(
    ("script", "args", "says"),
    [
        ("bench_dht.py", ["--alpha", "0"], "--alpha 0: our lookups need at least 1"),
        ("bench_wan.py", ["--dht-peers", "3"], "--dht-peers 3: too few peers"),
        ("bench_wan.py", ["--scenarios", "dht,nowhere"], "unknown scenario(s) nowhere"),
        ("bench_wan.py", ["--train-tasks", "digits,imagenet"], "give each once, from digits"),
        ("bench_wan.py", ["--train-samples", "10"], "at least one DiLoCo period"),
        ("bench_wan.py", ["--train-modes", "diloco,async"], "--train-modes diloco,async: give"),
        ("bench_wan.py", ["--train-outer-momentum", "1"], "outer_momentum must be in [0, 1)"),
        ("bench_wan.py", ["--train-eval-every", "-1"], "eval_every must be >= 0"),
        ("bench_wan.py", ["--connections-per-member", "0"], "invalid choice: 0 (choose from 1"),
        ("bench_pipeline.py", ["--models", "wide,gpt5"], "unknown model(s) gpt5"),
        ("bench_pipeline.py", ["--widths", "64,30"], "each a multiple of the 4 heads"),
        ("measure_long_fat_pipe.py", ["--reps", "1"], "the first repetition is untimed"),
        ("measure_long_fat_pipe.py", ["--megabytes", "0"], "--megabytes 0: give at least 1"),
        ("measure_long_fat_pipe.py", ["--rate-mbit", "-5"], "give a rate above 0"),
    ],
)
def test_bad_benchmark_flags_fail_at_once_with_a_clear_error(
    script: str, args: list[str], says: str
) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
