"""Names of things: an executor's key, and the ids of Relay's workflows for it.

The workflow ids are durable: DBOS finds a workflow by its id, so starting one
twice (a retry, the repair sweep) finds the first one. Changing a format
strands the workflows already running under the old one.

A death may need more than one run of its recovery workflow: a run that ended
without finishing (in ERROR, cancelled, dead-lettered by DBOS) is followed by
a new one. The first run keeps the id Relay 0.2.0 gave it,
``recovery:{org}:{app}:{executor}:{epoch}``, so that grace periods started by
that release start the same workflow and its rows stay readable; run ``n``
(2, 3, ...) is ``recovery:{org}:{app}:{executor}:{epoch}:{n}``.

An org or app name may contain ``:`` (relay.yaml and the API take it: see
:data:`APP_NAME_RULE`), so each goes into an id through :func:`id_part`, which
escapes ``%`` and ``:``: org ``a:b`` with app ``c`` and org ``a`` with app ``b:c``
would otherwise share their ids, and DBOS would run one app's workflow and skip the other's.
A name with neither character is left as it is, so the ids of such names are
those earlier releases gave.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ExecutorKey:
    """Ordered by org, app, executor id, code point by code point (as ``COLLATE "C"``): the order
    in which a transaction that writes several executors' rows locks them (relay.store.executors)."""

    org: str
    app: str
    executor_id: str

    def __str__(self) -> str:
        return printable(f"{self.org}/{self.app}/{self.executor_id}")


def printable(text: str, limit: int = 300) -> str:
    """``text`` safe for a log line: control characters escaped (no forged lines), length bounded."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


MAX_APP_NAME = 256
# The one rule for a new app's name (the API, relay.yaml, an executor's connection). The console, the
# CLI and dbos-mcp put the name in URL paths: "/" would split it, and "." or ".." is a dot segment
# that browsers and URL libraries resolve away even when it is percent-encoded. A space at either end
# or a control character cannot be told apart on a screen. The DBOS SDKs put the name in their
# WebSocket URL as it is (the TypeScript SDK takes any name, the Python SDK only a-z0-9-_): "?" would
# start the URL's query and "#" its fragment, so such an executor could never connect, and "%" would
# start an escape, which the server decodes: an executor of "100%41" would join the app "100A" (the
# hub also refuses a new app's name sent that way: relay.net.hub.named_as_sent). The TypeScript SDK's
# URL parser (Node's, WHATWG's) reads "\" in a ws: URL as "/", so an executor of "a\b" asks for
# /websocket/a/b/KEY and finds no endpoint. Every other printable character reaches Relay as the
# executor gave it (tests/test_path_names.py starts executors of them): the parser escapes a space,
# '"', "<", ">", "`", "{", "}" and non-ASCII characters, which the server decodes back, and sends
# "|", "[", "]" and the rest as they are ("^" too, in Node 20; newer parsers escape it). Dots,
# dashes, underscores, digits, other punctuation and any case are allowed: DBOS apps use them, and
# Conductor publishes no stricter rule.
APP_NAME_RULE = (
    f"an app name is 1 to {MAX_APP_NAME} printable characters, without '/', '\\', '%', '?' or '#', "
    "not '.' or '..', and with no space at either end"
)
# The same rule for the OpenAPI document (so that a fuzzer makes valid names). JSON Schema's regular
# expressions have no Unicode categories: the pattern refuses the control characters (C0, DEL, C1),
# and valid_app_name also refuses the other characters str.isprintable() does (separators other
# than the space, format characters), which no pattern can list.
APP_NAME_PATTERN = r"^(?!\.\.?$)(?! )(?!.* $)[^/\\%?#\x00-\x1f\x7f-\x9f]{1,256}$"
# The characters of URLs that APP_NAME_RULE keeps out of a new app's name ("\" is "/" to WHATWG's).
_URL_DELIMITERS = frozenset("/\\%?#")


def valid_app_name(name: str) -> bool:
    """Whether a new app may have ``name`` (:data:`APP_NAME_RULE`). An app an older Relay made under
    another name stays readable and deletable: the rule applies where an app is created."""
    return (
        0 < len(name) <= MAX_APP_NAME
        and name.isprintable()
        and _URL_DELIMITERS.isdisjoint(name)
        and name not in (".", "..")
        and name == name.strip(" ")
    )


def id_part(name: str) -> str:
    """``name`` as one ``:``-separated part of a workflow id: ``%`` and ``:`` escaped (as in a URL),
    so that no two names give the same part and the part has no ``:``; any other name unchanged."""
    return name.replace("%", "%25").replace(":", "%3A")


def app_part(org: str, app: str) -> str:
    """``{org}:{app}`` in a workflow id, each escaped by :func:`id_part`: one app, one text."""
    return f"{id_part(org)}:{id_part(app)}"


def grace_id(key: ExecutorKey, epoch: int) -> str:
    """The grace-period workflow's id: one per disconnection."""
    return f"grace:{app_part(key.org, key.app)}:{key.executor_id}:{epoch}"


def recovery_id(key: ExecutorKey, epoch: int, run: int = 1) -> str:
    """The id of run ``run`` of a death's recovery workflow, also the API's ``recoveryId``."""
    if run < 1:
        raise ValueError(f"recovery runs count from 1, not {run}")
    first = f"recovery:{app_part(key.org, key.app)}:{key.executor_id}:{epoch}"
    return first if run == 1 else f"{first}:{run}"


_RUN_SUFFIX = re.compile(r":([1-9][0-9]*)")


def recovery_run(key: ExecutorKey, epoch: int, rid: str) -> int | None:
    """The run of this death's recovery that ``rid`` names; None if it names none of them.

    Read against the known executor and epoch, never by splitting the id: an
    executor id may itself contain colons and digits. Even so the id alone
    cannot tell run ``n`` of executor ``x`` dead at epoch ``E`` from run 1 of
    executor ``x:E`` dead at epoch ``n``: both are ``...:x:E:n``. Where a
    workflow found by its id could be either, its inputs decide
    (:meth:`workflows.engine.Engine._latest_runs`).
    """
    first = recovery_id(key, epoch)
    if rid == first:
        return 1
    if not rid.startswith(first):
        return None
    match = _RUN_SUFFIX.fullmatch(rid, len(first))
    if match is None or int(match.group(1)) < 2:
        return None
    return int(match.group(1))


@dataclass(frozen=True)
class RecoveryRef:
    """One recovery: whose, for which connection's death, under which id."""

    key: ExecutorKey
    epoch: int
    rid: str

    @property
    def run(self) -> int:
        """Which run of this death's recovery it is (1 for an id of another form)."""
        return recovery_run(self.key, self.epoch, self.rid) or 1

    @classmethod
    def of(cls, key: ExecutorKey, epoch: int, rid: str | None = None) -> RecoveryRef:
        return cls(key, epoch, rid if rid is not None else recovery_id(key, epoch))


def owned_by(app: str) -> list[str]:
    """The SDK's ``application_name`` filter for the workflows, queues and schedules of ``app``: apps
    may share a system database, which their executors read whole (DBOS's rows of no app, from before
    it named owners, are every app's). Every listing, count and lookup of an app's carries it, the
    API's and Relay's own (alert rules' conditions, app figures), so that a key limited to one app
    reaches no other app's through it and no count depends on which executor answers."""
    return [app]
