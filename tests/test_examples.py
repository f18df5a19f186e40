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
    "diloco_charlm.py": ["--outer-steps", "2", "--inner-steps", "5"],
}


def test_every_example_is_exercised() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
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
