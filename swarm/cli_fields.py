"""Command-line flags made from config dataclass fields.

A command names the fields it exposes (:class:`Flag`); the flag's name, default and help
come from the field: ``--field-name``, the field's default, and the first sentence of
the docstring written under it. So a default lives in one place, the config, and
``swarm train --help`` says what the library's docs say. A :class:`Flag` only adds what
a field cannot say: a stricter parser (so that a bad value is argparse's usage error,
named after the flag), a metavar, choices, or another name.

Field types map to argparse as follows: ``bool`` with default False is a switch
(``--centered-clip``), with default True a ``--no-...`` switch; ``tuple[X, ...]`` and
``frozenset[X]`` are repeatable (``--listen A --listen B``) or, with ``nargs``, take
several values at once; ``X | None`` is optional; a ``Literal`` offers its values as
choices; anything else takes one value parsed by ``parse`` (default: the type itself).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One config field as a command-line flag."""

    field: str
    """The dataclass field it sets."""
    parse: Callable[[str], Any] | None = None
    """Parses one value (raises ``ValueError`` or ``argparse.ArgumentTypeError`` for a
    bad one); default: the field's type."""
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    name: str | None = None
    """The option string; default ``--field-name`` (``--no-field-name`` for a switch
    that turns a default-True field off)."""
    help: str | None = None
    """Instead of the docstring's first sentence (where the CLI needs other words)."""
    required: bool = False
    nargs: bool = False
    """A tuple field takes its values after one flag (``--initial-peers A B``) instead
    of one per flag."""
    optional: bool = False
    """Absent means None (the caller then leaves the whole config out), not the field's
    default."""

    def option(self, default: Any) -> str:
        if self.name is not None:
            return self.name
        stem = self.field.replace("_", "-")
        return f"--no-{stem}" if default is True else f"--{stem}"

    @property
    def dest(self) -> str:
        return self.field


@functools.cache
def field_docs(cls: type) -> Mapping[str, str]:
    """Each field's docstring (the string literal that follows it in the class body, or
    in the body of the dataclass it inherits it from), as plain text on one line;
    fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object and dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    namespace = vars(sys.modules[cls.__module__])
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for statement, following in zip(body.body, body.body[1:], strict=False):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = plain(following.value.value, namespace)
    return docs


def plain(doc: str, namespace: Mapping[str, Any]) -> str:
    """reStructuredText as terminal text: roles and literals lose their markup, and a
    ``:data:`` role naming a number (in ``namespace``, the config's module, or by its
    dotted path in a module already imported) shows its value, which a user of the
    command can act on."""

    def role(match: re.Match[str]) -> str:
        kind, short, name = match[1], match[2], match[3]
        owner, _, attribute = name.rpartition(".")
        scope = vars(sys.modules[owner]) if owner in sys.modules else namespace
        value = scope.get(attribute) if kind == "data" else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            return f"{value:g}"
        return attribute if short else name

    text = re.sub(r":([a-z]+):`(~?)([^`<]*?)(?:\s*<[^>]*>)?`", role, doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return " ".join(text.split())


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not one inside ``e.g.``)."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text[: match.start()] if match else text


def _help(doc: str) -> str:
    """A flag's help from its field's docstring: the first sentence, lower case first as
    argparse's own help is (an acronym or a name stays as it is)."""
    text = first_sentence(doc)
    word = text.split(" ", 1)[0]
    if not word[1:] or word[1:].islower():
        text = text[0].lower() + text[1:]
    return text


def field_default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"field {field.name} has no default: it cannot be an optional flag")


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, flags: Sequence[Flag]
) -> None:
    """Add ``flags``, fields of the dataclass ``cls``, to ``parser``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for flag in flags:
        field = fields[flag.field]
        default = field_default(field)
        kind, item = _kind(hints[flag.field])
        text = flag.help if flag.help is not None else _help(docs.get(flag.field, ""))
        shown = "" if flag.optional else _shown_default(default, kind)
        if shown:
            text += f" (default {shown})"
        option = flag.option(default)
        common: dict[str, Any] = {"dest": flag.dest, "help": text.replace("%", "%%")}
        if kind is bool:
            action = "store_false" if default is True else "store_true"
            parser.add_argument(option, action=action, default=default, **common)
            continue
        parse = flag.parse or item
        literal = typing.get_args(hints[flag.field]) if _is_literal(hints[flag.field]) else None
        common.update(type=parse, metavar=flag.metavar, choices=flag.choices or literal)
        if flag.required:
            common["required"] = True
        if kind in (tuple, frozenset):
            repeat: dict[str, Any] = {"nargs": "+"} if flag.nargs else {"action": "append"}
            if not flag.nargs:
                common["help"] += "; repeatable"
            parser.add_argument(option, default=None, **repeat, **common)
        else:
            parser.add_argument(option, default=None if flag.optional else default, **common)


def flag_values(args: argparse.Namespace, cls: type, flags: Sequence[Flag]) -> dict[str, Any]:
    """The fields ``flags`` set, from parsed ``args``: ready for ``cls(**values)``. A
    repeatable flag not given keeps the field's default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        kind, _ = _kind(hints[flag.field])
        if kind in (tuple, frozenset):
            value = field_default(fields[flag.field]) if value is None else kind(value)
        values[flag.field] = value
    return values


def _kind(hint: Any) -> tuple[type, Callable[[str], Any]]:
    """(the container or scalar type, how to parse one item) of a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if len(args) != 1:
            raise TypeError(f"{hint} is not one type or None")
        return _kind(args[0])
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return type(args[0]), type(args[0])
    if origin in (tuple, frozenset):
        return origin, args[0]
    if origin is not None:
        raise TypeError(f"no flag for a field of type {hint}")
    return hint, hint


def _is_literal(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Literal


def _shown_default(default: Any, kind: type) -> str:
    """The default as help shows it; empty where saying it would add nothing (a switch,
    an empty list, None)."""
    if kind is bool or default is None or default in ((), frozenset(), ""):
        return ""
    if isinstance(default, tuple | frozenset):
        return " ".join(map(str, default))
    return f"{default:g}" if isinstance(default, float) else str(default)
