"""A character corpus that every Python installation already has: its standard library.

The ``charlm`` task trains on the source of a fixed list of standard-library modules,
read at run time through the import system (``loader.get_source``, so a zipped standard
library works too), without importing them and without any download. The text is the
same on every run with the same Python; it differs a little between Python versions,
which is fine for a demo and for comparing runs on one machine.

Characters are 7-bit ASCII: CRLF becomes LF, and any other character outside ASCII
(a handful in the chosen modules) becomes ``?``, so a byte is a character and
bits-per-character means what it says.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
from dataclasses import dataclass
from functools import cache

from swarm.errors import TaskError

DEFAULT_MODULES: tuple[str, ...] = (
    "argparse",
    "ast",
    "contextlib",
    "dataclasses",
    "difflib",
    "enum",
    "functools",
    "inspect",
    "textwrap",
    "threading",
    "tokenize",
    "typing",
)
"""Single-file pure-Python modules present in every CPython from 3.11 on (~740 kB)."""

MIN_CORPUS_CHARS = 100_000
"""Below this a model learns nothing worth showing; a stripped install must say so."""

VOCAB_SIZE = 128
"""7-bit ASCII."""


@dataclass(frozen=True)
class Corpus:
    """Train and test text: each module's first part trains, its last part tests."""

    train: bytes
    test: bytes
    modules: tuple[str, ...]
    """The modules whose source was found (a stripped install may lack some)."""


def _module_source(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not isinstance(spec.loader, importlib.abc.InspectLoader):
        return None
    try:
        return spec.loader.get_source(name)
    except (ImportError, OSError):
        return None


def to_ascii(text: str) -> bytes:
    """``text`` with CRLF as LF and every non-ASCII character as ``?``."""
    return text.replace("\r\n", "\n").encode("ascii", errors="replace")


@cache
def stdlib_corpus(modules: tuple[str, ...] = DEFAULT_MODULES, test_fraction: float = 0.1) -> Corpus:
    """The corpus from ``modules``' sources, split per module: the last ``test_fraction``
    of each module's text is test text (so both splits cover every module).

    Raises :class:`TaskError` if fewer than :data:`MIN_CORPUS_CHARS` characters of
    source are found (an installation without ``.py`` sources).
    """
    if not 0 < test_fraction < 1:
        raise TaskError(f"test_fraction must be in (0, 1), got {test_fraction}")
    train: list[bytes] = []
    test: list[bytes] = []
    found: list[str] = []
    for name in modules:
        source = _module_source(name)
        if not source:
            continue
        text = to_ascii(source)
        cut = len(text) - int(len(text) * test_fraction)
        train.append(text[:cut])
        test.append(text[cut:])
        found.append(name)
    total = sum(map(len, train)) + sum(map(len, test))
    if total < MIN_CORPUS_CHARS:
        raise TaskError(
            f"found only {total} characters of standard-library source in {found}; "
            "this Python installation seems to ship without .py sources"
        )
    return Corpus(train=b"\n".join(train), test=b"\n".join(test), modules=tuple(found))
