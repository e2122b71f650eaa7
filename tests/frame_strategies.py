"""Hypothesis strategies for the frames an executor can send, as drafts for :func:`harness.fuzzing.render`.

Replies are generated from the message classes themselves (:func:`relay_protocol.codec.field_specs`
gives each field's wire name, annotation and whether it is required), so a message type added to
relay_protocol is fuzzed without a change here. ``wild`` drafts may give any field a value of the
wrong JSON type, leave out required fields and add unknown ones; the others are well typed but
draw their values from everything a JSON string or number can hold: NUL, lone surrogates,
strings just under and over the protocol's limits, integers past ``bigint``, NaN and Infinity.

Long strings are :class:`~harness.fuzzing.Repeat` values, which print short. Only
:func:`inflated`, :func:`sized`, :func:`oversized` and ``huge_objects`` make a frame larger than
some tens of KiB (up to a few MiB), each with one such value, so an example's size stays bounded.
"""

from __future__ import annotations

import dataclasses
import types
from functools import cache
from typing import Any, Union, get_args, get_origin

from hypothesis import strategies as st

from harness.fuzzing import ECHO, AsBinary, Binary, Cut, Raw, Repeat, Sized, Text
from relay_protocol import (
    INT64_MAX,
    INT64_MIN,
    MAX_INT_DIGITS,
    MAX_JSON_BYTES,
    REPLIES,
    UNKNOWN_TYPE_ERROR,
    MessageType,
    Reply,
)
from relay_protocol.codec import field_specs

Strategy = st.SearchStrategy

# Characters a JSON string can hold that are worth a special try.
SPECIAL_CHARS = ["\x00", "\x1b", "\x7f", "\n", "\r", "\t", '"', "\\", "/", "%", "\u2028", "\ufeff", "\uffff",
                 "é", "\u0301", "\U0001f600", "\U0010ffff"]  # fmt: skip
LONE_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
# Lengths around the protocol's limits: a name (256), a hostname (1024), clean_text (4096).
NEAR_LIMITS = [0, 1, 255, 256, 257, 1023, 1024, 1025, 4096, 4097]
# Lengths of an inflated string: the 64 KiB of free JSON, up to past the fuzz config's 1 MiB frame limit.
BIG_LENGTHS = [MAX_JSON_BYTES + 1, 300_000, 1_040_000, 1_100_000, 3 * 2**20]

sendable_chars = st.one_of(st.characters(exclude_categories=["Cs"]), st.sampled_from(SPECIAL_CHARS))
json_chars = st.one_of(sendable_chars, LONE_SURROGATES)


def strings(chars: Strategy[str], min_size: int = 0, max_size: int = 24) -> Strategy[str]:
    # st.text leaves surrogates out whatever its alphabet: join characters instead.
    return st.lists(chars, min_size=min_size, max_size=max_size).map("".join)


# The SDK sends times, timeouts and priorities as decimal strings; int() takes more than digits.
decimal_text = st.one_of(
    st.integers(-(10**22), 10**22).map(str),
    st.sampled_from(
        ["1767225600000", "0", "-1", "+5", " 12 ", "1_000", "\u0663\u0663", "1e3", "0x10", "9" * 20, "9" * 400]
    ),
)
short_text = strings(json_chars)
text = st.one_of(
    short_text,
    decimal_text,
    st.builds(Repeat, strings(json_chars, 1, 3), st.sampled_from(NEAR_LIMITS)),
)
big_text = st.builds(Repeat, strings(sendable_chars, 1, 3), st.sampled_from(BIG_LENGTHS))

# Integers Python's json would refuse to read (past MAX_INT_DIGITS) or write (str() refuses them).
huge_integers = st.builds(
    lambda sign, digit, count: Raw(sign + digit * count),
    st.sampled_from(["", "-"]),
    st.sampled_from("19"),
    st.sampled_from([MAX_INT_DIGITS, MAX_INT_DIGITS + 1, 20_000]),
)
integers = st.one_of(
    st.integers(INT64_MIN, INT64_MAX),
    st.sampled_from([INT64_MIN - 1, INT64_MAX + 1, 2**64, -(2**200)]),
    huge_integers,
)
numbers = st.one_of(
    st.floats(),  # NaN and +-Infinity included: json.dumps writes them as the bare words
    st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("1e-400"), Raw("-0.0"), Raw("1E+2"), Raw("0.1e1")]),
)


def deep(depth: int, opener: str) -> Raw:
    """A JSON array or object nested ``depth`` deep."""
    if opener == "[":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a": ' * depth + "null" + "}" * depth)


# Around MAX_JSON_DEPTH (64) for free JSON, and far past what a recursive parser can follow.
# Nothing near Python's recursion limit (1000): whether json.loads manages that depends on the
# stack it is called from, and hypothesis raises the limit in the test process.
nested = st.builds(deep, st.sampled_from([62, 63, 64, 65, 500]), st.sampled_from("[{"))
too_deep = st.builds(deep, st.just(100_000), st.sampled_from("[{"))

json_scalars = st.one_of(st.none(), st.booleans(), integers, numbers, text)
json_values: Strategy[Any] = st.recursive(
    json_scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(short_text, children, max_size=4)),
    max_leaves=10,
)


def object_of_size(size: int, keys: int) -> dict[str, Any]:
    """A JSON object of ``keys`` keys whose ``json.dumps`` is ``size`` characters (or the least it can be)."""
    if keys == 1:
        return {"pad": "x" * max(size - len('{"pad": ""}'), 0)}
    each = max((size - 2) // keys - len('"k000000": "", '), 0)
    return {f"k{i:06}": "y" * each for i in range(keys)}


huge_objects = st.builds(
    object_of_size,
    st.sampled_from([MAX_JSON_BYTES - 1, MAX_JSON_BYTES, MAX_JSON_BYTES + 1, 500_000]),
    st.sampled_from([1, 3_000]),
)
# What a field of the wrong kind gets: small enough that a frame of many such fields stays small.
wrong_json: Strategy[Any] = st.one_of(json_values, nested)


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


@cache
def typed(tp: Any, wild: bool) -> Strategy[Any]:
    """A JSON value of annotation ``tp`` (wild: or of any other kind)."""
    origin, args = get_origin(tp), get_args(tp)
    base: Strategy[Any]
    if _is_union(tp):
        return st.one_of(*(typed(member, wild) for member in args))
    if tp is type(None):
        base = st.none()
    elif tp is str:
        base = text
    elif tp is bool:
        base = st.booleans()
    elif tp is int:
        base = integers
    elif tp is float:
        base = st.one_of(numbers, integers)
    elif tp is Any:
        base = json_values
    elif origin is list:
        base = st.lists(typed(args[0], wild), max_size=3)
    elif origin is dict:
        base = st.dictionaries(text, typed(args[1], wild), max_size=3)
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        base = struct(tp, wild)
    else:
        raise TypeError(f"no strategy for {tp!r}")
    return st.one_of(base, wrong_json) if wild else base


_STRUCTS: dict[tuple[type, bool, frozenset[str]], Strategy[dict[str, Any]]] = {}


def struct(cls: type, wild: bool, skip: frozenset[str] = frozenset()) -> Strategy[dict[str, Any]]:
    """A JSON object with the fields of dataclass ``cls`` by their wire names (those in ``skip`` left out).

    Wild: any field may be missing, and keys the class does not know are added.
    """
    key = (cls, wild, skip)
    if key not in _STRUCTS:
        _STRUCTS[key] = _struct(cls, wild, skip)
    return _STRUCTS[key]


def _struct(cls: type, wild: bool, skip: frozenset[str]) -> Strategy[dict[str, Any]]:
    specs = [spec for spec in field_specs(cls) if spec.wire not in skip]
    required = {spec.wire: typed(spec.annotation, wild) for spec in specs if spec.required and not wild}
    optional = {spec.wire: typed(spec.annotation, wild) for spec in specs if wild or not spec.required}
    fields = st.fixed_dictionaries(required, optional=optional)
    if not wild:
        return fields
    return st.builds(lambda known, unknown: {**unknown, **known}, fields, st.dictionaries(short_text, json_values))


error_messages = st.one_of(st.none(), st.just(""), st.just(UNKNOWN_TYPE_ERROR), text, wrong_json)
random_request_ids = st.one_of(st.uuids().map(lambda u: u.hex), text)
other_types = st.one_of(st.sampled_from(list(MessageType)).map(str), text)
_ENVELOPE = frozenset({"request_id", "error_message"})


def reply(cls: type[Reply], request_id: Strategy[Any], *, wild: bool) -> Strategy[dict[str, Any]]:
    """A reply of ``cls``'s type to ``request_id``: the payload, perhaps an ``error_message``.
    See :func:`mangled` for a broken ``type`` or ``request_id``."""
    return st.builds(
        lambda request, payload, error: {"type": cls.type.value, "request_id": request, **payload, **error},
        request_id,
        struct(cls, wild, _ENVELOPE),
        st.fixed_dictionaries({}, optional={"error_message": error_messages}),
    )


def mangled(drafts: Strategy[dict[str, Any]]) -> Strategy[dict[str, Any]]:
    """A draft with its ``type`` or ``request_id`` left out, or replaced by another type, another
    id or a value of another kind."""

    def mangle(draft: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
        changed = {k: v for k, v in draft.items() if k != key}
        return changed if value is _LEFT_OUT else {**changed, key: value}

    replacement = st.one_of(st.just(_LEFT_OUT), other_types, random_request_ids, wrong_json)
    return st.builds(mangle, drafts, st.sampled_from(["type", "request_id"]), replacement)


_LEFT_OUT = object()


def error_only(request_id: Strategy[Any], types_: Strategy[Any]) -> Strategy[dict[str, Any]]:
    """Nothing but an error: the SDK's answer to a type it does not know, or to a refused command."""
    return st.fixed_dictionaries(
        {"type": types_, "request_id": request_id, "error_message": st.one_of(st.just(UNKNOWN_TYPE_ERROR), text)}
    )


def inflated(drafts: Strategy[dict[str, Any]]) -> Strategy[dict[str, Any]]:
    """A draft with one value (a field other than ``type`` and ``request_id``, or an unknown key)
    replaced by a string of 64 KiB to 3 MiB."""

    def inflate(draft: dict[str, Any], where: int, blob: Repeat) -> dict[str, Any]:
        keys = [*(key for key in draft if key not in ("type", "request_id")), "blob"]
        return {**draft, keys[where % len(keys)]: blob}

    return st.builds(inflate, drafts, st.integers(0, 40), big_text)


def sized(drafts: Strategy[dict[str, Any]], limit: int) -> Strategy[Sized]:
    """A draft padded to exactly one byte under, at or over the frame size limit."""
    return st.builds(Sized, drafts, st.sampled_from([limit - 1, limit, limit + 1]))


def oversized(drafts: Strategy[dict[str, Any]], limit: int) -> Strategy[Sized]:
    """A draft padded past the frame size limit: by one byte, or to three times the limit."""
    return st.builds(Sized, drafts, st.sampled_from([limit + 1, 3 * limit]))


GARBAGE_TEXT = ["", " ", "{", "}", "[]", "null", "0", "true", '"executor_info"', "{not json", "{'type': 'x'}",
                '{"type": "executor_info", "request_id": }', "\ufeff{}", "NaN", "[1, 2,]", '{"a": 1} {"b": 2}',
                '{"type": "x", "request_id": "y"', '{"type": "x", "type": "y", "request_id": "z"}']  # fmt: skip


def garbage(answering: Strategy[dict[str, Any]]) -> Strategy[Any]:
    """Frames that are not a reply: not JSON, binary, JSON that is not an object, an object
    without ``type`` or ``request_id``, nesting deeper than any parser goes, a reply from
    ``answering`` cut short or sent as a binary frame."""
    return st.one_of(
        st.builds(Text, st.sampled_from(GARBAGE_TEXT)),
        st.builds(Text, strings(sendable_chars, max_size=40)),
        st.builds(Binary, st.binary(max_size=64)),
        st.lists(json_values, max_size=3),
        json_scalars,
        st.dictionaries(short_text, json_values, max_size=4),
        too_deep,
        st.builds(Cut, answering, st.floats(0.05, 0.95)),
        st.builds(AsBinary, answering),
    )


def echoing(cls: type[Reply]) -> Strategy[dict[str, Any]]:
    """Answers to the request of type ``cls`` in flight: well typed, wild, with a broken envelope,
    only an error, or a reply of any type echoing its id."""
    return st.one_of(
        reply(cls, st.just(ECHO), wild=False),
        reply(cls, st.just(ECHO), wild=True),
        mangled(reply(cls, st.just(ECHO), wild=False)),
        error_only(st.just(ECHO), st.one_of(st.just(cls.type.value), other_types)),
        st.sampled_from(list(MessageType)).flatmap(lambda t: reply(_reply_class(t), st.just(ECHO), wild=False)),
    )


def unsolicited(limit: int) -> Strategy[Any]:
    """Frames nobody asked for: a reply of any type to an id Relay never sent, garbage,
    or one of either at the frame size limit or far past it."""
    replies = st.sampled_from(list(MessageType)).flatmap(
        lambda t: st.one_of(
            reply(_reply_class(t), random_request_ids, wild=False),
            reply(_reply_class(t), random_request_ids, wild=True),
            mangled(reply(_reply_class(t), random_request_ids, wild=False)),
        )
    )
    return st.one_of(
        replies,
        error_only(random_request_ids, other_types),
        garbage(replies),
        sized(replies, limit),
        inflated(replies),
    )


def _reply_class(message_type: MessageType) -> type[Reply]:
    return REPLIES[message_type]


def either(first: Strategy[Any], second: Strategy[Any]) -> Strategy[Any]:
    """``first`` or ``second``, about half the time each: ``st.one_of`` drifts towards whichever
    has more structure to explore."""
    return st.booleans().flatmap(lambda pick: first if pick else second)


def now_and_then(usual: Strategy[Any], rare: Strategy[Any], one_in: int) -> Strategy[Any]:
    """``rare`` about once in ``one_in`` draws, else ``usual`` (for what costs a timeout to check)."""
    return st.sampled_from(range(one_in)).flatmap(lambda n: rare if n == one_in - 1 else usual)
