"""The suite's schedule under pytest-xdist (tests/conftest.py): the busy swarm modules
and the CPU-bound ones share one worker, so a module renamed or moved must not drop out
of that group unseen; nor a slow module out of the slow tier."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (  # type: ignore[import-not-found]
    CPU_BOUND_MODULES,
    SLOW_MODULES,
    SWARM_MODULES,
    pytest_collection_modifyitems,
    swarm_scope,
)

ROOT = Path(__file__).resolve().parent.parent


def test_every_swarm_module_exists() -> None:
    named = SWARM_MODULES | CPU_BOUND_MODULES | SLOW_MODULES
    missing = sorted(m for m in named if not (ROOT / m).is_file())
    assert not missing, f"tests/conftest.py names modules that are gone: {missing}"


def test_swarm_modules_share_one_scope_and_other_tests_keep_their_own() -> None:
    scopes = {swarm_scope(f"{m}::test_x[1]") for m in SWARM_MODULES | CPU_BOUND_MODULES}
    assert scopes == {"swarms"}
    other = "tests/peers/test_yamux.py::test_window"
    assert swarm_scope(other) == other


def test_the_slow_tier_is_marked(pytestconfig: pytest.Config) -> None:
    """A test of a slow module carries the ``slow`` marker that ``-m "not slow"`` reads."""

    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid
            self.markers: list[str] = []

        def add_marker(self, marker: pytest.MarkDecorator) -> None:
            self.markers.append(marker.name)

    slow, quick = Item("tests/test_benchmarks_quick.py::test_x"), Item("tests/test_lint.py::test_y")
    pytest_collection_modifyitems([slow, quick])
    assert slow.markers == ["slow"] and quick.markers == []
    assert SWARM_MODULES <= SLOW_MODULES
    assert "slow" in "".join(pytestconfig.getini("markers"))
