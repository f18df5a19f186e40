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
import operator
import types
import typing
from collections.abc import Callable
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


Encoder = Callable[[Any], Any]
Decoder = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def to_wire(value: object) -> object:
    """Turn a message (recursively) into msgpack-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encoder(type(value))(value)
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


@cache
def _encoder(tp: Any) -> Encoder:
    """An encoder for values of declared type ``tp``, built once per type."""
    origin = get_origin(tp)
    if is_message_class(tp):
        fields = [(name, _encoder(field_tp)) for name, field_tp, _ in _hints(tp)]
        if not fields:
            return lambda v: []
        if all(enc is _identity for _, enc in fields):
            getter = operator.attrgetter(*(name for name, _ in fields))
            if len(fields) == 1:
                return lambda v: [getter(v)]
            return lambda v: list(getter(v))
        return lambda v: [enc(getattr(v, name)) for name, enc in fields]
    if origin is list:
        (item_tp,) = get_args(tp)
        item = _encoder(item_tp)
        return _identity if item is _identity else (lambda v: [item(x) for x in v])
    if origin is dict:
        _, value_tp = get_args(tp)
        value_enc = _encoder(value_tp)
        if value_enc is _identity:
            return _identity
        return lambda v: {k: value_enc(x) for k, x in v.items()}
    if origin in (typing.Union, types.UnionType) or tp is Any:
        return to_wire
    return _identity


def from_wire(cls: type[T], raw: object) -> T:
    """Decode ``raw`` into ``cls``; raises :class:`WireError` naming the field."""
    try:
        decode: Decoder = _decoder(typing.cast(Any, cls))
        return typing.cast(T, decode(raw))
    except WireError as e:
        raise WireError(f"{cls.__name__}{e}") from None


def _fail(expected: str, raw: object) -> WireError:
    return WireError(f": expected {expected}, got {type(raw).__name__}")


def _check_count(raw: list[Any] | dict[Any, Any]) -> None:
    if len(raw) > MAX_WIRE_ITEMS:
        raise WireError(f": more than {MAX_WIRE_ITEMS} items")


@cache
def _decoder(tp: Any) -> Decoder:
    """A validating decoder for declared type ``tp``, built once per type. Errors are
    raised as WireError(": ...") and each enclosing level prefixes its field name."""
    if tp is Any:
        return _identity
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(get_args(tp))
    if origin is list:
        (item_tp,) = get_args(tp)
        return _list_decoder(_decoder(item_tp))
    if origin is dict:
        key_tp, value_tp = get_args(tp)
        return _dict_decoder(_decoder(key_tp), _decoder(value_tp))
    if is_message_class(tp):
        return _message_decoder(tp)
    if tp is float:

        def decode_float(raw: Any) -> float:
            if type(raw) is float or (isinstance(raw, int) and not isinstance(raw, bool)):
                return float(raw)
            raise _fail("a number", raw)

        return decode_float
    if tp is int:

        def decode_int(raw: Any) -> int:
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            raise _fail("an integer", raw)

        return decode_int
    if tp in (str, bytes, bool, np.ndarray, list, dict) or (
        isinstance(tp, type) and tp.__module__ == "torch"
    ):  # bare list/dict: contents unchecked

        def decode_instance(raw: Any) -> Any:
            if isinstance(raw, tp):
                return raw
            raise _fail(tp.__name__, raw)

        return decode_instance
    raise TypeError(f"type {tp!r} cannot be used in a wire message")


def _union_decoder(args: tuple[Any, ...]) -> Decoder:
    optional = type(None) in args
    options = [_decoder(a) for a in args if a is not type(None)]

    def decode_union(raw: Any) -> Any:
        if raw is None and optional:
            return None
        errors = []
        for option in options:
            try:
                return option(raw)
            except WireError as e:
                errors.append(str(e))
        raise WireError("; ".join(errors) or ": unexpected None")

    return decode_union


def _list_decoder(item: Decoder) -> Decoder:
    def decode_list(raw: Any) -> list[Any]:
        if not isinstance(raw, list):
            raise _fail("a list", raw)
        _check_count(raw)
        if item is _identity:
            return raw
        out = []
        for i, value in enumerate(raw):
            try:
                out.append(item(value))
            except WireError as e:
                raise WireError(f"[{i}]{e}") from None
        return out

    return decode_list


def _dict_decoder(key: Decoder, value: Decoder) -> Decoder:
    def decode_dict(raw: Any) -> dict[Any, Any]:
        if not isinstance(raw, dict):
            raise _fail("a map", raw)
        _check_count(raw)
        out = {}
        for k, v in raw.items():
            try:
                out[key(k)] = value(v)
            except WireError as e:
                raise WireError(f"[{k!r}]{e}") from None
        return out

    return decode_dict


def _message_decoder(cls: type) -> Decoder:
    fields = [(name, _decoder(tp), required) for name, tp, required in _hints(cls)]
    num_fields = len(fields)

    def decode_message(raw: Any) -> Any:
        if not isinstance(raw, list):
            raise _fail(f"an array of {cls.__name__} fields", raw)
        if len(raw) > num_fields + 64:
            raise WireError(f": {len(raw)} fields is far more than {num_fields}")
        kwargs = {}
        for i, (name, decode, required) in enumerate(fields):
            if i < len(raw):
                try:
                    kwargs[name] = decode(raw[i])
                except WireError as e:
                    raise WireError(f".{name}{e}") from None
            elif required:
                raise WireError(f": field {name} is missing")
        # Extra trailing fields come from a newer peer: ignored, as protobuf would.
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise WireError(f": {e}") from e

    return decode_message
