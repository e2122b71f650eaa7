"""Relay's log: one line per message, whatever text an executor or a client put into it.

Much of what Relay logs comes from outside: executor ids, versions, workflow
names, an alert handler's or a peer's error message, a key's name. Written as
it came, a line end in it forges whole log lines of the sender's choosing
(a "CRITICAL" Relay never wrote), and an escape sequence reaches the terminal
of whoever reads the log (``docker logs``, ``journalctl -f``): ESC ``]0;``
sets its title, OSC 52 writes its clipboard, ESC ``[2J`` clears it. Bidi
controls (U+202E...) make a line read otherwise than it is written.

So every handler Relay installs formats with :class:`EscapingFormatter`: the
formatted message has its control characters escaped (C0, line ends and tab
included: a message is one line; DEL, C1, the line and paragraph separators,
the bidi controls), as ``repr`` writes them (``\\x1b``, ``\\n``, ``\\u202e``).
A backslash is left as it is, so text already escaped at the call site
(:func:`relay.core.ids.printable`, which also bounds its length) is not
escaped twice. A traceback (Python's own text) keeps its lines, but the
message of each exception in it (and of its causes, its context, a group's
members, and their notes) is one line, escaped like a message: it may hold an
executor's error text or a header's value, whose line end would otherwise
forge a log line inside the traceback. The other control characters in a
traceback are escaped the same way.

A line written while an HTTP request is served ends with its id, `` [req=<id>]``
(:mod:`relay.core.requestid`), as its answer's ``X-Request-Id`` gives it.

``--log-format json`` (``RELAY_LOG_FORMAT=json``) writes each message as one JSON
object per line (:class:`JsonLineFormatter`), for the tools that ship logs and
search them by field (Loki, Elasticsearch, CloudWatch).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from relay.core.ids import ExecutorKey
from relay.core.outage import FailureRun
from relay.core.requestid import current_request_id
from relay.core.times import ms_iso
from relay.core.window import CountedWindow

# C0 (line ends and tab too), DEL, C1, the line and paragraph separators, and the bidi controls:
# ALM, LRM/RLM, LRE/RLE/PDF/LRO/RLO, LRI/RLI/FSI/PDI.
_CONTROLS = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_IN_LINE = re.compile(f"[{_CONTROLS}]")


def _escape(match: re.Match[str]) -> str:
    return repr(match.group())[1:-1]  # \n, \t, \x1b, \x9b, \u202e: as printable() writes them


def one_line(text: str) -> str:
    """``text`` with its control characters escaped: one line, nothing a terminal acts on."""
    return _IN_LINE.sub(_escape, text)


def keeping_lines(text: str) -> str:
    """``text`` with its control characters but ``\\n`` escaped: its lines kept (a traceback's)."""
    return "\n".join(one_line(line) for line in text.split("\n"))


class EscapingFormatter(logging.Formatter):
    """A formatter whose message is one line without control characters (:func:`one_line`), and
    whose traceback and stack keep their lines (:func:`keeping_lines`)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        request_id = getattr(record, REQUEST_ID, None)
        return one_line(f"{line} [req={request_id}]" if request_id else line)

    def formatException(self, ei: logging._SysExcInfoType) -> str:
        if ei[1] is None:
            return keeping_lines(super().formatException(ei))
        shown = traceback.TracebackException(ei[0] or type(ei[1]), ei[1], ei[2], compact=True)
        _one_line_messages(shown)
        return keeping_lines("".join(shown.format()).removesuffix("\n"))

    def formatStack(self, stack_info: str) -> str:
        return keeping_lines(super().formatStack(stack_info))


def _one_line_messages(shown: traceback.TracebackException) -> None:
    """Each message in ``shown``'s chain as :func:`one_line` writes it: the frames keep their lines."""
    seen: set[int] = set()
    todo = [shown]
    while todo:
        te = todo.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        # The exception's str(), as TracebackException keeps it (a private field since 3.5: no other
        # way to it); a SyntaxError shows its msg instead.
        if isinstance(getattr(te, "_str", None), str):  # a Python without it logs the message as is
            te._str = one_line(te._str)  # type: ignore[attr-defined]
        if getattr(te, "msg", None) is not None:
            te.msg = one_line(str(te.msg))
        if isinstance(te.__notes__, list):
            te.__notes__ = [one_line(str(note)) for note in te.__notes__]
        todo.extend(t for t in (te.__cause__, te.__context__, *(te.exceptions or ())) if t is not None)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")

# The record's attribute that names the request being served when it was logged (RequestIds).
REQUEST_ID = "requestId"


class RequestIds(logging.Filter):
    """Gives each record the id of the HTTP request being served when it was logged, if any: on
    the handler, so that every logger's lines have it, DBOS's and uvicorn's among them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, REQUEST_ID, None) is None:
            setattr(record, REQUEST_ID, current_request_id())
        return True


# The instance whose log this is, in every JSON line once relay serve knows it (log_instance).
_instance: str | None = None


def log_instance(instance_id: str) -> None:
    global _instance
    _instance = instance_id


class JsonLineFormatter(JsonFormatter):
    """Each message as one JSON object on one line: ``time`` (RFC 3339, UTC, milliseconds),
    ``level``, ``logger``, ``message``, ``instance`` (Relay's instance id), ``requestId`` while a
    request is served, ``traceback`` (one string) when there is one, and the fields a call passed
    with ``extra=`` (``org``, ``app``, ``executorId``, ``recoveryId``: :func:`about`).

    python-json-logger writes the object; JSON's escaping keeps it one line whatever a message
    holds, and ``ensure_ascii`` writes every character past ASCII as ``\\uXXXX``: C1 and the bidi
    controls too, so no terminal acts on them. DEL, which is ASCII and which JSON leaves as it is,
    is escaped here (as :func:`one_line` does in the text format)."""

    def __init__(self) -> None:
        super().__init__(
            ["asctime", "levelname", "name", "message"],
            rename_fields={
                "asctime": "time",
                "levelname": "level",
                "name": "logger",
                "exc_info": "traceback",
                "stack_info": "stack",
            },
            # Not fields: every record's own attributes, and uvicorn's copy of some of its messages
            # with terminal colours (passed as extra=).
            reserved_attrs=[*RESERVED_ATTRS, "color_message"],
            json_ensure_ascii=True,
        )

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return ms_iso(int(record.created * 1000)) or ""  # 2026-12-07T03:41:07.123Z

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        fields: dict[str, Any] = {}
        super().add_fields(fields, record, message_dict)
        # Who wrote it and for which request first, then what a call added (extra=), the traceback last.
        for name in ("time", "level", "logger", "message"):
            log_data[name] = fields.pop(name, None)
        if _instance is not None:
            log_data["instance"] = _instance
        if (request_id := fields.pop(REQUEST_ID, None)) is not None:
            log_data[REQUEST_ID] = request_id
        shown: dict[str, Any] = {name: fields.pop(name) for name in ("traceback", "stack") if name in fields}
        log_data.update(fields)
        log_data.update(shown)

    def serialize_log_record(self, log_data: dict[str, Any]) -> str:
        return super().serialize_log_record(log_data).replace("\x7f", "\\u007f")


def about(key: ExecutorKey, **more: Any) -> dict[str, Any]:
    """The fields of a line about an executor (``extra=``), which the JSON format writes and a log
    search filters by: ``org``, ``app``, ``executorId``, and ``more`` (``recoveryId``, say). The
    message keeps naming the executor: the text format shows no fields."""
    return {"org": key.org, "app": key.app, "executorId": key.executor_id, **more}


def log_formatter(log_format: str) -> logging.Formatter:
    """The formatter of ``--log-format``: ``text`` (:class:`EscapingFormatter`) or ``json``."""
    return JsonLineFormatter() if log_format == "json" else EscapingFormatter(LOG_FORMAT)


# The libraries whose background work warns at every turn while Relay's database is away: DBOS's
# threads (queues, schedules, timeouts, notifications: about six lines a second in all) and
# psycopg_pool at each attempt to reconnect (about two a second).
QUIETED = ("dbos", "psycopg.pool")


class QuietRepeats(logging.Filter):
    """A warning repeated is written once per ``window`` seconds: the same one again within it (the
    same logger and message, the details apart) is counted, not written, and the next one written
    says how many were held back. Errors, and lines below warnings, always pass. :data:`QUIETED`'s
    loggers have one, so an outage of minutes leaves a few lines of theirs a minute, not thousands."""

    def __init__(self, window: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self._seen: CountedWindow[tuple[str, int, str]] = CountedWindow(1, window, MAX_KINDS)
        self._lock = threading.Lock()  # DBOS's threads log too

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:  # errors always pass, and so do INFO lines (each says what it did)
            return True
        now = self.clock()
        with self._lock:
            passed = self._seen.admit((record.name, record.levelno, _kind(record)), now)
        if passed is None:
            return False
        if passed.held:
            record.msg = f"{record.getMessage()} ({passed.held} more like it in {now - passed.since:.0f} s, not logged)"
            record.args = None
        return True


MAX_KINDS = 1000  # kinds of warning remembered; beyond, the least recently seen are forgotten


def _kind(record: logging.LogRecord) -> str:
    """What makes two warnings the same: the template of a message given with arguments, else (DBOS
    formats its own) the text before its first colon, where the error's details begin."""
    if record.args:
        return str(record.msg)
    return str(record.msg).split(":", 1)[0][:200]


# How Python begins a traceback, in a message that holds one (DBOS logs ``traceback.format_exc()``
# within the text of a warning: "Exception polling schedules: Traceback (most recent call last): ...").
TRACEBACK_HEAD = "Traceback (most recent call last):\n"


def raised_of(traceback_text: str) -> str:
    """What a traceback as Python writes it says was raised: the type and message of its last
    exception (of a chain, the one raised last), without the frames. The frames' lines are indented
    by two spaces or more; what follows the last of them is the exception's line and the rest of its
    message (a psycopg error's message has more lines, indented by a tab)."""
    last = traceback_text.rsplit(TRACEBACK_HEAD, 1)[-1]
    lines = last.split("\n")
    first = next((i for i, line in enumerate(lines) if not line.startswith("  ")), len(lines))
    return "\n".join(lines[first:]).strip()


class FoldedTracebacks(logging.Filter):
    """A library's warning with a traceback (DBOS's, while Relay's database is away: the traceback
    of the failed connection in SQLAlchemy's and psycopg's frames, some 9,000 characters, in the
    message or as the record's exception) written as one line: what it says, then the type and
    message of what was raised. The frames are DBOS's and its libraries' insides, of no use to an
    operator: what failed and why is in the exception's type and message. At DEBUG (Relay's log
    level) the traceback is kept as it came, for whoever looks into the library itself. Errors keep
    theirs: DBOS logs a workflow of Relay's that failed so, and its frames are Relay's code."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or logging.getLogger().isEnabledFor(logging.DEBUG):
            return True
        if record.exc_info is not None and record.exc_info[1] is not None:
            raised = "".join(traceback.format_exception_only(record.exc_info[1])).strip()
            record.msg = f"{record.getMessage().rstrip(': ')}: {raised}"
            record.args, record.exc_info, record.exc_text = None, None, None
            return True
        message = record.getMessage()
        before, head, after = message.partition(TRACEBACK_HEAD)
        if head:
            record.msg, record.args = f"{before}{raised_of(after)}", None
        return True


class FailureLog:
    """The log of a loop that works on the database every few seconds (the keys' reload, the socket
    check, the router's poll, the alerts' reads): while the database is away each round fails, and a
    warning for each wrote a line every few seconds for the whole outage. Now a warning for the first
    failure of a run (``failing: the error``), the next ones at DEBUG, and one INFO line at the first
    round that works again (``working, after N failed attempts in S s``)."""

    def __init__(self, logger: logging.Logger, failing: str, working: str) -> None:
        self.log = logger
        self.failing = failing
        self.working = working
        self._run = FailureRun()

    def failed(self, exc: BaseException) -> None:
        if self._run.fail(time.monotonic()):
            self.log.warning("%s: %s (tried again quietly until it works)", self.failing, exc)
        else:
            self.log.debug("%s: %s", self.failing, exc)

    def worked(self) -> None:
        ended = self._run.succeed(time.monotonic())
        if ended is not None:
            attempts = "attempt" if ended.failed == 1 else "attempts"
            self.log.info("%s, after %d failed %s in %.1f s", self.working, ended.failed, attempts, ended.secs)


def configure_logging(level: str, log_format: str = "text") -> None:
    """``relay serve``'s log: every message to stderr as one escaped line (:class:`EscapingFormatter`),
    or one JSON object (``log_format`` ``json``), DBOS's among them: DBOS gives its logger a console
    handler of its own (unescaped, and not propagating) only when the logger has none, so it gets
    one that hands its lines to the root's."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(log_formatter(log_format))
    handler.addFilter(RequestIds())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    dbos = logging.getLogger("dbos")
    if not dbos.handlers:
        dbos.addHandler(logging.NullHandler())
    quiet = QuietRepeats()
    for name in QUIETED:
        logging.getLogger(name).addFilter(quiet)
    dbos.addFilter(FoldedTracebacks())  # after QuietRepeats: a warning held back needs no folding
