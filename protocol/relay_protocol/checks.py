"""The checks under the codec: one value against its field's rule, and where it failed.

:mod:`relay_protocol.codec` puts these together, once per annotation; here
are the pieces that look at a single string, number or free JSON value, and
:class:`Invalid`, which says what is wrong and, once it has left every
enclosing value, where.
"""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, Union, get_args, get_origin

from relay_protocol.limits import MAX_JSON_DEPTH, Rule, has_unstorable, utf8_length

_NONE = type(None)


class Invalid(Exception):
    """A value that breaks its field; becomes a ProtocolError at the codec's public entry points.

    Its path is put together on the way out: each field, list and dict the
    exception leaves adds its own segment. Values are checked far more often
    than they fail, so no path string is built until one is needed.
    """

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        # Innermost first: (True, wire name) for a dataclass field, (False, text) for text
        # appended as is (a list index "[3]", a dict key "['k']", a free JSON suffix ".a[0]").
        self._outward: list[tuple[bool, str]] = []

    def in_field(self, wire: str) -> Invalid:
        """The failing value is (inside) field ``wire`` of a dataclass."""
        self._outward.append((True, wire))
        return self

    def at(self, suffix: str) -> Invalid:
        """The failing value is (inside) the item at ``suffix`` of a list, dict or free JSON value."""
        self._outward.append((False, suffix))
        return self

    @property
    def path(self) -> str:
        """``output[3].Status``: a field joins with a dot unless it comes first; a suffix is appended."""
        path = ""
        for is_field, text in reversed(self._outward):
            if is_field:
                path = f"{path}.{text}" if path else text
            else:
                path += text
        return path


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


def describe(tp: Any) -> str:
    """What an annotation expects, as error messages say it: ``str or null``."""
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return " or ".join(describe(member) for member in get_args(tp))
    names = {str: "str", int: "int", float: "number", bool: "bool", _NONE: "null", Any: "any JSON"}
    if tp in names:
        return names[tp]
    if origin is list:
        return "list"
    return "object"


def text_check(rule: Rule) -> Callable[[str], None] | None:
    """What ``rule`` asks of a string, as a function; None when it takes every string (free text)."""
    max_len, max_bytes, min_len, strict = rule.max_len, rule.max_bytes, rule.min_len, rule.strict
    if max_len is None and max_bytes is None and min_len <= 0 and not strict:
        return None

    def check(text: str) -> None:
        if max_len is not None and len(text) > max_len:
            raise Invalid(f"longer than {max_len} characters ({len(text)})")
        # A character is at most 4 bytes: a short text is not encoded to be measured.
        if max_bytes is not None and len(text) * 4 > max_bytes and (size := utf8_length(text)) > max_bytes:
            raise Invalid(f"longer than {max_bytes} bytes in UTF-8 ({size})")
        if len(text) < min_len:
            raise Invalid("must not be empty" if min_len == 1 else f"shorter than {min_len} characters")
        if strict and has_unstorable(text):
            what = "NUL (\\x00)" if "\x00" in text else "a lone surrogate"
            raise Invalid(f"contains {what}, which PostgreSQL cannot store")

    return check


def finite(number: int | float) -> float:
    """``number`` as a float, which must be finite."""
    try:
        result = float(number)
    except OverflowError:
        raise Invalid("number out of range") from None
    if not math.isfinite(result):
        raise Invalid("expected a finite number")
    return result


def check_free_json(value: Any, rule: Rule) -> None:
    """Free JSON (executor_metadata, attributes): JSON types only, storable strings, bounded depth and size."""
    stack: list[tuple[Any, tuple[str, ...], int]] = [(value, (), 0)]
    while stack:
        item, keys, depth = stack.pop()
        if isinstance(item, str):
            if rule.strict and has_unstorable(item):
                raise Invalid("contains NUL (\\x00) or a lone surrogate").at("".join(keys))
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise Invalid("expected a finite number").at("".join(keys))
        elif item is None or isinstance(item, int):  # bool is an int
            pass
        elif isinstance(item, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise Invalid(f"nested deeper than {MAX_JSON_DEPTH}").at("".join(keys))
            if isinstance(item, list):
                stack.extend((child, (*keys, f"[{i}]"), depth + 1) for i, child in enumerate(item))
                continue
            for key, child in item.items():
                if not isinstance(key, str):
                    raise Invalid(f"expected str keys, got {json_kind(key)}").at("".join(keys))
                if rule.strict and has_unstorable(key):
                    raise Invalid("a key contains NUL (\\x00) or a lone surrogate").at("".join(keys))
                stack.append((child, (*keys, f".{key[:40]}"), depth + 1))
        else:
            raise Invalid(f"{type(item).__name__} is not a JSON value").at("".join(keys))
    try:
        size = len(json.dumps(value))
    except (ValueError, RecursionError) as exc:
        raise Invalid(f"not serialisable as JSON: {exc}") from None
    if size > rule.max_json_bytes:
        raise Invalid(f"{size} bytes as JSON, more than {rule.max_json_bytes}")
