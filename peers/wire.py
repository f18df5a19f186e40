"""Typed wire messages: frozen dataclasses decoded once, at the edge, and validated there.

A message class is a frozen dataclass whose fields use wire-safe types: ``int``,
``float``, ``str``, ``bytes``, ``bool``, ``numpy.ndarray``, ``list[T]``, ``dict[K, V]``,
``T | None``, ``typing.Any``, bare ``list``/``dict`` (contents unchecked), and other
message classes. On the wire it is a
msgpack array of its field values in declaration order (compact, and a field added at
the end with a default stays readable by older peers). :func:`from_wire` raises
:class:`WireError`, naming the field, for anything that does not fit.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import numpy as np

from peers.errors import RemoteProtocolError

T = TypeVar("T")
#: Longest list or dict a decoded message may hold; the frame bound limits bytes, this
#: limits the number of Python objects a peer can make us build per field.
MAX_WIRE_ITEMS = 1 << 20


class WireError(RemoteProtocolError):
    """A message from the remote does not match its declared type."""


@cache
def _hints(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, hints[f.name], required))
    return tuple(out)


def is_message_class(cls: object) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


def to_wire(value: object) -> object:
    """Turn a message (recursively) into msgpack-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [to_wire(getattr(value, name)) for name, _, _ in _hints(type(value))]
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(cls: type[T], raw: object) -> T:
    """Decode ``raw`` into ``cls``; raises :class:`WireError`."""
    return typing.cast(T, _convert(cls, raw, cls.__name__))


def _convert(tp: Any, raw: object, where: str) -> object:
    if tp is Any:
        return raw
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if raw is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, raw, where)
            except WireError as e:
                errors.append(str(e))
        raise WireError("; ".join(errors) or f"{where}: unexpected None")
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(raw, list):
            raise WireError(f"{where}: expected a list, got {type(raw).__name__}")
        if len(raw) > MAX_WIRE_ITEMS:
            raise WireError(f"{where}: more than {MAX_WIRE_ITEMS} items")
        return [_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(raw)]
    if origin is dict:
        key_tp, value_tp = get_args(tp)
        if not isinstance(raw, dict):
            raise WireError(f"{where}: expected a map, got {type(raw).__name__}")
        if len(raw) > MAX_WIRE_ITEMS:
            raise WireError(f"{where}: more than {MAX_WIRE_ITEMS} items")
        return {
            _convert(key_tp, k, f"{where} key"): _convert(value_tp, v, f"{where}[{k!r}]")
            for k, v in raw.items()
        }
    if is_message_class(tp):
        return _convert_message(tp, raw, where)
    if tp is float:
        if isinstance(raw, float) or (isinstance(raw, int) and not isinstance(raw, bool)):
            return float(raw)
        raise WireError(f"{where}: expected a number, got {type(raw).__name__}")
    if tp is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise WireError(f"{where}: expected an integer, got {type(raw).__name__}")
    if tp in (str, bytes, bool, np.ndarray, list, dict):  # bare list/dict: contents unchecked
        if isinstance(raw, tp):
            return raw
        raise WireError(f"{where}: expected {tp.__name__}, got {type(raw).__name__}")
    if isinstance(tp, type) and hasattr(tp, "__module__") and tp.__module__ == "torch":
        if isinstance(raw, tp):
            return raw
        raise WireError(f"{where}: expected a tensor, got {type(raw).__name__}")
    raise TypeError(f"{where}: type {tp!r} cannot be used in a wire message")


def _convert_message(cls: type, raw: object, where: str) -> object:
    if not isinstance(raw, list):
        raise WireError(f"{where}: expected an array of fields, got {type(raw).__name__}")
    fields = _hints(cls)
    if len(raw) > len(fields) + 64:
        raise WireError(f"{where}: {len(raw)} fields is far more than {len(fields)}")
    kwargs = {}
    for i, (name, tp, required) in enumerate(fields):
        if i < len(raw):
            kwargs[name] = _convert(tp, raw[i], f"{where}.{name}")
        elif required:
            raise WireError(f"{where}: field {name} is missing")
    # Extra trailing fields come from a newer peer: ignored, as protobuf would.
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise WireError(f"{where}: {e}") from e
