"""Event loop choice: uvloop where installed (Linux, macOS), the standard loop elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for the fastest event loop available here."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the best loop (uvloop if installed)."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
