"""The service skeleton (peers/service.py): undo on a failed or cancelled start, one
exit order, the caller's exception left as it is."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from peers.service import Service


class Recorder(Service):
    """Registers a handler, runs a task and enters an inner context; records what
    happens, in order."""

    def __init__(self, log: list[str], *, fail_start: bool = False, block: bool = False) -> None:
        super().__init__()
        self.log = log
        self.fail_start = fail_start
        self.block = block
        self.started = asyncio.Event()

    async def _start(self) -> None:
        self._serve(lambda: self.log.append("registered"), lambda: self.log.append("removed"))
        self._spawn(self._work())
        await asyncio.sleep(0)  # the task starts waiting
        await self._enter(self._inner())
        if self.block:
            self.started.set()
            await asyncio.Event().wait()
        if self.fail_start:
            raise ConnectionError("cannot bind")

    async def _stop(self) -> None:
        self.log.append("stop")

    async def _work(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.log.append("task cancelled")
            raise

    @asynccontextmanager
    async def _inner(self) -> AsyncIterator[None]:
        self.log.append("inner entered")
        try:
            yield
        finally:
            self.log.append("inner left")


EXIT_ORDER = ["stop", "removed", "task cancelled", "inner left"]


def test_exit_runs_in_one_order() -> None:
    log: list[str] = []

    async def main() -> None:
        async with Recorder(log):
            await asyncio.sleep(0)
            assert log == ["registered", "inner entered"]

    asyncio.run(main())
    assert log == ["registered", "inner entered", *EXIT_ORDER]


def test_a_failed_start_is_undone_and_its_error_raised() -> None:
    log: list[str] = []

    async def main() -> None:
        with pytest.raises(ConnectionError, match="cannot bind"):
            async with Recorder(log, fail_start=True):
                raise AssertionError("the body must not run")

    asyncio.run(main())
    assert log == ["registered", "inner entered", *EXIT_ORDER]


def test_a_start_cancelled_midway_is_undone() -> None:
    log: list[str] = []

    async def main() -> None:
        service = Recorder(log, block=True)

        async def enter() -> None:
            async with service:
                raise AssertionError("the body must not run")

        task = asyncio.create_task(enter())
        await service.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert log == ["registered", "inner entered", *EXIT_ORDER]


def test_the_callers_exception_is_not_wrapped() -> None:
    log: list[str] = []

    async def main() -> None:
        with pytest.raises(KeyError):
            async with Recorder(log):
                raise KeyError("mine")

    asyncio.run(main())
    assert log[-4:] == EXIT_ORDER


def test_a_service_is_entered_once_and_spawns_only_while_running() -> None:
    async def main() -> None:
        service = Recorder([])
        async with service:
            with pytest.raises(RuntimeError, match="already entered"):
                async with service:
                    pass
        work = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="not running"):
            service._spawn(work)  # closed, not left unawaited

    asyncio.run(main())
