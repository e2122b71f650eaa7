"""The limits every decoded frame is held to, and how a field names its own.

Relay writes identifiers and executor metadata into PostgreSQL ``text`` and
``jsonb`` columns, which can hold neither NUL nor a lone UTF-16 surrogate (it
cannot be encoded as UTF-8), so those are refused where they arrive rather
than where a statement would fail. Free text (error messages, serialized
inputs and outputs) is kept exactly as received: :func:`clean_text` makes it
storable for a caller that wants to.

A field picks its rule through dataclass field metadata::

    hostname: str | None = field(default=None, metadata=meta(rule=Rule(max_len=MAX_HOSTNAME_LEN)))
    output: str | None = field(default=None, metadata=meta("Output", rule=TEXT))

A field without metadata is a name: at most :data:`MAX_NAME_LEN` characters,
no NUL, no lone surrogate. A workflow id (:data:`WORKFLOW_ID`), a queue's or a
schedule's name (:data:`QUEUE_OR_SCHEDULE_NAME`) and the other names an app
gives (:data:`APP_DEFINED_NAME`) are bounded in UTF-8 bytes instead, as the
store that holds them is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

#: Identifiers and names Relay bounds itself: executor ids, versions, request ids.
MAX_NAME_LEN = 256
#: A workflow id, in UTF-8 bytes. DBOS sets no bound of its own: on SQLite an id may be any length,
#: and on PostgreSQL the primary key's btree takes an entry of at most 2,704 bytes, which is an id
#: of up to 2,692 bytes that do not compress (a repetitive one compresses, and can be far longer).
#: This is every id that fits PostgreSQL uncompressed, six times over, and still small enough to
#: sit in a URL path percent-encoded whole (three bytes of URL for one of id) within the
#: 64 KiB Relay takes of a request's head.
MAX_WORKFLOW_ID_BYTES = 16 * 1024
#: A queue's or a schedule's name, in UTF-8 bytes: the workflow id's bound, under a name of its own.
#: DBOS bounds neither name, and PostgreSQL's unique indexes on them bound both as they bound an id
#: (measured with DBOS 3.2: 2,600 random ASCII characters work end to end, 2,680 are refused, and
#: repetitive names compress and go far longer; SQLite takes any length). A schedule's runs have
#: ids ``sched-{name}-{time}``, which must fit the id's bound anyway, and a name sits in a URL path
#: as an id does.
MAX_QUEUE_OR_SCHEDULE_NAME_BYTES = MAX_WORKFLOW_ID_BYTES
#: The other names an app gives and DBOS stores as given, in UTF-8 bytes: a workflow's name (a custom
#: ``@DBOS.workflow(name=...)``, or a class-qualified one), a step's, an authenticated user, a queue
#: partition key. One bound for all of them, the workflow id's, as they are bounded for the same
#: reasons (measured with DBOS 3.2 on PostgreSQL): DBOS bounds none; workflow names and users are in
#: no index, and 16,000 random characters are stored and found; step names and partition keys are
#: in btree indexes, which take 2,600 random characters and refuse 2,700, as a queue's name.
MAX_APP_DEFINED_NAME_BYTES = MAX_WORKFLOW_ID_BYTES
#: A hostname (RFC 1035 allows 253 characters; this leaves room for odd resolvers).
MAX_HOSTNAME_LEN = 1024
#: Free JSON (executor_metadata, attributes) once re-serialised with ``json.dumps``.
MAX_JSON_BYTES = 64 * 1024
#: Nesting of free JSON: containers inside containers.
MAX_JSON_DEPTH = 64
#: Digits of one JSON integer, Python's own default for ``int(str)``.
MAX_INT_DIGITS = 4300
#: Integers in typed fields are PostgreSQL ``bigint``.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: What :func:`clean_text` keeps by default.
MAX_CLEAN_TEXT_LEN = 4096


@dataclass(frozen=True)
class Rule:
    """How strings and integers inside one field are checked (list items and dict keys included)."""

    max_len: int | None = MAX_NAME_LEN
    #: A bound in UTF-8 bytes, checked besides ``max_len``.
    max_bytes: int | None = None
    min_len: int = 0
    #: Refuse NUL and lone surrogates; off for free text, which is kept as received.
    strict: bool = True
    max_json_bytes: int = MAX_JSON_BYTES
    int_min: int = INT64_MIN
    int_max: int = INT64_MAX


#: The rule of a field without metadata.
NAME = Rule()
#: Free text: any length, any character.
TEXT = Rule(max_len=None, strict=False)
#: A workflow id: a name, bounded in bytes rather than characters.
WORKFLOW_ID = Rule(max_len=None, max_bytes=MAX_WORKFLOW_ID_BYTES)
#: A queue's or a schedule's name, bounded in bytes as a workflow id is.
QUEUE_OR_SCHEDULE_NAME = Rule(max_len=None, max_bytes=MAX_QUEUE_OR_SCHEDULE_NAME_BYTES)
#: A workflow's or a step's name, a user, a partition key, bounded in bytes as a workflow id is.
APP_DEFINED_NAME = Rule(max_len=None, max_bytes=MAX_APP_DEFINED_NAME_BYTES)

_META_WIRE = "relay_protocol.wire"
_META_RULE = "relay_protocol.rule"


def meta(wire: str | None = None, *, rule: Rule | None = None) -> dict[str, Any]:
    """Field metadata: the key on the wire (default: the field's name) and the checking rule
    (default: the class's ``default_rule``, else :data:`NAME`)."""
    data: dict[str, Any] = {} if rule is None else {_META_RULE: rule}
    if wire is not None:
        data[_META_WIRE] = wire
    return data


def wire_name(metadata: Any, default: str) -> str:
    name = metadata.get(_META_WIRE, default)
    assert isinstance(name, str)
    return name


def field_rule(metadata: Any, default: Rule = NAME) -> Rule:
    rule = metadata.get(_META_RULE, default)
    assert isinstance(rule, Rule)
    return rule


_SURROGATE = re.compile("[\ud800-\udfff]")
# C0 controls but tab and newline, and lone surrogates.
_UNSTORABLE = re.compile("[\x00-\x08\x0b-\x1f\ud800-\udfff]")


def utf8_length(text: str) -> int:
    """How many bytes ``text`` takes in UTF-8 (a lone surrogate, which is refused anyway, counts 3)."""
    return len(text.encode("utf-8", "surrogatepass"))


def has_unstorable(text: str) -> bool:
    """Whether ``text`` holds NUL or a lone surrogate, which PostgreSQL text cannot store."""
    return "\x00" in text or _SURROGATE.search(text) is not None


def clean_text(text: str, max_len: int = MAX_CLEAN_TEXT_LEN) -> str:
    """``text`` fit to store: control characters other than newline and tab, and lone
    surrogates, become U+FFFD, and it is cut to ``max_len`` characters."""
    if max_len < 0:
        raise ValueError("max_len must not be negative")
    return _UNSTORABLE.sub("\ufffd", text[:max_len])
