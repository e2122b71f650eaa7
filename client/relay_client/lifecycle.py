"""Stopping with DBOS: the connection must not outlive the DBOS it answers for.

DBOS has no public shutdown hook, so three things stop a connection:

1. ``DBOS.destroy`` is wrapped, once per process. Before DBOS's own destroy,
   the wrapper drains this process's connections: requests are refused from
   then on, the retention round ends at its next batch, and the wrapper waits
   for handlers still running (up to 2 s) and the round (up to 10 s), so
   nothing runs against a DBOS taken away from under it (dbos 3.2's client
   ended its round before DBOS took the system database away too). The socket
   stays open while DBOS waits for active workflows
   (``workflow_completion_timeout_sec``), so Relay does not start the
   executor's grace period meanwhile, as DBOS's own conductor client did; it
   is closed right after DBOS's own destroy returns.
2. The connection's loop checks twice a second that the DBOS it was started for
   is still the live one, and stops itself when it is not: a destroy the
   wrapper did not see (a reference to the unwrapped method taken before
   ``connect()``) still ends it.
3. An ``atexit`` handler stops every connection, so an interpreter that exits
   without ``DBOS.destroy()`` still closes its socket with a close frame. It runs
   before an application's own ``atexit.register(DBOS.destroy, ...)`` made
   before ``connect()``; no workflow is cut short by that, since the interpreter
   waits for DBOS's workflow threads (a ``concurrent.futures`` pool, whose exit
   hook runs before any ``atexit`` handler) with the socket still open.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from typing import Any

from dbos import DBOS

from relay_client.connection import Connection

_lock = threading.Lock()
_connections: list[Connection] = []
_installed = False


def track(connection: Connection) -> None:
    """Stop ``connection`` with DBOS (and at exit); installs the hooks on first use."""
    _install()
    with _lock:
        _connections[:] = [c for c in _connections if c.running]
        _connections.append(connection)


def active() -> list[Connection]:
    """The connections whose thread is still running."""
    with _lock:
        return [c for c in _connections if c.running]


def stop_all(timeout: float = 10.0) -> None:
    with _lock:
        connections, _connections[:] = list(_connections), []
    for connection in connections:
        connection.stop(timeout)


def drain_all() -> None:
    """Drain every running connection (see :meth:`Connection.drain`): the first step of destroy."""
    for connection in active():
        connection.drain()


def _forget_in_child() -> None:
    """A forked process has none of its parent's connection threads (nor a lock another thread of
    the parent held at the fork)."""
    global _lock
    _lock = threading.Lock()
    _connections.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    original = DBOS.destroy  # bound to the class: a classmethod

    @functools.wraps(original)
    def destroy(cls: type[DBOS], *args: Any, **kwargs: Any) -> None:
        try:
            drain_all()
            original(*args, **kwargs)
        finally:
            stop_all()

    DBOS.destroy = classmethod(destroy)  # type: ignore[method-assign,assignment]
    atexit.register(stop_all, 5.0)
