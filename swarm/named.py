"""Things a config names: a built-in name, or ``package.module:attribute`` imported (the
operator's own code, named in their own config)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping


def find_named(name: str, builtin: Mapping[str, object], what: str) -> object:
    """``builtin[name]``, or the attribute ``package.module:attribute`` names. ValueError,
    saying why, if neither: ``what`` names the kind of thing in the message.

    The module is looked up on the Python path, then in the current directory (as
    ``python -m`` would find it; the ``swarm`` console script does not put the current
    directory on the path)."""
    if name in builtin:
        return builtin[name]
    location, _, attribute = name.partition(":")
    if not location or not attribute:
        raise ValueError(
            f"{what} {name!r} is neither built in {sorted(builtin)} nor MODULE:ATTRIBUTE"
        )
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)  # last: an operator's module never shadows an installed one
    try:
        return getattr(importlib.import_module(location), attribute)
    except Exception as e:  # the operator's module may raise anything on import
        raise ValueError(f"cannot load {what} {name!r}: {e!r}") from e
