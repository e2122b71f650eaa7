"""Statements on a connection of one's own, answered within a bound even when the database host is
gone without a word: the lease's renewals (:mod:`relay.store.lease`) and the readiness probe
(:mod:`relay.store.probe`) both run on such a connection, outside the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import psycopg

from relay.errors import DatabaseError

log = logging.getLogger("relay.store")

Conn = psycopg.AsyncConnection[dict[str, Any]]

# How long a statement whose socket was shut may take to fail.
SHUT_WAIT_SECS = 1.0


async def bounded(
    conn: Conn, query: str, params: dict[str, Any] | tuple[Any, ...], limit: float, what: str
) -> psycopg.AsyncCursor[dict[str, Any]]:
    """``conn.execute``, answered within ``limit`` seconds or failed with :class:`DatabaseError`
    (its message begins with ``what``).

    The server's ``statement_timeout`` bounds a statement stuck on a lock, but not one whose
    database host went away without a reset (a failover, a crashed machine): the socket stays
    open and nothing comes back until the kernel gives up, a quarter of an hour later. Such a
    statement is ended by shutting its socket, which fails it at once. Cancelling it instead
    would make psycopg first ask the gone server to cancel it, for up to ten seconds.
    """
    statement = asyncio.ensure_future(conn.execute(query, params))
    # A statement given up on fails once its socket is shut, perhaps after this returns or is
    # cancelled: its failure is retrieved here, expected and not worth a word (asyncio would log an
    # ERROR with a traceback for each).
    statement.add_done_callback(_retrieved)
    answered = False
    try:
        await asyncio.wait({statement}, timeout=limit)
        answered = statement.done()
    finally:  # also when cancelled
        if not statement.done():
            _shut(conn)
            await asyncio.wait({statement}, timeout=SHUT_WAIT_SECS)
            if not statement.done():
                statement.cancel()
    if not answered:
        raise DatabaseError(f"{what}: no answer within {limit:g}s")
    exc = statement.exception()
    if isinstance(exc, psycopg.Error):
        raise DatabaseError(f"{what}: {exc}") from exc
    if exc is not None:
        raise exc
    return statement.result()


async def close_quietly(conn: Conn, what: str) -> None:
    """Close ``conn``; a failure to (the server is gone) is only worth a debug line."""
    try:
        await conn.close()
    except psycopg.Error as exc:
        log.debug("closing the %s's connection: %s", what, exc)


def _retrieved(statement: asyncio.Future[Any]) -> None:
    if not statement.cancelled():
        statement.exception()


def _shut(conn: Conn) -> None:
    """Shut the connection's socket (a duplicate of its descriptor, so that libpq's stays valid)."""
    with contextlib.suppress(OSError, psycopg.Error):
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
