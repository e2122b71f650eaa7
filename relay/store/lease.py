"""This instance's lease (contract rule 5): a row renewed well within ``instanceLeaseSecs``.

The lease is *held* while the last renewal that the database confirmed was
sent less than ``instanceLeaseSecs`` ago, by this process's monotonic clock:
an instance that was paused (``SIGSTOP``) or cut off from the database past
its lease does not count itself ready until a renewal succeeds again, and
holds no executor meanwhile (:meth:`relay.net.hub.Hub.let_go`). A
renewal succeeds only while the row's ``lease_epoch`` is still this
instance's: an instance that adopts an expired lease raises the epoch, and
the old holder then knows it was fenced out.

The lease has a connection of its own, opened when it is acquired and opened
again after a failure, not one of the pool's: a pool kept busy by a burst of
work (a mass disconnection, slow API requests) would otherwise hold up the
renewal until the lease ran out, and the instance would be adopted while
perfectly alive. Its statements time out well within the renewal period
(:data:`STATEMENT_SHARE` of it) on the server, so a renewal stuck on a lock
gives way to the next one in time, and within the period on the client
(:func:`relay.store.bounded.bounded`), for a connection whose server is gone without a word.

Every write bound to what this instance owns goes through
:meth:`relay.store.db.Database.fenced`, which checks the same row in the same
transaction: the lease, not this process's belief, decides. When a renewal
finds the epoch taken over, ``on_fenced`` is called (the runtime exits: the
process manager starts it again with a new epoch).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.rows import dict_row

from relay.errors import DatabaseError
from relay.store.bounded import Conn, bounded, close_quietly
from relay.store.db import Database

log = logging.getLogger("relay.lease")


# Renewals come every third of the lease; a statement of the lease's own
# connection may take this share of that period, connecting at most all of it.
STATEMENT_SHARE = 0.75
# A failed renewal is tried again after this share of the renewal period, until one succeeds:
# a cut of the database shorter than about two thirds of the lease (less the time to connect
# again) leaves the lease held.
RETRY_SHARE = 0.1
# Attempts to connect pending at once, at most (each gives up after a renewal period).
MAX_ATTEMPTS = 8


class Lease:
    def __init__(self, db: Database, instance_id: str, lease_secs: float) -> None:
        self.db = db
        self.instance_id = instance_id
        self.lease_secs = lease_secs
        self.epoch: int | None = None
        self.fenced = False
        self._valid_until = 0.0
        self._held_since = 0.0
        # A renewal failed (the database was cut off) and none has succeeded since: a gap, even
        # while the lease has not run out yet.
        self._renewal_failed = False
        self._task: asyncio.Task[None] | None = None
        self._conn: Conn | None = None
        self._attempts: set[asyncio.Future[Conn]] = set()
        self._leftovers: set[asyncio.Future[Any]] = set()  # attempts given up, and their closes
        self.on_fenced: Callable[[], None] | None = None

    @property
    def renew_every(self) -> float:
        return self.lease_secs / 3

    @property
    def retry_every(self) -> float:
        """The wait before trying again after a failed renewal."""
        return self.renew_every * RETRY_SHARE

    async def _connection(self, patience: float) -> Conn:
        """The lease's own connection: the open one, or else one that an attempt to connect opens
        within ``patience`` (:meth:`_connect`). Each call without an open connection begins an
        attempt and takes the first that connects, an earlier one still pending included: where a
        cut drops packets, a new attempt reaches the database as soon as it is back, while an
        older one waits for its own SYN to be sent again (after 1, 3, 7 s...)."""
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if len(self._attempts) < MAX_ATTEMPTS:
            self._attempts.add(asyncio.ensure_future(self._connect()))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        while True:
            conn, error = await self._settle_attempts()
            if conn is not None:
                self._conn = conn
                self._give_up_attempts()
                return conn
            left = deadline - loop.time()
            if left <= 0 or not self._attempts:
                raise DatabaseError(f"lease connection: {error or f'no answer within {patience:g}s'}")
            await asyncio.wait(set(self._attempts), timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def _give_up_attempts(self) -> None:
        """Cancel the attempts still pending; one that connected meanwhile has its connection closed."""
        attempts, self._attempts = self._attempts, set()
        for attempt in attempts:
            attempt.cancel()
            self._leftovers.add(attempt)
            attempt.add_done_callback(self._discard)

    def _discard(self, attempt: asyncio.Future[Any]) -> None:
        self._leftovers.discard(attempt)
        if attempt.cancelled() or attempt.exception() is not None:
            return
        closing = asyncio.ensure_future(close_quietly(attempt.result(), "lease"))
        self._leftovers.add(closing)
        closing.add_done_callback(self._leftovers.discard)

    async def _settle_attempts(self) -> tuple[Conn | None, str | None]:
        """The first connection that the ended attempts opened (any other is closed), and the
        last error among them."""
        conn: Conn | None = None
        error: str | None = None
        for attempt in [a for a in self._attempts if a.done()]:
            self._attempts.discard(attempt)
            if attempt.cancelled():
                continue
            exc = attempt.exception()
            if exc is not None:
                error = str(exc)
            elif conn is None:
                conn = attempt.result()
            else:
                await close_quietly(attempt.result(), "lease")
        return conn, error

    async def _connect(self) -> Conn:
        """A new connection whose statements time out well within the renewal period; an attempt
        that has no answer within the period gives up."""
        timeout_ms = max(1, int(self.renew_every * STATEMENT_SHARE * 1000))
        try:
            conn = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(self.db.conninfo, autocommit=True, row_factory=dict_row),
                self.renew_every,
            )
        except (psycopg.Error, TimeoutError) as exc:
            raise DatabaseError(f"{exc or type(exc).__name__}") from exc
        try:
            await bounded(conn, f"SET statement_timeout = {timeout_ms}", (), self.renew_every, "lease")
        except BaseException:
            await close_quietly(conn, "lease")
            raise
        return conn

    async def _execute(
        self, query: str, params: dict[str, Any] | tuple[Any, ...], patience: float | None = None
    ) -> psycopg.AsyncCursor[dict[str, Any]]:
        """One statement on the lease's connection (connecting within ``patience``, by default a
        renewal period), answered within a renewal period; a failure closes it (the next use
        opens a new one)."""
        try:
            conn = await self._connection(self.renew_every if patience is None else patience)
        except Exception as exc:
            self.db.note_unreachable(exc)
            raise
        try:
            cur = await bounded(conn, query, params, self.renew_every, "lease")
        except BaseException as exc:
            # Failed, timed out or cancelled mid-statement: the connection's state is unknown.
            if isinstance(exc, Exception):
                self.db.note_unreachable(exc)
            await self._drop()
            raise
        self.db.note_answered()
        return cur

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await close_quietly(conn, "lease")

    @property
    def held(self) -> bool:
        return not self.fenced and asyncio.get_running_loop().time() < self._valid_until

    def held_until(self) -> float:
        """The loop time at which the lease stops being held, unless a renewal is confirmed first
        (0 once fenced). Past it, another instance may adopt this one: the hub then lets its
        executors go (:meth:`relay.net.hub.Hub.let_go`)."""
        return 0.0 if self.fenced else self._valid_until

    def held_for(self) -> float:
        """Seconds this lease has been held without a gap (0 when it is not held).

        An instance that just got its lease back after losing the database for
        longer than the lease should not adopt the others yet: they lost it too,
        and renew theirs within a lease once the database is back. A renewal that
        failed is a gap too, though the lease had not run out: the others' renewals
        may have failed in the same outage, and an unlucky one's lease may have
        expired while this one's had not.
        """
        if not self.held or self._renewal_failed:
            return 0.0
        return asyncio.get_running_loop().time() - self._held_since

    async def acquire(self) -> int:
        """Take this instance's lease at start-up, with a new epoch."""
        sent = asyncio.get_running_loop().time()
        # ``held`` locks an existing row FOR UPDATE before the new epoch is written: a process
        # still running under this id finishes its fenced writes first (relay.store.db.Database.fenced).
        # A new row's epoch is the time in milliseconds, not 1: retention deletes the rows of
        # instances adopted long ago (relay.store.retention), and an id started again must not take
        # an epoch its predecessor held (a process paused under it would pass the fence, and the
        # InstanceAdopted alert of (instance, epoch) would be taken for the earlier one's).
        cur = await self._execute(
            """WITH held AS (SELECT instance_id FROM relay_instances WHERE instance_id = %(id)s FOR UPDATE)
               INSERT INTO relay_instances AS i (instance_id, lease_epoch, lease_expires_at, started_at,
                                                renewed_at)
               SELECT %(id)s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint,
                      now() + make_interval(secs => %(secs)s), now(), now()
               FROM (SELECT count(*) FROM held) AS h
               ON CONFLICT (instance_id) DO UPDATE SET lease_epoch = i.lease_epoch + 1,
                   lease_expires_at = EXCLUDED.lease_expires_at, started_at = now(), renewed_at = now(),
                   adopted_by = NULL, adopted_at = NULL, released_at = NULL
               RETURNING lease_epoch""",
            {"id": self.instance_id, "secs": self.lease_secs},
        )
        row = await cur.fetchone()
        assert row is not None
        self.epoch = int(row["lease_epoch"])
        self.fenced = False
        self.db.fence = (self.instance_id, self.epoch)
        self._valid_until = sent + self.lease_secs
        self._held_since = sent
        log.info("instance %s holds its lease (epoch %d)", self.instance_id, self.epoch)
        return self.epoch

    async def renew(self, patience: float | None = None) -> bool:
        """Renew the lease (False: fenced out). ``patience``: how long to wait for a connection
        when none is open (:meth:`_connection`); by default a renewal period."""
        sent = asyncio.get_running_loop().time()
        try:
            cur = await self._execute(
                """UPDATE relay_instances SET lease_expires_at = now() + make_interval(secs => %s),
                          renewed_at = now()
                   WHERE instance_id = %s AND lease_epoch = %s""",
                (self.lease_secs, self.instance_id, self.epoch),
                patience,
            )
        except DatabaseError:
            self._renewal_failed = True
            raise
        if cur.rowcount != 1:
            if not self.fenced:
                log.error("instance %s lost its lease (epoch %s): another instance adopted it, or a second "
                          "instance runs with the same RELAY_INSTANCE_ID", self.instance_id, self.epoch)  # fmt: skip
            self.fenced = True
            if self.on_fenced is not None:
                self.on_fenced()
            return False
        if not self.held or self._renewal_failed:
            self._held_since = sent
            self._renewal_failed = False
        self._valid_until = sent + self.lease_secs
        return True

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            if self.epoch is not None and not self.fenced:
                await self._release()
        finally:
            await self._drop()
            self._give_up_attempts()
            await asyncio.gather(*list(self._leftovers), return_exceptions=True)
            await asyncio.gather(*list(self._leftovers), return_exceptions=True)  # the closes they began

    async def _release(self) -> None:
        """Stopping cleanly: the lease ends now rather than when it would run out, and says it was
        given up (its adoption is expected: no InstanceAdopted alert). Tried again once on a new
        connection: the lease's may have been closed by the server since the last renewal (a
        failover, a restart of PostgreSQL), which the first try finds out and drops."""
        for attempt in (1, 2):
            try:
                await self._execute(
                    """UPDATE relay_instances SET lease_expires_at = now(), released_at = now()
                       WHERE instance_id = %s AND lease_epoch = %s""",
                    (self.instance_id, self.epoch),
                )
                return
            except DatabaseError as exc:
                if attempt == 2:
                    log.warning("instance %s could not give up its lease (another instance adopts it once "
                                "it runs out): %s", self.instance_id, exc)  # fmt: skip

    async def _keep(self) -> None:
        # On a fixed beat from the last renewal sent, however long a renewal took; after a failed
        # one, again every RETRY_SHARE of the period until one succeeds. Waiting for the next beat
        # instead, a cut of the database just longer than a third of the lease, beginning just
        # before a beat, outlived the lease: the cut failed one beat, and the next came too late.
        loop = asyncio.get_running_loop()
        beat = loop.time()
        failed = 0
        while not self.fenced:
            beat = max(beat + self.renew_every, loop.time())
            await asyncio.sleep(beat - loop.time())
            try:
                await self.renew(patience=self.retry_every if failed else None)
            except DatabaseError as exc:
                failed += 1
                if failed == 1:
                    log.warning("instance %s could not renew its lease (trying again every %g s): %s",
                                self.instance_id, self.retry_every, exc)  # fmt: skip
                else:
                    log.debug("instance %s could not renew its lease (try %d): %s", self.instance_id, failed, exc)
                beat = loop.time() + self.retry_every - self.renew_every
                continue
            if failed:
                log.info("instance %s renewed its lease again after %d failed tries", self.instance_id, failed)
                failed = 0
