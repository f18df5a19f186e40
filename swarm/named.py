"""Things a config names: a built-in name, or ``package.module:attribute`` imported (the
operator's own code, named in their own config)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping


def find_named(name: str, builtin: Mapping[str, object], what: str) -> object:
    """``builtin[name]``, or the attribute ``package.module:attribute`` names. ValueError,
    saying why, if neither: ``what`` names the kind of thing in the message."""
    if name in builtin:
        return builtin[name]
    location, _, attribute = name.partition(":")
    if not location or not attribute:
        raise ValueError(
            f"{what} {name!r} is neither built in {sorted(builtin)} nor MODULE:ATTRIBUTE"
        )
    try:
        return getattr(importlib.import_module(location), attribute)
    except Exception as e:  # the operator's module may raise anything on import
        raise ValueError(f"cannot load {what} {name!r}: {e!r}") from e
