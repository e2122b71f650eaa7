"""Loaded at start-up by every Python process with this folder on its PYTHONPATH.

With ``RELAY_TEST_WRITE_LOG`` set, it wraps psycopg's cursors and appends,
for every statement that writes the ``executors`` table, the process id and
the first Relay module on the call stack (the one that issued it) to that
file. The single-writer test reads it.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

_LOG = os.environ.get("RELAY_TEST_WRITE_LOG")
_WRITES = re.compile(r"\b(UPDATE\s+executors|DELETE\s+FROM\s+executors|INSERT\s+INTO\s+executors)\b", re.I)


def _writer() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if name.startswith(("relay.", "workflows.")):
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return "<outside relay>"


def _note(query: Any) -> None:
    if _LOG and _WRITES.search(str(query)):
        with open(_LOG, "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()} {_writer()}\n")


if _LOG:
    import psycopg

    _async_execute = psycopg.AsyncCursor.execute
    _sync_execute = psycopg.Cursor.execute

    async def _execute_async(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        _note(query)
        return await _async_execute(self, query, *args, **kwargs)

    def _execute_sync(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        _note(query)
        return _sync_execute(self, query, *args, **kwargs)

    psycopg.AsyncCursor.execute = _execute_async  # type: ignore[method-assign]
    psycopg.Cursor.execute = _execute_sync  # type: ignore[method-assign]
