"""The suite's schedule under pytest-xdist (tests/conftest.py): the busy swarm modules
and the CPU-bound ones share one worker, so a module renamed or moved must not drop out
of that group unseen."""

from __future__ import annotations

from pathlib import Path

from conftest import CPU_BOUND_MODULES, SWARM_MODULES, swarm_scope  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parent.parent


def test_every_swarm_module_exists() -> None:
    missing = sorted(m for m in SWARM_MODULES | CPU_BOUND_MODULES if not (ROOT / m).is_file())
    assert not missing, f"tests/conftest.py names modules that are gone: {missing}"


def test_swarm_modules_share_one_scope_and_other_tests_keep_their_own() -> None:
    scopes = {swarm_scope(f"{m}::test_x[1]") for m in SWARM_MODULES | CPU_BOUND_MODULES}
    assert scopes == {"swarms"}
    other = "tests/peers/test_yamux.py::test_window"
    assert swarm_scope(other) == other
