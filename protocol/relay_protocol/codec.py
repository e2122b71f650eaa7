"""A small codec between frozen dataclasses and JSON values.

The field annotations are the schema. It understands ``str``, ``int`` (never a
bool), ``float`` (an int is accepted), ``bool``, ``None``, unions such as
``str | list[str] | None``, ``list[X]``, ``dict[str, X]``, ``dict[str, Any]``
(free JSON) and nested dataclasses. Every string, integer and free JSON value
is checked against its field's :class:`~relay_protocol.limits.Rule`, in both
directions, so a message that encodes also decodes.

Decoding ignores keys it does not know (a newer peer may send more); a field
without a default must be present; a field with one may be left out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from collections.abc import Mapping
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from relay_protocol.errors import ProtocolError
from relay_protocol.limits import MAX_JSON_DEPTH, NAME, Rule, field_rule, has_unstorable, wire_name

T = TypeVar("T")

_NONE = type(None)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One dataclass field as the codec sees it."""

    name: str
    wire: str
    annotation: Any
    rule: Rule
    required: bool


_SPECS: dict[type, tuple[FieldSpec, ...]] = {}


def field_specs(cls: type) -> tuple[FieldSpec, ...]:
    """The fields of dataclass ``cls``, in order, with their wire names and rules."""
    specs = _SPECS.get(cls)
    if specs is None:
        specs = _SPECS[cls] = _read_fields(cls)
    return specs


def _read_fields(cls: type) -> tuple[FieldSpec, ...]:
    hints = get_type_hints(cls)
    return tuple(
        FieldSpec(
            name=f.name,
            wire=wire_name(f.metadata, f.name),
            annotation=hints[f.name],
            rule=field_rule(f.metadata, getattr(cls, "default_rule", NAME)),
            required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )


class _Invalid(Exception):
    """A value that breaks its field; becomes a ProtocolError at the public entry points."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(problem)
        self.path = path
        self.problem = problem


def _protocol_error(context: str, exc: _Invalid) -> ProtocolError:
    where = f"{exc.path}: " if exc.path else ""
    return ProtocolError(f"{context}: {where}{exc.problem}", path=exc.path or None)


def decode(cls: type[T], data: object, context: str) -> T:
    """An instance of dataclass ``cls`` from JSON value ``data``; ``context`` leads any error message."""
    try:
        return _decode_struct(cls, data, "")
    except _Invalid as exc:
        raise _protocol_error(context, exc) from None


def encode(obj: object, context: str) -> dict[str, Any]:
    """The JSON object for dataclass instance ``obj``, checked as :func:`decode` would check it."""
    try:
        return _encode_struct(obj, "")
    except _Invalid as exc:
        raise _protocol_error(context, exc) from None


def check_string(value: object, rule: Rule, context: str, path: str) -> str:
    """``value`` if it is a string that ``rule`` allows, else a ProtocolError."""
    try:
        return _convert(value, str, rule, path, decoding=True)  # type: ignore[no-any-return]
    except _Invalid as exc:
        raise _protocol_error(context, exc) from None


def json_kind(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (str, int, float, list)):
        return type(value).__name__
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _decode_struct(cls: type[T], data: object, path: str) -> T:
    if not isinstance(data, Mapping):
        raise _Invalid(path, f"expected object, got {json_kind(data)}")
    kwargs: dict[str, Any] = {}
    for spec in field_specs(cls):
        where = _join(path, spec.wire)
        if spec.wire in data:
            kwargs[spec.name] = _convert(data[spec.wire], spec.annotation, spec.rule, where, decoding=True)
        elif spec.required:
            raise _Invalid(where, "required field missing")
    return cls(**kwargs)


def _encode_struct(obj: object, path: str) -> dict[str, Any]:
    return {
        spec.wire: _convert(getattr(obj, spec.name), spec.annotation, spec.rule, _join(path, spec.wire), decoding=False)
        for spec in field_specs(type(obj))
    }


def _convert(value: Any, tp: Any, rule: Rule, path: str, *, decoding: bool) -> Any:
    """``value`` checked against annotation ``tp``: decoded to Python, or encoded to JSON."""
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _convert_union(value, tp, rule, path, decoding)
    if tp is Any:
        _check_free_json(value, rule, path)
        return value
    if not _matches(value, tp, decoding):
        raise _Invalid(path, f"expected {_describe(tp)}, got {json_kind(value)}")
    if tp is str:
        _check_text(value, rule, path)
        return value
    if tp is bool:
        return value
    if tp is int:
        if not rule.int_min <= value <= rule.int_max:
            raise _Invalid(path, f"integer out of range [{rule.int_min}, {rule.int_max}]")
        return value
    if tp is float:
        return _finite(value, path)
    if origin is list:
        (item_tp,) = get_args(tp)
        return [_convert(item, item_tp, rule, f"{path}[{i}]", decoding=decoding) for i, item in enumerate(value)]
    if origin is dict:
        return _convert_dict(value, get_args(tp)[1], rule, path, decoding)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_struct(tp, value, path) if decoding else _encode_struct(value, path)
    raise TypeError(f"relay_protocol cannot convert {tp!r} (at {path})")  # a bug in a message definition


def _convert_union(value: Any, tp: Any, rule: Rule, path: str, decoding: bool) -> Any:
    members = get_args(tp)
    if value is None and _NONE in members:
        return None
    for member in members:
        if member is not _NONE and _matches(value, member, decoding):
            return _convert(value, member, rule, path, decoding=decoding)
    raise _Invalid(path, f"expected {_describe(tp)}, got {json_kind(value)}")


def _convert_dict(value: dict[Any, Any], item_tp: Any, rule: Rule, path: str, decoding: bool) -> dict[str, Any]:
    if item_tp is Any:
        _check_free_json(value, rule, path)
        return value
    converted: dict[str, Any] = {}
    for key, item in value.items():
        where = f"{path}[{str(key)[:40]!r}]"
        if not isinstance(key, str):
            raise _Invalid(where, f"expected a str key, got {json_kind(key)}")
        _check_text(key, rule, where)
        converted[key] = _convert(item, item_tp, rule, where, decoding=decoding)
    return converted


def _matches(value: Any, tp: Any, decoding: bool) -> bool:
    """Whether ``value`` has the JSON kind of ``tp`` (its contents are checked after)."""
    if tp is str:
        return isinstance(value, str)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is Any:
        return True
    origin = get_origin(tp)
    if origin is list:
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping) if decoding else isinstance(value, tp)
    return False


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return " or ".join(_describe(member) for member in get_args(tp))
    names = {str: "str", int: "int", float: "number", bool: "bool", _NONE: "null", Any: "any JSON"}
    if tp in names:
        return names[tp]
    if origin is list:
        return "list"
    return "object"


def _check_text(text: str, rule: Rule, path: str) -> None:
    if rule.max_len is not None and len(text) > rule.max_len:
        raise _Invalid(path, f"longer than {rule.max_len} characters ({len(text)})")
    if len(text) < rule.min_len:
        raise _Invalid(path, "must not be empty" if rule.min_len == 1 else f"shorter than {rule.min_len} characters")
    if rule.strict and has_unstorable(text):
        what = "NUL (\\x00)" if "\x00" in text else "a lone surrogate"
        raise _Invalid(path, f"contains {what}, which PostgreSQL cannot store")


def _finite(number: int | float, path: str) -> float:
    try:
        result = float(number)
    except OverflowError:
        raise _Invalid(path, "number out of range") from None
    if not math.isfinite(result):
        raise _Invalid(path, "expected a finite number")
    return result


def _check_free_json(value: Any, rule: Rule, path: str) -> None:
    """Free JSON (executor_metadata, attributes): JSON types only, storable strings, bounded depth and size."""
    stack: list[tuple[Any, tuple[str, ...], int]] = [(value, (), 0)]
    while stack:
        item, keys, depth = stack.pop()
        if isinstance(item, str):
            if rule.strict and has_unstorable(item):
                raise _Invalid(_free_path(path, keys), "contains NUL (\\x00) or a lone surrogate")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _Invalid(_free_path(path, keys), "expected a finite number")
        elif item is None or isinstance(item, int):  # bool is an int
            pass
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise _Invalid(_free_path(path, keys), f"nested deeper than {MAX_JSON_DEPTH}")
            if isinstance(item, list):
                stack.extend((child, (*keys, f"[{i}]"), depth + 1) for i, child in enumerate(item))
                continue
            for key, child in item.items():
                if not isinstance(key, str):
                    raise _Invalid(_free_path(path, keys), f"expected str keys, got {json_kind(key)}")
                if rule.strict and has_unstorable(key):
                    raise _Invalid(_free_path(path, keys), "a key contains NUL (\\x00) or a lone surrogate")
                stack.append((child, (*keys, f".{key[:40]}"), depth + 1))
        else:
            raise _Invalid(_free_path(path, keys), f"{type(item).__name__} is not a JSON value")
    try:
        size = len(json.dumps(value))
    except (ValueError, RecursionError) as exc:
        raise _Invalid(path, f"not serialisable as JSON: {exc}") from None
    if size > rule.max_json_bytes:
        raise _Invalid(path, f"{size} bytes as JSON, more than {rule.max_json_bytes}")


def _free_path(path: str, keys: tuple[str, ...]) -> str:
    return path + "".join(keys)
