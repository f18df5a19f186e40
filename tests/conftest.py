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
        "tests/swarm/test_pipeline_sync_swarm.py",
        "tests/swarm/test_train_nat.py",
        "tests/swarm/test_train_wan.py",
    }
)

#: Modules with a test that keeps one core busy for tens of seconds in the test process
#: itself (the thousand-schedule fault checker). Next to a swarm on the other worker it
#: starved the swarm's processes, and a test on a fixed gossip period failed; so they
#: run in the swarms' unit, before or after the swarms, never beside them.
CPU_BOUND_MODULES = frozenset({"tests/averaging/test_fault_checker.py"})


#: Modules whose every test is ``slow`` (besides the swarm modules above): they start
#: processes, a namespace lab or a benchmark, so each takes seconds to a minute. ``pytest
#: -m "not slow"`` leaves them (and the tests marked ``slow`` one by one) out: the quick
#: suite for the edit-test loop (CONTRIBUTING.md, "How tests are organised"). The plain
#: ``pytest`` (the README's command, CI's) runs everything.
SLOW_MODULES = SWARM_MODULES | frozenset(
    {
        "tests/peers/dht/test_dht_wan.py",
        "tests/peers/dht/test_swarm.py",
        "tests/peers/dht/test_sybil_lab.py",
        "tests/peers/test_handshake_flood.py",
        "tests/peers/test_keepalive_netns.py",
        "tests/peers/test_nat_lab.py",
        "tests/peers/test_netlab.py",
        "tests/peers/test_netlab_links.py",
        "tests/swarm/test_cli_train.py",
        "tests/swarm/test_experts_swarm.py",
        "tests/swarm/test_pipeline_cli.py",
        "tests/swarm/test_private_swarm.py",
        "tests/test_benchmarks_quick.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("::", 1)[0] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def swarm_scope(nodeid: str) -> str:
    """The unit of work a test belongs to: ``swarms`` for the busy swarm modules and the
    CPU-bound ones, else the test itself."""
    module = nodeid.split("::", 1)[0]
    return "swarms" if module in SWARM_MODULES | CPU_BOUND_MODULES else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under xdist's default mode (``load``), the scheduler below; any other ``--dist``
    given on the command line is left to xdist."""
    # xdist's own grouping (--dist loadgroup, the xdist_group marker) renames each test's
    # nodeid, which pytest 9.2 no longer lets a plugin do: the groups silently split. A
    # scheduler that scopes by module path needs no renaming.
    if config.getvalue("dist") != "load":
        return None
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
