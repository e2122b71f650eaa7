"""Whether the database answers, for ``/readyz``: on a connection of its own, within a short time.

The probe does not go through the pool: while slow requests hold every connection of it (a mass
reconnection after an instance died, reads waiting on a lock), a probe there would wait up to the
pool's 10 s, past the readiness probe's timeout, and a busy fleet would be taken out of its load
balancer all at once though each instance reaches its database. Its one connection is opened at the
first probe and again after a failure; a statement not answered within :data:`PROBE_SECS` (a
database gone without a word) is ended by shutting its socket, as the lease's are
(:func:`relay.store.bounded.bounded`). Probes that come together take turns on it. What it finds
is told to the pool's :class:`relay.store.db.Database`, if given: a probe without an answer makes
the API's requests refused at once, not after the pool's wait (:attr:`Database.down_since`).
"""

from __future__ import annotations

import asyncio
import logging

import psycopg
from psycopg.rows import dict_row

from relay.errors import DatabaseError
from relay.store.bounded import Conn, bounded, close_quietly
from relay.store.db import Database

log = logging.getLogger("relay.probe")

# How long a probe may take, connecting included: within the manifests' readiness timeout (2 s).
PROBE_SECS = 1.5


class DatabaseProbe:
    def __init__(self, conninfo: str, limit: float = PROBE_SECS, db: Database | None = None) -> None:
        self.conninfo = conninfo
        self.limit = limit
        self.db = db
        self._conn: Conn | None = None
        self._turn = asyncio.Lock()

    async def answers(self) -> bool:
        """True if the database answered ``SELECT 1`` within :attr:`limit` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limit
        try:
            async with asyncio.timeout_at(deadline):
                await self._turn.acquire()
        except TimeoutError:
            return False  # the probe before this one is still waiting: no better for this one
        try:
            return await self._probe(deadline)
        except BaseException:  # cancelled (the client went away): the connection's state is unknown
            await self.close()
            raise
        finally:
            self._turn.release()

    async def _probe(self, deadline: float) -> bool:
        """``SELECT 1`` by the deadline, on the open connection, then (once it failed: the server may
        have closed it while idle) on a new one."""
        loop = asyncio.get_running_loop()
        for _ in range(2):
            fresh = self._conn is None or self._conn.closed
            try:
                if fresh:
                    self._conn = None
                    connecting = psycopg.AsyncConnection.connect(self.conninfo, autocommit=True, row_factory=dict_row)
                    self._conn = await asyncio.wait_for(connecting, max(0.0, deadline - loop.time()))
                assert self._conn is not None
                await bounded(self._conn, "SELECT 1", (), max(0.0, deadline - loop.time()), "readiness probe")
                if self.db is not None:
                    self.db.note_answered()
                return True
            except (DatabaseError, psycopg.Error, OSError, TimeoutError) as exc:
                log.debug("readiness probe: the database did not answer: %s", exc or type(exc).__name__)
                await self.close()
                if fresh or loop.time() >= deadline:
                    if self.db is not None:
                        self.db.note_unreachable(exc)
                    return False
        return False

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await close_quietly(conn, "readiness probe")
