"""``with`` support for objects that have ``close()``: the blocking facades and
``LocalSwarm``. A module of its own, importing nothing of the peer stack, so that
``peers.testing`` (which starts peers in other processes) can use it cheaply."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class ClosesOnExit:
    """Leaving a ``with`` block calls ``close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
