"""What one cut link costs a butterfly round: four peer processes, each in its own
network namespace behind one router; in each round one random pair's link is cut at a
random moment of the round (an nftables drop rule in the router, both ways) and removed
after it. Figures: how many rounds the cut cost 0, 1, or 2 and more of the four peers
(lost: alive and not agreed), the rounds' seconds, and violations of the vote's
promises P1, P3, P4. The experiment is ``tests/averaging/targets/cut_rounds.py``, which
``tests/averaging/test_agreement_netns.py`` asserts on.

Needs root and nftables (the namespace lab, docs/netlab.md).

    .venv/bin/python benchmarks/measure_cut_cost.py --quick       # 8 rounds, under a minute
    .venv/bin/python benchmarks/measure_cut_cost.py --rounds 25
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or a module
# The experiment lives with the test that asserts on it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "averaging"))
from _common import emit_result, median, print_table
from targets.cut_rounds import CutExperiment, run_cut_rounds, violations

from peers.netlab import lab_available

QUICK_ROUNDS = 8


def summarize(experiment: CutExperiment) -> dict[str, float | int]:
    rounds = experiment.rounds
    costs = [len(r.lost) for r in rounds]
    seconds = [max(o.seconds for o in r.outcomes) for r in rounds]
    return {
        "rounds": len(rounds),
        "rounds_costing_0": costs.count(0),
        "rounds_costing_1": costs.count(1),
        "rounds_costing_2_or_more": sum(1 for c in costs if c >= 2),
        "round_seconds_median": round(median(seconds), 3),
        "round_seconds_max": round(max(seconds), 3),
        "return_bound_seconds": experiment.return_bound,
        "cut_window_seconds": round(experiment.window_seconds, 3),
        "rounds_violating": sum(1 for r in rounds if violations(r, experiment.return_bound)),
        "seed": experiment.seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25, help="rounds, each with one cut")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds")
    parser.add_argument("--seed", type=int, default=0, help="draws the pairs and moments")
    args = parser.parse_args()
    available, reason = lab_available()
    if not available:
        print(f"no namespace lab here: {reason}")
        emit_result("cut_cost", {}, {}, notes=[f"skipped: {reason}"])
        return
    num_rounds = QUICK_ROUNDS if args.quick else args.rounds
    experiment = run_cut_rounds(num_rounds=num_rounds, seed=args.seed)
    figures = summarize(experiment)
    print_table(
        "One cut link per round, 4 peers behind one router",
        [
            ["rounds", "cost 0", "cost 1", "cost 2+", "median s", "max s", "return_bound s"],
            [
                str(figures[k])
                for k in (
                    "rounds",
                    "rounds_costing_0",
                    "rounds_costing_1",
                    "rounds_costing_2_or_more",
                    "round_seconds_median",
                    "round_seconds_max",
                    "return_bound_seconds",
                )
            ],
        ],
    )
    bound = experiment.return_bound
    notes = [f"round {r.index}: {v}" for r in experiment.rounds for v in violations(r, bound)]
    emit_result("cut_cost", figures, {}, notes=notes)


if __name__ == "__main__":
    main()
