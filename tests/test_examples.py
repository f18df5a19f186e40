"""Every example runs as a user runs it (a fresh interpreter), on reduced sizes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUNS = {
    "collaborative_digits.py": ["--steps", "30"],
    "custom_task.py": ["--steps", "20"],
    "diloco_charlm.py": ["--outer-steps", "2", "--inner-steps", "5"],
}


def test_every_example_is_exercised() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(set(RUNS) - {"custom_task.py"}))
def test_example_runs(name: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *RUNS[name]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    steps = RUNS[name][1]
    for rank in (0, 1):
        assert re.search(rf"peer {rank}: test .* after {steps} (global|outer) steps", out.stdout)
    assert "both peers hold the same model: True" in out.stdout


def test_a_custom_task_trained_by_a_swarm_from_the_cli_is_the_one_process_model(
    tmp_path: Path,
) -> None:
    """``swarm demo --task custom_task:make_task``: two trainer processes started with
    ``swarm train --task custom_task:make_task`` against one process training the same
    task on the same examples."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_task.py"), *RUNS["custom_task.py"]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--task custom_task:make_task" in out.stdout  # the join command names it
    assert re.search(r"optimizer steps\s+20\s+20", out.stdout), out.stdout
    row = re.search(r"test loss\s+(\d\.\d+)\s+(\d\.\d+)", out.stdout)
    assert row is not None, out.stdout
    swarm, single = float(row.group(1)), float(row.group(2))
    assert abs(swarm - single) <= 0.01 * single, (swarm, single)
    assert "all 2 peers hold the same model" in out.stdout
