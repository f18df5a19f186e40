"""Every ```python block in docs/ runs as written (in a fresh interpreter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = [
    (path, i, code)
    for path in sorted((ROOT / "docs").rglob("*.md"))
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S))
]


@pytest.mark.parametrize(
    ("path", "index", "code"), BLOCKS, ids=[f"{p.name}-{i}" for p, i, _ in BLOCKS]
)
def test_doc_snippet_runs(path: Path, index: int, code: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"{path.name} block {index} failed:\n{out.stderr}"
