"""Task factories that are wrong in each way a user's can be (``swarm train --task``)."""

from __future__ import annotations

NOT_CALLABLE = 42


def raises() -> object:
    raise RuntimeError("no data here")


def returns_a_dict() -> object:
    return {"model": None}
