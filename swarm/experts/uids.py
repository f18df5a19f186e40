"""Expert uids: a name and one or more grid coordinates, e.g. ``ffn.3.7`` or ``stage.2``.

A uid names a cell of an expert grid (for a mixture of experts) or a pipeline stage.
The DHT keeps one key per prefix (``ffn``, ``ffn.3``) whose subkeys are the live next
coordinates, which is what beam search walks (see :mod:`swarm.experts.announce`).
"""

from __future__ import annotations

import re

#: Longest uid: names are short labels; this keeps every DHT key and subkey built from
#: one far below the DHT's 256-byte limits.
MAX_UID_CHARS = 128
#: Most grid dimensions: beam search does one DHT round per dimension.
MAX_GRID_DIMS = 8
#: Largest coordinate along one dimension (a grid of a million cells per axis is far
#: past any mixture; the bound keeps parsed integers small).
MAX_COORDINATE = 1_000_000

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_UID = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.(0|[1-9][0-9]{0,6}))+")
DELIMITER = "."


def is_valid_uid(uid: object) -> bool:
    return (
        isinstance(uid, str)
        and len(uid) <= MAX_UID_CHARS
        and _UID.fullmatch(uid) is not None
        and uid.count(DELIMITER) <= MAX_GRID_DIMS
        and all(int(c) < MAX_COORDINATE for c in uid.split(DELIMITER)[1:])
    )


def check_uid(uid: str) -> str:
    """``uid`` itself; ValueError saying what is wrong if it is not a valid uid."""
    if not is_valid_uid(uid):
        raise ValueError(
            f"invalid expert uid {uid!r}: expected NAME.COORD[.COORD...], e.g. 'ffn.3.7', "
            f"with at most {MAX_GRID_DIMS} integer coordinates below {MAX_COORDINATE} "
            f"and {MAX_UID_CHARS} characters"
        )
    return uid


def check_name(name: str) -> str:
    """A uid's name part (what a mixture's ``uid_prefix`` is); ValueError if invalid."""
    if not (isinstance(name, str) and len(name) <= MAX_UID_CHARS // 2 and _NAME.fullmatch(name)):
        raise ValueError(f"invalid expert name {name!r}: letters, digits, '_' and '-' only")
    return name


def split_uid(uid: str) -> tuple[str, tuple[int, ...]]:
    """``"ffn.3.7"`` -> ``("ffn", (3, 7))``; ValueError if invalid."""
    name, *coords = check_uid(uid).split(DELIMITER)
    return name, tuple(int(c) for c in coords)


def levels(uid: str) -> list[tuple[str, int]]:
    """The (prefix, next coordinate) pairs that lead to ``uid``:
    ``"ffn.3.7"`` -> ``[("ffn", 3), ("ffn.3", 7)]``."""
    name, coords = split_uid(uid)
    out = []
    prefix = name
    for coord in coords:
        out.append((prefix, coord))
        prefix = f"{prefix}{DELIMITER}{coord}"
    return out


def grid_uids(pattern: str) -> list[str]:
    """Every uid a pattern names: ``"ffn.[0:2].[0:3]"`` -> ``ffn.0.0`` ... ``ffn.1.2``;
    a fixed coordinate (``"ffn.4.[0:2]"``) stays as it is. ValueError if malformed."""
    name, *blocks = pattern.split(DELIMITER)
    check_name(name)
    if not blocks:
        raise ValueError(f"pattern {pattern!r} has no coordinates")
    ranges: list[range] = []
    for block in blocks:
        found = re.fullmatch(r"\[(\d+):(\d+)\]|(\d+)", block)
        if found is None:
            raise ValueError(f"pattern {pattern!r}: block {block!r} is neither N nor [A:B]")
        if found.group(3) is not None:
            ranges.append(range(int(found.group(3)), int(found.group(3)) + 1))
        else:
            ranges.append(range(int(found.group(1)), int(found.group(2))))
    uids = [name]
    for coords in ranges:
        uids = [f"{u}{DELIMITER}{c}" for u in uids for c in coords]
        if len(uids) > 1 << 16:
            raise ValueError(f"pattern {pattern!r} names more than 65536 uids")
    return [check_uid(u) for u in uids]
