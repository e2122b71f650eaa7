"""A small PromQL parser for the tests: enough of the grammar to reject a malformed expression and
to name every metric an expression selects (Grafana's ``$variables`` allowed where values go).

It knows selectors with label matchers, ranges and subqueries, ``offset``, numbers, strings,
parentheses, unary signs, binary operators with ``bool``, ``on``/``ignoring`` and
``group_left``/``group_right``, aggregations with ``by``/``without`` before or after their
arguments, and calls of PromQL's functions. Anything else raises :class:`PromQLError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "limitk", "limit_ratio",
}  # fmt: skip
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_sum", "holt_winters", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear",
    "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sqrt", "time", "timestamp", "vector", "year",
    "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time",
    "stddev_over_time", "stdvar_over_time", "last_over_time", "present_over_time",
}  # fmt: skip
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless", "atan2"}
MATCH_OPS = {"=", "!=", "=~", "!~"}
TOKEN = re.compile(
    r"""\s*(?:
        (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      | (?P<duration>(?:\d+(?:ms|[smhdwy]))+|\$\{?\w+\}?)
      | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+|0x[0-9a-fA-F]+|Inf|NaN)
      | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=(){}\[\],:])
    )""",
    re.VERBOSE,
)


class PromQLError(ValueError):
    pass


@dataclass
class _Token:
    kind: str
    text: str


def tokenize(expr: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(expr):
        if expr[pos:].strip() == "":
            break
        match = TOKEN.match(expr, pos)
        if match is None or match.end() == pos:
            raise PromQLError(f"cannot read {expr[pos : pos + 20]!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append(_Token(kind, match.group(kind)))
        pos = match.end()
    return tokens


class _Parser:
    def __init__(self, expr: str) -> None:
        self.tokens = tokenize(expr)
        self.pos = 0
        self.metrics: set[str] = set()

    def peek(self, offset: int = 0) -> _Token | None:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else None

    def take(self, text: str | None = None, kind: str | None = None) -> _Token:
        token = self.peek()
        if token is None or (text is not None and token.text != text) or (kind is not None and token.kind != kind):
            raise PromQLError(f"expected {text or kind}, found {token.text if token else 'the end'}")
        self.pos += 1
        return token

    def at(self, *texts: str) -> bool:
        token = self.peek()
        return token is not None and token.text in texts

    def parse(self) -> set[str]:
        self.expr()
        if self.peek() is not None:
            raise PromQLError(f"unexpected {self.peek().text!r}")  # type: ignore[union-attr]
        return self.metrics

    def expr(self) -> None:
        self.unary()
        while self.peek() is not None and self.peek().text in BINARY:  # type: ignore[union-attr]
            self.pos += 1
            if self.at("bool"):
                self.pos += 1
            if self.at("on", "ignoring"):
                self.pos += 1
                self.labels()
            if self.at("group_left", "group_right"):
                self.pos += 1
                if self.at("("):
                    self.labels()
            self.unary()

    def unary(self) -> None:
        if self.at("-", "+"):
            self.pos += 1
        self.postfix()

    def postfix(self) -> None:
        self.primary()
        if self.at("["):
            self.pos += 1
            self.take(kind="duration")
            if self.at(":"):
                self.pos += 1
                if not self.at("]"):
                    self.take(kind="duration")
            self.take("]")
        if self.at("offset"):
            self.pos += 1
            if self.at("-"):
                self.pos += 1
            self.take(kind="duration")

    def primary(self) -> None:
        token = self.peek()
        if token is None:
            raise PromQLError("unexpected end")
        if token.kind in ("number", "string"):
            self.pos += 1
        elif token.text == "(":
            self.pos += 1
            self.expr()
            self.take(")")
        elif token.text == "{":
            self.matchers()
        elif token.kind == "name" and token.text in AGGREGATIONS:
            self.pos += 1
            if self.at("by", "without"):
                self.pos += 1
                self.labels()
            self.arguments()
            if self.at("by", "without"):
                self.pos += 1
                self.labels()
        elif token.kind == "name" and self.peek(1) is not None and self.peek(1).text == "(":  # type: ignore[union-attr]
            if token.text not in FUNCTIONS:
                raise PromQLError(f"unknown function {token.text}")
            self.pos += 1
            self.arguments()
        elif token.kind == "name":
            self.pos += 1
            self.metrics.add(token.text)
            if self.at("{"):
                self.matchers()
        else:
            raise PromQLError(f"unexpected {token.text!r}")

    def arguments(self) -> None:
        self.take("(")
        if not self.at(")"):
            self.expr()
            while self.at(","):
                self.pos += 1
                self.expr()
        self.take(")")

    def labels(self) -> None:
        self.take("(")
        while not self.at(")"):
            self.take(kind="name")
            if not self.at(")"):
                self.take(",")
        self.take(")")

    def matchers(self) -> None:
        self.take("{")
        while not self.at("}"):
            name = self.take(kind="name")
            op = self.take()
            if op.text not in MATCH_OPS:
                raise PromQLError(f"bad matcher operator {op.text!r} after {name.text}")
            self.take(kind="string")
            if not self.at("}"):
                self.take(",")
        self.take("}")


def metric_names(expr: str) -> set[str]:
    """The metrics ``expr`` selects; :class:`PromQLError` if it is not PromQL."""
    return _Parser(expr).parse()
