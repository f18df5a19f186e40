from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from peers.runtime import run

#: Modules whose tests each run a swarm of processes busy enough to fill both cores of the
#: 2-core CI machine. Under ``-n 2`` (two pytest-xdist workers, opt-in), the scheduler
#: below hands all of these to one worker as one unit, so they run one after the other
#: while the other worker takes the rest. Two of them at once took up to twice as long
#: (docs/benchmarks.md, "The test suite").
SWARM_MODULES = frozenset(
    {
        "tests/averaging/test_agreement_netns.py",
        "tests/averaging/test_allreduce_faults.py",
        "tests/averaging/test_averaging_nat.py",
        "tests/averaging/test_averaging_wan.py",
        "tests/averaging/test_gossip_and_clip.py",
        "tests/averaging/test_matchmaking_swarm.py",
        "tests/swarm/test_collaborative.py",
        "tests/swarm/test_hostile_gradients.py",
        "tests/swarm/test_hostile_progress.py",
        "tests/swarm/test_hostile_reducer.py",
        "tests/swarm/test_hostile_state.py",
        "tests/swarm/test_pipeline_nat.py",
        "tests/swarm/test_pipeline_swarm.py",
        "tests/swarm/test_train_nat.py",
    }
)


def swarm_scope(nodeid: str) -> str:
    """The unit of work a test belongs to: ``swarms`` for the busy swarm modules, else
    the test itself."""
    return "swarms" if nodeid.split("::", 1)[0] in SWARM_MODULES else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # xdist's own grouping (--dist loadgroup, the xdist_group marker) renames each test's
    # nodeid, which pytest 9.2 no longer lets a plugin do: the groups silently split. A
    # scheduler that scopes by module path needs no renaming.
    from xdist.scheduler import LoadScopeScheduling

    class SwarmsOnOneWorker(LoadScopeScheduling):  # type: ignore[misc]
        """``--dist loadscope`` with the busy swarm modules as one scope and every other
        test its own. Scopes go out largest first, so the swarms start at once."""

        def _split_scope(self, nodeid: str) -> str:
            return swarm_scope(nodeid)

    return SwarmsOnOneWorker(config, log)


@pytest.fixture
def arun() -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Run a coroutine on the same loop the library uses (uvloop where installed)."""
    return run
