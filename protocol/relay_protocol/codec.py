"""A small codec between frozen dataclasses and JSON values.

The field annotations are the schema. It understands ``str``, ``int`` (never a
bool), ``float`` (an int is accepted), ``bool``, ``None``, unions such as
``str | list[str] | None``, ``list[X]``, ``dict[str, X]``, ``dict[str, Any]``
(free JSON) and nested dataclasses. Every string, integer and free JSON value
is checked against its field's :class:`~relay_protocol.limits.Rule`, in both
directions, so a message that encodes also decodes.

Decoding ignores keys it does not know (a newer peer may send more); a field
without a default must be present; a field with one may be left out.

Each dataclass is worked out once, when first met, into the list of its
fields, each with a converter made from its annotation and rule: a function
that checks one value and returns it decoded (or encoded). A listing of a
hundred workflows is a few thousand values, and reading their annotations
again for each one cost more than checking them. Values that need neither a
check nor a change (free text, null, booleans: most of a reply) are handed
over without a call; the path of a value that fails is put together only
then (see :class:`~relay_protocol.checks.Invalid`); instances are built as
:mod:`relay_protocol.construct` says.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from relay_protocol.checks import Invalid, check_free_json, describe, finite, json_kind, text_check
from relay_protocol.construct import Construction, construction
from relay_protocol.errors import ProtocolError
from relay_protocol.limits import NAME, Rule, field_rule, wire_name

__all__ = ["FieldSpec", "check_string", "decode", "encode", "field_specs", "json_kind"]

T = TypeVar("T")

#: Checks one value and returns it decoded or encoded, or raises Invalid.
Converter = Callable[[Any], Any]

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


def _protocol_error(context: str, exc: Invalid) -> ProtocolError:
    path = exc.path
    where = f"{path}: " if path else ""
    return ProtocolError(f"{context}: {where}{exc.problem}", path=path or None)


def decode(cls: type[T], data: object, context: str) -> T:
    """An instance of dataclass ``cls`` from JSON value ``data``; ``context`` leads any error message."""
    try:
        return cast(T, _decoder(cls)(data))
    except Invalid as exc:
        raise _protocol_error(context, exc) from None


def encode(obj: object, context: str) -> dict[str, Any]:
    """The JSON object for dataclass instance ``obj``, checked as :func:`decode` would check it."""
    try:
        return _encoder(type(obj))(obj)
    except Invalid as exc:
        raise _protocol_error(context, exc) from None


def check_string(value: object, rule: Rule, context: str, path: str) -> str:
    """``value`` if it is a string that ``rule`` allows, else a ProtocolError."""
    try:
        return cast(str, _string(rule)(value))
    except Invalid as exc:
        raise _protocol_error(context, exc.at(path)) from None


# --- Dataclasses ---


class _Decoder:
    """Turns JSON objects into instances of one dataclass.

    Its fields are worked out on the first call, not when it is made, so that
    a dataclass may contain itself (its converter then finds this decoder).
    """

    def __init__(self, cls: type) -> None:
        self._cls = cls
        # (name, wire, passes unchanged, converter, required, default factory or None)
        self._fields: tuple[tuple[str, str, frozenset[type], Converter, bool, Callable[[], Any] | None], ...] = ()
        self._construction: Construction | None = None

    def _prepare(self) -> Construction:
        made = construction(self._cls)
        self._fields = tuple(
            (
                spec.name,
                spec.wire,
                _passes(spec.annotation, spec.rule),
                _converter(spec.annotation, spec.rule, True),
                spec.required,
                made.factories.get(spec.name),
            )
            for spec in field_specs(self._cls)
        )
        self._construction = made
        return made

    def __call__(self, data: Any) -> Any:
        build, start, _ = self._construction or self._prepare()
        if type(data) is not dict and not isinstance(data, Mapping):
            raise Invalid(f"expected object, got {json_kind(data)}")
        values = start.copy()  # fields in order, defaults in place: only those found are set below
        left_out: list[tuple[str, Callable[[], Any]]] = []
        for name, wire, passes, convert, required, factory in self._fields:
            if wire in data:
                value = data[wire]
                if type(value) not in passes:
                    try:
                        value = convert(value)
                    except Invalid as exc:
                        exc.in_field(wire)
                        raise
                values[name] = value
            elif required:
                raise Invalid("required field missing").in_field(wire)
            elif factory is not None:
                left_out.append((name, factory))
        for name, factory in left_out:  # once every field has passed, as __init__ would
            values[name] = factory()
        return build(values)


class _Encoder:
    """Turns instances of one dataclass into JSON objects (see :class:`_Decoder` on laziness)."""

    def __init__(self, cls: type) -> None:
        self._cls = cls
        self._fields: tuple[tuple[str, str, frozenset[type], Converter, bool], ...] | None = None
        # A class with SPARSE leaves out an optional field that is None or an empty list (see
        # relay_protocol.bodies) rather than sending it.
        self._sparse = bool(getattr(cls, "SPARSE", False))

    def _prepare(self) -> tuple[tuple[str, str, frozenset[type], Converter, bool], ...]:
        self._fields = tuple(
            (
                spec.name,
                spec.wire,
                _passes(spec.annotation, spec.rule),
                _converter(spec.annotation, spec.rule, False),
                self._sparse and not spec.required,
            )
            for spec in field_specs(self._cls)
        )
        return self._fields

    def __call__(self, obj: Any) -> dict[str, Any]:
        fields = self._fields
        if fields is None:
            fields = self._prepare()
        encoded: dict[str, Any] = {}
        for name, wire, passes, convert, sparse in fields:
            value = getattr(obj, name)
            if sparse and (value is None or value == []):
                continue
            if type(value) not in passes:
                try:
                    value = convert(value)
                except Invalid as exc:
                    exc.in_field(wire)
                    raise
            encoded[wire] = value
        return encoded


_DECODERS: dict[type, _Decoder] = {}
_ENCODERS: dict[type, _Encoder] = {}


def _decoder(cls: type) -> _Decoder:
    decoder = _DECODERS.get(cls)
    if decoder is None:
        decoder = _DECODERS[cls] = _Decoder(cls)
    return decoder


def _encoder(cls: type) -> _Encoder:
    encoder = _ENCODERS.get(cls)
    if encoder is None:
        encoder = _ENCODERS[cls] = _Encoder(cls)
    return encoder


# --- Annotations ---


def _converter(tp: Any, rule: Rule, decoding: bool) -> Converter:
    """The converter of annotation ``tp`` under ``rule``: to Python if ``decoding``, else to JSON.

    Made once per field, when its dataclass is first met, and not cached by
    annotation: unions compare as sets (``int | float == float | int``), yet
    the order of their members decides what a value becomes.
    """
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _union(get_args(tp), rule, decoding)
    if tp is Any:
        return _free_json(rule)
    if tp is str:
        return _string(rule)
    if tp is bool:
        return _boolean
    if tp is int:
        return _integer(rule)
    if tp is float:
        return _number
    if origin is list:
        return _list(get_args(tp)[0], rule, decoding)
    if origin is dict:
        return _dict(get_args(tp)[1], rule, decoding)
    if _is_dataclass(tp):
        return _decoder(tp) if decoding else _struct_encoder(tp)
    return _refuse(describe(tp))  # nothing matches an annotation the codec does not know


def _passes(tp: Any, rule: Rule) -> frozenset[type]:
    """The exact types whose values ``tp``'s converter returns as they are, with no check that can fail.

    Such values skip the converter call. A str or a bool goes to the first
    member of a union that takes it, which is itself or ``Any`` (free JSON, checked).
    """
    union = get_origin(tp) in (Union, types.UnionType)
    members = get_args(tp) if union else (tp,)
    passes: set[type] = {_NONE} if union and _NONE in members else set()
    for kind in (str, bool):
        taker = next((member for member in members if member is kind or member is Any), None)
        if taker is kind and (kind is bool or text_check(rule) is None):
            passes.add(kind)
    return frozenset(passes)


def _matcher(tp: Any, decoding: bool) -> Callable[[Any], bool]:
    """Whether a value has the JSON kind of union member ``tp`` (its contents are checked after)."""
    if tp is str:
        return lambda value: isinstance(value, str)
    if tp is bool:
        return lambda value: isinstance(value, bool)
    if tp is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return lambda value: isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is Any:
        return lambda value: True
    origin = get_origin(tp)
    if origin is list:
        return lambda value: isinstance(value, list)
    if origin is dict:
        return lambda value: isinstance(value, dict)
    if _is_dataclass(tp):
        return (lambda value: isinstance(value, Mapping)) if decoding else (lambda value: isinstance(value, tp))
    return lambda value: False


def _is_dataclass(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union(members: tuple[Any, ...], rule: Rule, decoding: bool) -> Converter:
    expected = " or ".join(describe(member) for member in members)
    takes_none = _NONE in members
    choices = tuple((_matcher(tp, decoding), _converter(tp, rule, decoding)) for tp in members if tp is not _NONE)

    def convert(value: Any) -> Any:
        if value is None and takes_none:
            return None
        for matches, member in choices:
            if matches(value):
                return member(value)
        raise Invalid(f"expected {expected}, got {json_kind(value)}")

    return convert


def _free_json(rule: Rule) -> Converter:
    def convert(value: Any) -> Any:
        check_free_json(value, rule)
        return value

    return convert


@functools.cache  # rules compare by value, and equal rules check alike
def _string(rule: Rule) -> Converter:
    check = text_check(rule)

    def convert(value: Any) -> Any:
        if not isinstance(value, str):
            raise Invalid(f"expected str, got {json_kind(value)}")
        if check is not None:
            check(value)
        return value

    return convert


def _boolean(value: Any) -> Any:
    if not isinstance(value, bool):
        raise Invalid(f"expected bool, got {json_kind(value)}")
    return value


def _integer(rule: Rule) -> Converter:
    low, high = rule.int_min, rule.int_max

    def convert(value: Any) -> Any:
        if not isinstance(value, int) or isinstance(value, bool):
            raise Invalid(f"expected int, got {json_kind(value)}")
        if not low <= value <= high:
            raise Invalid(f"integer out of range [{low}, {high}]")
        return value

    return convert


def _number(value: Any) -> Any:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise Invalid(f"expected number, got {json_kind(value)}")
    return finite(value)


def _list(item_tp: Any, rule: Rule, decoding: bool) -> Converter:
    passes, item = _passes(item_tp, rule), _converter(item_tp, rule, decoding)

    def convert(value: Any) -> Any:
        if not isinstance(value, list):
            raise Invalid(f"expected list, got {json_kind(value)}")
        converted = []
        for i, element in enumerate(value):
            try:
                converted.append(element if type(element) in passes else item(element))
            except Invalid as exc:
                exc.at(f"[{i}]")
                raise
        return converted

    return convert


def _dict(item_tp: Any, rule: Rule, decoding: bool) -> Converter:
    if item_tp is Any:
        return _free_json_object(rule)
    check_key, passes, item = text_check(rule), _passes(item_tp, rule), _converter(item_tp, rule, decoding)

    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            raise Invalid(f"expected object, got {json_kind(value)}")
        converted: dict[str, Any] = {}
        for key, element in value.items():
            try:
                if not isinstance(key, str):
                    raise Invalid(f"expected a str key, got {json_kind(key)}")
                if check_key is not None:
                    check_key(key)
                converted[key] = element if type(element) in passes else item(element)
            except Invalid as exc:
                exc.at(f"[{str(key)[:40]!r}]")
                raise
        return converted

    return convert


def _free_json_object(rule: Rule) -> Converter:
    """``dict[str, Any]``: an object of free JSON, kept as it is (not copied)."""

    def convert(value: Any) -> Any:
        if not isinstance(value, dict):
            raise Invalid(f"expected object, got {json_kind(value)}")
        check_free_json(value, rule)
        return value

    return convert


def _struct_encoder(cls: type) -> Converter:
    def convert(value: Any) -> Any:
        if not isinstance(value, cls):
            raise Invalid(f"expected object, got {json_kind(value)}")
        return _encoder(type(value))(value)  # a subclass encodes its own fields, as at the top

    return convert


def _refuse(expected: str) -> Converter:
    def convert(value: Any) -> Any:
        raise Invalid(f"expected {expected}, got {json_kind(value)}")

    return convert
