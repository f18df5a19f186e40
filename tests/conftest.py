from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from peers.runtime import run


@pytest.fixture
def arun() -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Run a coroutine on the same loop the library uses (uvloop where installed)."""
    return run
