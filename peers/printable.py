"""Text a remote peer chose, made safe to print or log (pure: no I/O, no clock;
CONTRIBUTING.md, "Protocols are pure state machines").

Agent strings, protocol names, addresses from records and remote error messages come
from strangers. Printed as they are, an ANSI escape sequence could rewrite the user's
terminal (clear it, move the cursor over earlier lines, set its title) and a newline or
carriage return could forge log lines; Unicode bidirectional overrides can make text
read differently from what it is. :func:`printable` writes every such character as a
``\\x..``/``\\u....`` escape and cuts overlong text.
"""

from __future__ import annotations

import unicodedata

#: Longest text kept from a remote string; the rest becomes "...".
MAX_PRINTABLE_CHARS = 300

#: Controls, invisible characters that reorder or hide text (bidi controls, zero-width
#: ones), unassigned code points, and separators other than the plain space (which
#: would disguise one string as another).
_FORMAT_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})


def _escape(char: str) -> str:
    code = ord(char)
    return (
        f"\\x{code:02x}"
        if code < 0x100
        else f"\\u{code:04x}"
        if code < 0x10000
        else f"\\U{code:08x}"
    )


def printable(text: object, limit: int = MAX_PRINTABLE_CHARS) -> str:
    """``text`` (made a ``str``) with control, format, unassigned and separator
    characters escaped (the plain space stays; tab, newline and escape do not), cut to
    ``limit`` characters. The result is ``str.isprintable()``."""
    value = text if isinstance(text, str) else str(text)
    cut = len(value) > limit
    out = "".join(
        _escape(c) if c != " " and unicodedata.category(c) in _FORMAT_CATEGORIES else c
        for c in value[:limit]
    )
    return out + "..." if cut else out


__all__ = ["MAX_PRINTABLE_CHARS", "printable"]
