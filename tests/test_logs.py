"""Relay's log format (relay/logs.py): one line a message, no control character a sender chose.

The end-to-end cases (an alert handler's error, a peer's id and error) are in
tests/test_security_review.py; these check the formatter itself, as ``relay serve`` installs it.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from relay.core.ids import ExecutorKey, printable
from relay.core.requestid import current_request_id, serving, shared_task
from relay.logs import (
    LOG_FORMAT,
    EscapingFormatter,
    JsonLineFormatter,
    QuietRepeats,
    RequestIds,
    about,
    keeping_lines,
    one_line,
)

# Every kind of character the formatter escapes: C0 (line ends, tab, ESC, BEL), DEL, C1 (CSI, NEL),
# the line and paragraph separators, and the bidi controls.
CONTROLS = "\x00\x07\t\n\r\x1b\x7f\x85\x9b\u2028\u2029\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2069"


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    logger = logging.getLogger("relay.test-logs")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)


def test_a_line_written_while_a_request_is_served_ends_with_its_id_in_either_format() -> None:
    """The text format's `` [req=<id>]`` after the message (a traceback's lines after it), the JSON
    format's ``requestId``; nothing of the kind outside a request. ``relay serve``'s handler has
    the :class:`RequestIds` filter, which reads the id the HTTP middleware set."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    handler.addFilter(RequestIds())
    as_json = io.StringIO()
    json_handler = logging.StreamHandler(as_json)
    json_handler.setFormatter(JsonLineFormatter())
    json_handler.addFilter(RequestIds())
    logger = logging.getLogger("relay.test-request-ids")
    logger.addHandler(handler)
    logger.addHandler(json_handler)
    logger.propagate = False
    try:
        with serving("on-call-42"):
            try:
                raise ValueError("bad\nreply")
            except ValueError:
                logger.exception("step %s failed", "s\x1b", extra=about(ExecutorKey("acme", "ledger", "e\u202e")))
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(json_handler)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith(" ERROR relay.test-request-ids: step s\\x1b failed [req=on-call-42]"), lines
    assert lines[-2:] == ["ValueError: bad\\nreply", lines[-1]] and lines[-1].endswith(": outside"), lines
    failed, outside = map(json.loads, as_json.getvalue().splitlines())
    assert failed["requestId"] == "on-call-42" and failed["message"] == "step s\x1b failed", failed
    assert (failed["org"], failed["app"], failed["executorId"]) == ("acme", "ledger", "e\u202e"), failed
    assert failed["traceback"].startswith("Traceback") and failed["traceback"].endswith("ValueError: bad\nreply")
    assert "requestId" not in outside and outside["message"] == "outside", outside
    assert "\\u202e" in as_json.getvalue() and "\u202e" not in as_json.getvalue(), "ensure_ascii"


def test_a_task_a_request_starts_carries_its_id_and_a_task_shared_with_others_does_not() -> None:
    """A task serving more than the request that started it (a batch writer, the pool's reconnection,
    which starts the next attempt in turn) would carry that request's id on all its lines."""

    async def started() -> tuple[str | None, str | None]:
        async def request_id() -> str | None:
            return current_request_id()

        with serving("r-1"):
            own, shared = asyncio.create_task(request_id()), shared_task(request_id())
        return await own, await shared

    assert asyncio.run(started()) == ("r-1", None)


def test_a_message_is_one_line_with_every_control_character_escaped(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = logged
    logger.warning("peer %s failed: %s", "peer\n2026-01-01 00:00:00,000 CRITICAL relay: forged", f"x{CONTROLS}y")
    (line,) = stream.getvalue().splitlines()
    assert all(c not in line for c in CONTROLS), line
    assert "peer\\n2026-01-01 00:00:00,000 CRITICAL relay: forged" in line
    assert line.endswith("x" + "".join(repr(c)[1:-1] for c in CONTROLS) + "y")


def test_text_that_is_not_a_control_is_left_as_it_is() -> None:
    text = "exécuteur-ü 中文 ' \" \\ \\x1b % ✓ \u00a0"
    assert one_line(text) == text, "non-ASCII names, quotes, and a backslash are shown as they are"


def test_text_escaped_at_the_call_site_is_not_escaped_twice() -> None:
    hostile = "id\x1b]0;owned\x07\nforged\u202e"
    once = printable(hostile)
    assert one_line(once) == once == "id\\x1b]0;owned\\x07\\nforged\\u202e"
    assert one_line(hostile) == once, "the formatter writes what printable() writes"


def test_a_traceback_keeps_its_lines_but_not_the_escapes_in_its_message(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = logged
    try:
        raise ValueError("bad reply \x1b[2J\rRELAY OK\nsecond line")
    except ValueError:
        logger.exception("recovery %s: step failed", "r\x1b1")
    text = stream.getvalue()
    lines = text.splitlines()
    assert lines[0].endswith("recovery r\\x1b1: step failed")
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[2].startswith('  File "') and lines[2].endswith(
        "in test_a_traceback_keeps_its_lines_but_not_the_escapes_in_its_message"
    ), lines
    assert lines[3].strip().startswith("raise ValueError("), "the source line shown, escaped"
    assert lines[4:] == ["ValueError: bad reply \\x1b[2J\\rRELAY OK\\nsecond line"], "the message is one line"
    assert "\x1b" not in text and "\r" not in text
    assert keeping_lines("a\nb\x1bc") == "a\nb\\x1bc"


FORGED = "2026-01-01 00:00:00,000 CRITICAL relay: forged"


def test_no_message_in_a_traceback_forges_a_log_line(logged: tuple[logging.Logger, io.StringIO]) -> None:
    """An exception's message from outside (an executor's error text, a header's value), its
    cause's, a note, a group's members': each is one line in the traceback, which keeps its own."""
    logger, stream = logged
    try:
        try:
            raise OSError(f"executor said\n{FORGED}")
        except OSError as cause:
            cause.add_note(f"a note\n{FORGED}")
            raise ExceptionGroup(f"group\n{FORGED}", [ValueError(f"member\n{FORGED}")]) from cause
    except ExceptionGroup:
        logger.exception("failed")
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("ERROR relay.test-logs: failed")
    assert not [line for line in lines[1:] if FORGED in line and not line.split(FORGED)[0].endswith("\\n")], lines
    assert "OSError: executor said\\n" + FORGED in lines
    assert "a note\\n" + FORGED in lines
    assert "The above exception was the direct cause of the following exception:" in lines
    assert any(line.endswith("| ExceptionGroup: group\\n" + FORGED + " (1 sub-exception)") for line in lines), lines
    assert "    | ValueError: member\\n" + FORGED in lines, lines
    assert sum(line.startswith(("  File", "  |   File")) for line in lines) == 2, "each traceback's frame on its line"


def test_relay_serves_log_escapes_dbos_lines_too() -> None:
    """As ``relay serve`` sets it up (relay/cli/serve.py): the root's handler escapes, and DBOS's
    logger, which would otherwise get a console handler of its own (unescaped), hands its lines to it."""
    script = (
        "import logging\n"
        "from relay.logs import configure_logging\n"
        "configure_logging('info')\n"
        "import dbos._logger as d\n"
        "d.init_logger()\n"  # what DBOS() does at its start
        "logging.getLogger('dbos').warning('workflow %s failed', 'w\\x1b]0;owned\\x07\\nforged')\n"
        "logging.getLogger('uvicorn.error').info('path %s', '/x\\x1b[2J')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    lines = done.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].endswith("WARNING dbos: workflow w\\x1b]0;owned\\x07\\nforged failed"), lines
    assert lines[1].endswith("INFO uvicorn.error: path /x\\x1b[2J"), lines
    assert "\x1b" not in done.stderr


def test_relay_serves_json_log_has_dbos_and_uvicorns_lines_as_objects_too() -> None:
    """``--log-format json``: DBOS's lines and uvicorn's are objects like Relay's, uvicorn's copy
    of its message with terminal colours (``color_message``) left out."""
    script = (
        "import logging\n"
        "from relay.logs import configure_logging, log_instance\n"
        "configure_logging('info', 'json')\n"
        "log_instance('relay-7')\n"
        "import dbos._logger as d\n"
        "d.init_logger()\n"
        "logging.getLogger('dbos').warning('workflow %s failed', 'w\\x1b]0;owned\\x07\\nforged')\n"
        "logging.getLogger('uvicorn.error').info('path %s', '/x', extra={'color_message': '\\x1b[1mpath'})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    dbos, uvicorn = map(json.loads, done.stderr.splitlines())
    assert (dbos["level"], dbos["logger"], dbos["instance"]) == ("WARNING", "dbos", "relay-7"), dbos
    assert dbos["message"] == "workflow w\x1b]0;owned\x07\nforged failed", dbos
    assert uvicorn == {"time": uvicorn["time"], "level": "INFO", "logger": "uvicorn.error", "message": "path /x",
                       "instance": "relay-7"}  # fmt: skip
    assert "\x1b" not in done.stderr


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def quieted(logged: tuple[logging.Logger, io.StringIO]) -> Iterator[tuple[logging.Logger, io.StringIO, Clock]]:
    logger, stream = logged
    clock = Clock()
    quiet = QuietRepeats(window=60.0, clock=clock)
    logger.addFilter(quiet)
    try:
        yield logger, stream, clock
    finally:
        logger.removeFilter(quiet)


def test_a_repeated_warning_is_written_once_a_window_saying_how_many_were_held_back(
    quieted: tuple[logging.Logger, io.StringIO, Clock],
) -> None:
    logger, stream, clock = quieted
    for attempt in range(30):  # psycopg_pool's way: a template and its arguments
        logger.warning("error connecting in %r: %s", "pool-1", f"refused ({attempt})")
        clock.now += 1.0
    # DBOS's way: the message formatted already, the error's details after the first colon
    logger.warning("Exception listing queues: (psycopg.OperationalError) refused 1")
    logger.warning("Exception listing queues: (psycopg.OperationalError) refused 2")
    logger.warning("Notification listener error: refused")  # another kind: written
    logger.error("Exception listing queues: an error is always written")
    clock.now += 60.0
    logger.warning("error connecting in %r: %s", "pool-1", "refused (again)")
    lines = stream.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [
        "error connecting in 'pool-1': refused (0)",
        "Exception listing queues: (psycopg.OperationalError) refused 1",
        "Notification listener error: refused",
        "Exception listing queues: an error is always written",
        "error connecting in 'pool-1': refused (again) (29 more like it in 90 s, not logged)",
    ], lines


def test_relay_serve_quiets_the_libraries_that_warn_at_every_turn_of_an_outage() -> None:
    script = (
        "import logging\n"
        "from relay.logs import configure_logging\n"
        "configure_logging('INFO')\n"
        "for n in range(5):\n"
        "    logging.getLogger('dbos').warning(f'Exception polling schedules: refused {n}')\n"
        "    logging.getLogger('psycopg.pool').warning('error connecting in %r: %s', 'pool-1', n)\n"
        "    logging.getLogger('relay.lease').warning('not quieted: %s', n)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    lines = done.stderr.splitlines()
    assert sum("WARNING dbos: Exception polling schedules" in line for line in lines) == 1, lines
    assert sum("WARNING psycopg.pool: error connecting" in line for line in lines) == 1, lines
    assert sum("WARNING relay.lease: not quieted" in line for line in lines) == 5, lines


def test_relay_serve_quiets_warnings_only_not_the_libraries_info_lines() -> None:
    """Wrong: QuietRepeats holds back every record up to WARNING, INFO too, though it, the README
    and the CHANGELOG say repeated *warnings* are written once a minute. DBOS's INFO lines name
    what it did, the details after the first colon: ``Resuming workflows: [...]`` when Relay's
    engine resumes stranded grace periods (workflows/engine.py), ``Cancelling workflow(s): [...]``,
    ``Deleting workflow(s): [...]``. The second of those within a minute, with other workflow ids,
    is dropped (and counted only if a third comes a minute later), outage or not."""
    script = (
        "import logging\n"
        "from relay.logs import configure_logging\n"
        "configure_logging('INFO')\n"
        "logging.getLogger('dbos').info(\"Resuming workflows: ['grace:acme:ledger:a:1']\")\n"
        "logging.getLogger('dbos').info(\"Resuming workflows: ['grace:acme:ledger:b:1']\")\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    lines = done.stderr.splitlines()
    assert any("INFO dbos: Resuming workflows: ['grace:acme:ledger:a:1']" in line for line in lines), lines
    assert any("INFO dbos: Resuming workflows: ['grace:acme:ledger:b:1']" in line for line in lines), lines


def test_relay_serve_writes_a_dbos_warning_with_a_traceback_as_one_line_saying_what_was_raised() -> None:
    """DBOS logs some warnings with the traceback in their text (``traceback.format_exc()``: polling
    schedules), others with the record's exception (``exc_info``: a fallback poll): each was the
    traceback's frames, DBOS's and SQLAlchemy's, some 9,000 characters while the database is away,
    escaped into one line or written as lines of their own. Now the line says what was raised, and
    the frames are kept at DEBUG."""
    script = (
        "import logging, sys, traceback\n"
        "from relay.logs import configure_logging\n"
        "configure_logging(sys.argv[1])\n"
        "logging.getLogger('dbos').setLevel(logging.WARNING)\n"  # as Relay's engine gives DBOS
        "def fail():\n"
        "    try:\n"
        "        raise OSError('refused\\n\\tIs the server running?')\n"
        "    except OSError as exc:\n"
        "        raise ConnectionError('connection failed') from exc\n"
        "try:\n"
        "    fail()\n"
        "except ConnectionError as exc:\n"
        "    logging.getLogger('dbos').warning(f'Exception polling schedules: {traceback.format_exc()}')\n"
        "    logging.getLogger('dbos').warning('Fallback notification poll failed', exc_info=True)\n"
        "    logging.getLogger('dbos').error('Exception encountered in background workflow:', exc_info=True)\n"
        "logging.getLogger('relay.test').error('not folded', exc_info=ValueError('own'))\n"
    )

    def logged(level: str) -> list[str]:
        run = [sys.executable, "-c", script, level]
        return subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stderr.splitlines()

    lines = logged("INFO")
    dbos = [line for line in lines if " WARNING dbos: " in line]
    assert [line.split(" WARNING dbos: ", 1)[1] for line in dbos] == [
        "Exception polling schedules: ConnectionError: connection failed",
        "Fallback notification poll failed: ConnectionError: connection failed",
    ], lines
    # Errors keep their tracebacks (a failed workflow's frames are Relay's code), and so do Relay's own.
    assert sum(line.startswith("Traceback (most recent call last):") for line in lines) == 2, lines
    assert "ConnectionError: connection failed" in lines and "ValueError: own" in lines, lines
    # At DEBUG, DBOS's come as they are: the frames, and the cause with its message.
    debug = "\n".join(logged("DEBUG"))
    assert debug.count("Traceback (most recent call last):") == 6, debug  # two in each of DBOS's
    assert "OSError: refused" in debug and ", in fail" in debug, debug
