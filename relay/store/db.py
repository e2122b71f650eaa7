"""Relay's PostgreSQL: the connection pool, plain and fenced transactions.

psycopg's errors become :class:`relay.errors.DatabaseError` here, at the
boundary, so the layers above handle only Relay's own errors: a
:class:`relay.errors.DatabaseUnreachable` (or its :class:`relay.errors.ConnectionLost`)
when the database was not reached, whatever the statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from typing import Any, Generic, TypeVar
from urllib.parse import urlencode

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from relay import __version__
from relay.core.requestid import shared_task
from relay.errors import ConnectionLost, DatabaseError, DatabaseUnreachable, Fenced, StartupError
from relay.store.combiner import WriteCombiner
from relay.store.migrations import MIGRATION_LOCK_KEY, MIGRATIONS, Index, Migration

log = logging.getLogger("relay.db")

T = TypeVar("T")

# Replacing a lost connection: psycopg_pool's attempt (two tries in a row) is given up as it fails,
# and the next begins this long after, or as soon as the database is seen answering (a request's own
# connection, the readiness probe, the lease's renewal), whichever comes first.
RECONNECT_EVERY_SECS = 1.0
# A pool that cannot grow while it holds connections (PostgreSQL at max_connections or the role's
# CONNECTION LIMIT): its requests are served through the connections it has, and an attempt a second
# would be two refused connections a second for as long as the limit holds (each a line of the
# server's log, a line of ours). The wait between attempts doubles from RECONNECT_EVERY_SECS up to
# this, and begins again at RECONNECT_EVERY_SECS once a connection is made.
GROW_AGAIN_MAX_SECS = 30.0
# How long a batch whose connection was lost under it waits for another on its second run
# (Database.again_if_lost): the database is back after a restart, and in an outage it is refused
# soon, not after the pool's 10 s.
LOST_AGAIN_WAIT_SECS = 2.0
CONNECT_TIMEOUT_SECS = 5
# A transaction whose COMMIT met a lost connection, its server process not gone yet (PostgreSQL still
# ending it): its outcome is asked again this often, this many times, before the batch runs again.
IN_DOUBT_POLL_SECS = 0.05
IN_DOUBT_POLLS = 20
# How long a connection asked for as the database returns waits for the pool's renewal to begin
# (Database._renew: one turn of the event loop; a bound, should the renewal never start).
RENEWAL_BEGINS_SECS = 1.0


class Landed(Generic[T]):
    """What a transaction run by :meth:`Database.again_if_lost` gives back, kept with the transaction's
    id (``txid_current()``: PostgreSQL 13's pg_current_xact_id is not in older servers) before its
    COMMIT: if the connection is lost under the COMMIT, the commit may have been made, and a second
    run would find the first's changes and report them as the rows' state before (a handshake's
    previous state HEALTHY, not DISCONNECTED or DEAD)."""

    def __init__(self) -> None:
        self.xact: str | None = None
        self.value: T | None = None

    def keep(self, xact: str, value: T) -> None:
        self.xact, self.value = xact, value


# A database host lost without a reset (a failover, a crashed machine, a dropped route) leaves each
# connection's socket open, and the server's statement_timeout cannot end a statement the server
# never got: a query sent on it would wait until the kernel gives up on the socket (about a quarter
# of an hour on Linux), and an idle connection would be probed only after two hours. With these
# libpq settings, sent data not acknowledged for 30 s fails the connection, and an idle one is
# probed after 10 s, every 5 s; on Linux tcp_user_timeout also decides when unanswered probes end
# it (tcp(7): it overrides the probe count), 30 s after the host was last heard from (keepalives_count
# counts where tcp_user_timeout is not supported). Each applies to TCP connections only; a setting
# given in the database URL wins.
TCP_SETTINGS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def tcp_settings(url: str) -> dict[str, int]:
    """:data:`TCP_SETTINGS`, less those the database URL gives."""
    given = conninfo_to_dict(url)
    return {name: value for name, value in TCP_SETTINGS.items() if name not in given}


def with_tcp_settings(url: str) -> str:
    """The database URL with :func:`tcp_settings` added, for every connection Relay makes: as query
    parameters of a ``postgresql://`` URL (psycopg's, DBOS's and SQLAlchemy's engines all read
    them), or to a libpq ``key=value`` string."""
    extra = tcp_settings(url)
    if not extra:
        return url
    if "://" not in url:
        return make_conninfo(url, **extra)
    # Appended as text: urlunsplit would drop the empty host of ``postgresql:///db?host=/socket/dir``.
    base, mark, fragment = url.partition("#")
    joint = "" if base.endswith(("?", "&")) else "&" if "?" in base else "?"
    return f"{base}{joint}{urlencode(extra)}{mark}{fragment}"


# While the database is known unreachable, a request of the API does not wait for the pool (its
# 10 s): one connection of its own asks whether the database answers now, given this long, and the
# answer serves the requests of the next RECHECK_REUSE_SECS too (one attempt at a time).
RECHECK_SECS = 0.5
RECHECK_REUSE_SECS = 0.25


def deadlocked(exc: BaseException) -> bool:
    """Whether PostgreSQL failed this transaction to break a deadlock (it may simply run again)."""
    return isinstance(exc.__cause__, psycopg.errors.DeadlockDetected)


# How long the current task waits for a connection of the pool; None: the pool's timeout.
_patience: contextvars.ContextVar[float | None] = contextvars.ContextVar("relay_db_patience", default=None)
# The task of a request of the API, refused at once while the database is known unreachable. The task
# itself, not a flag: a task it starts (a workflow, a lane of combined writes, an audit entry's write)
# inherits the variable but is another task, and waits for connections as the pool does.
_hasty: contextvars.ContextVar[asyncio.Task[Any] | None] = contextvars.ContextVar("relay_db_hasty", default=None)


async def patiently(coro: Coroutine[Any, Any, T], wait_secs: float) -> T:
    """Await ``coro`` waiting up to ``wait_secs`` for each connection it asks of the pool (not the
    pool's 10 s). For work that is retried anyway when it fails (the workflows' steps): in a group
    failure of thousands the pool's queue can be longer than 10 s, and a wait costs less than a
    failure, its retry and the traceback DBOS logs for it. (The combined writes wait in their own
    tasks, as long as the pool does.)"""
    token = _patience.set(wait_secs)
    try:
        return await coro
    finally:
        _patience.reset(token)


@contextlib.contextmanager
def hastily() -> Iterator[None]:
    """Within it (a request of the API), while the database is known unreachable
    (:attr:`Database.down_since`), a connection is not waited for: unless a connection of its own
    finds the database answering now (within :data:`RECHECK_SECS`), the caller is answered 503 at
    once, not after the pool's 10 s. :func:`patiently` wins over it. Only the task that enters it is
    hasty, not the tasks it starts."""
    token = _hasty.set(asyncio.current_task())
    try:
        yield
    finally:
        _hasty.reset(token)


# How often an instance looks again for the migrations' lock another holds, and after how long it says so.
MIGRATION_POLL_SECS = 0.2
MIGRATION_WAIT_NOTICE_SECS = 5.0
# Times the migrations are begun again after PostgreSQL broke a deadlock by cancelling an index build.
INDEX_BUILD_ATTEMPTS = 3


def _batches(pending: list[Migration]) -> list[list[Migration]]:
    """The migrations to apply, in order, as the runs that share a transaction: the migrations of
    SQL that follow one another, and each migration of indexes on its own."""
    batches: list[list[Migration]] = []
    for migration in pending:
        if migration.indexes and (migration.sql or migration.breaks_older):
            raise ValueError(f"migration {migration.version}: a migration of indexes has no SQL and breaks nothing")
        if migration.indexes or not batches or batches[-1][0].indexes:
            batches.append([migration])
        else:
            batches[-1].append(migration)
    return batches


async def _build_index(conn: psycopg.AsyncConnection[dict[str, Any]], index: Index) -> None:
    """Build ``index`` with ``CREATE INDEX CONCURRENTLY`` (in autocommit: it cannot run in a
    transaction), unless it is there and valid. One left ``INVALID`` by a build cut short is
    dropped and built again."""
    name = sql.Identifier(index.name)
    cur = await conn.execute(
        "SELECT indisvalid AS valid FROM pg_index WHERE indexrelid = to_regclass(%s)", (index.name,)
    )
    row = await cur.fetchone()
    if row is not None and row["valid"]:
        return
    if row is not None:
        log.warning("index %s was left invalid by a build cut short: dropping it to build it again", index.name)
        await conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(name))
    log.info("building index %s concurrently", index.name)
    started = time.monotonic()
    await conn.execute(sql.SQL("CREATE INDEX CONCURRENTLY {} ON " + index.on).format(name))
    log.info("built index %s in %.1f s", index.name, time.monotonic() - started)


class Database:
    """The pool; every query goes through :meth:`connection`."""

    def __init__(self, url: str, *, min_size: int = 2, max_size: int = 16) -> None:
        self.url = url
        # What Relay's own connections connect to: the URL with the TCP settings.
        self.conninfo = with_tcp_settings(url)
        # (instance id, lease epoch) that :meth:`fenced` checks; set by relay.cluster.lease.Lease.
        self.fence: tuple[str, int] | None = None
        self.pool: AsyncConnectionPool[psycopg.AsyncConnection[dict[str, Any]]] = AsyncConnectionPool(
            self.conninfo,
            connection_class=psycopg.AsyncConnection[dict[str, Any]],
            min_size=min_size,
            max_size=max_size,
            open=False,
            timeout=10.0,
            # psycopg_pool waits 1, 2, 4, 8, ... s between attempts to replace a lost connection:
            # after an outage of some seconds its next attempt could come seconds after the
            # database is back. Its attempt is given up as it fails, and Relay begins the next
            # (_reconnect_soon: check() grows the pool again) a second later, however long the
            # outage, or at once when something else of Relay's finds the database answering: the
            # requests waiting for a connection get one as the database returns, not up to a
            # second after, and a database that is down is not asked more often than before.
            reconnect_timeout=0.0,
            reconnect_failed=self._attempt_again,
            # Each new connection: the database answers (a request need not wait for a statement).
            configure=self._connected,
            # A database that does not answer (a network cut) costs an attempt this long, not
            # the operating system's TCP timeout.
            kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": CONNECT_TIMEOUT_SECS},
        )
        # Connections given back without an error: the API's sign that its database answers again
        # after an outage (relay.core.outage).
        self.answered = 0
        # When the database answered again after it could not be reached (time.monotonic()), if it
        # ever was: what ends a run of refusals that no request served saw end (relay.core.outage).
        self.recovered_at: float | None = None
        self._unreachable = False
        # Since when the database is known unreachable (time.monotonic()), None while it answers: a
        # connection failed or was lost, the pool gave up an attempt to connect, the lease could not
        # renew, the readiness probe had no answer. Not a pool merely busy: its wait proves nothing.
        self.down_since: float | None = None
        self.down_reason = ""
        self._checking: asyncio.Task[None] | None = None
        self._in_use = 0  # the pool's connections given out by connection() now
        self._rechecking: asyncio.Task[bool] | None = None
        self._rechecked = (0.0, False)  # when the latest look at a known unreachable database ended, and what it found
        self._reconnecting: asyncio.Task[None] | None = None  # the pool's next attempt to connect, waiting
        self._reconnect_due = 0.0  # when it begins (time.monotonic()), at the latest
        # The checks that the attempts began (each grows the pool), until they end: not one at a time
        # (one on a host gone silent waits as long as the keepalive, and the next attempt does not).
        self._attempts: set[asyncio.Task[None]] = set()
        # The idle connections that the checks under way took out of the pool, counted until each
        # check ends (it gives them back one by one as it checks them, so the pool may hold some of
        # them again before): _attempt_again looks at the pool itself once no check has any out.
        # The event is set when none is out.
        self._checked_out = 0
        self._checks_back = asyncio.Event()
        self._checks_back.set()
        self._grow_wait = RECONNECT_EVERY_SECS  # the wait before the next attempt of a pool that cannot grow
        self._capped_since: float | None = None  # since when the pool cannot grow, said in the log once
        self._answering = asyncio.Event()  # set when the database, known unreachable, answers: it begins now
        # The renewal of the pool's connections as the database, known unreachable, answers again
        # (:meth:`_renew`): set once it has begun, waited for before a connection is given out.
        self._renewal_begun: asyncio.Event | None = None
        self._renewals: set[asyncio.Task[None]] = set()
        # Fenced writes that arrive together share a transaction (relay.store.combiner).
        self.writes = WriteCombiner(self)

    async def open(self) -> None:
        try:
            await self.pool.open(wait=True, timeout=15.0)
        except (PoolTimeout, psycopg.Error) as exc:
            # The pool's timeout says only that it gave up; one connection of its own says why.
            reason = await self._why_not() if isinstance(exc, PoolTimeout) else None
            raise DatabaseError(f"cannot connect to PostgreSQL: {reason or exc}") from exc

    async def _why_not(self) -> str | None:
        """libpq's reason for not connecting now, or None if a connection can be made."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.conninfo, connect_timeout=5)
        except psycopg.Error as exc:
            return " ".join(str(exc).split())
        await conn.close()
        return None

    async def close(self) -> None:
        for task in (self._checking, self._rechecking, self._reconnecting, *self._attempts, *self._renewals):
            if task is not None and not task.done():
                task.cancel()  # the pool closes anyway
                await asyncio.gather(task, return_exceptions=True)
        await self.pool.close()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
        """A connection of the pool: waited for up to the pool's 10 s, or as long as
        :func:`patiently` says in the task that asks."""
        used: psycopg.AsyncConnection[dict[str, Any]] | None = None
        wait = _patience.get()
        await self.refuse_if_hasty()
        begun = self._renewal_begun
        if begun is not None and not begun.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(begun.wait(), RENEWAL_BEGINS_SECS)
        try:
            async with self.pool.connection(timeout=wait) as conn:
                used = conn
                self._in_use += 1
                try:
                    yield conn
                finally:
                    self._in_use -= 1
            self.answered += 1
            self.note_answered()
        except PoolTimeout as exc:
            self.note_unreachable(surely=False)  # the pool busy, or the database away: not known which
            raise DatabaseUnreachable(f"no database connection available: {exc}") from exc
        except psycopg.Error as exc:
            if used is not None and used.broken:
                self.note_unreachable(exc)
            elif isinstance(exc, psycopg.OperationalError):
                self.note_unreachable(surely=False)  # a statement cancelled, a lock not granted: it answered
            if used is not None and used.broken:
                # The server closed it (a failover, a restart): the pool's idle ones likely too,
                # each of which would fail the next statement given it. Checked now, all at once.
                self._check_idle()
                raise ConnectionLost(f"database error: {exc}") from exc
            raise DatabaseError(f"database error: {exc}") from exc

    async def refuse_if_hasty(self) -> None:
        """:class:`DatabaseUnreachable` at once if the current task is :func:`hastily`'s, not
        :func:`patiently`'s, and the database is known unreachable and does not answer now. For
        :meth:`connection`, and for a caller about to await another task's reads (a read shared
        between callers, in a task of its own): that task is not hasty, and waits the pool's 10 s."""
        down_since = self.down_since
        hasty = _hasty.get()
        if (
            _patience.get() is None
            and down_since is not None
            and hasty is not None
            and hasty is asyncio.current_task()
            and not await self._answers_now()
        ):
            secs = time.monotonic() - down_since
            raise DatabaseUnreachable(f"the database has been unreachable for {secs:.1f} s ({self.down_reason})")

    def note_unreachable(self, why: BaseException | str | None = None, *, surely: bool = True) -> None:
        """The database could not be reached (by the pool, the lease's own connection, the request
        channel, the readiness probe): :attr:`down_since`, unless not ``surely`` (a wait for the
        pool, a statement that failed: the pool may be merely busy)."""
        self._unreachable = True
        if surely:
            if self.down_since is None:
                self.down_since = time.monotonic()
            if why is not None:
                self.down_reason = " ".join(str(why).split()) or type(why).__name__

    def note_answered(self) -> None:
        """The database answered (the pool, or the lease's renewal every few seconds, which notices
        its return when no request comes): :attr:`recovered_at` if it could not be reached before."""
        if self.down_since is not None:
            # Known unreachable until now: the pool's next attempt to connect, if it waits, begins now.
            # (Not on every answer: a pool at PostgreSQL's connection limit, whose connections answer,
            # would try to grow at each one given back.)
            self._answering.set()
            self.down_since, self.down_reason = None, ""
            # The pool's connections date from before it: a restart or a failover closed them, and
            # through the outage no request took one to find out (refused at once). Each given to a
            # request would fail its statement though the database answers: renewed before the next
            # connection is given out.
            self._renewal_begun = begun = asyncio.Event()
            renewal = shared_task(self._renew(begun))
            self._renewals.add(renewal)
            renewal.add_done_callback(self._renewals.discard)
        if self._unreachable:
            self._unreachable, self.recovered_at = False, time.monotonic()

    async def _answers_now(self) -> bool:
        """Whether the database, known unreachable, answers now: one attempt at a time, and its answer
        reused for :data:`RECHECK_REUSE_SECS`. Not waited for by the pool's reconnection, which
        tries about once a second: a request is served as soon as the database is back."""
        at, answered = self._rechecked
        if time.monotonic() - at < RECHECK_REUSE_SECS:
            return answered
        if self._rechecking is None or self._rechecking.done():
            self._rechecking = shared_task(self._recheck())
        # Shielded: a request that goes away does not end the attempt the others wait for.
        return await asyncio.shield(self._rechecking)

    async def _recheck(self) -> bool:
        try:
            connecting = psycopg.AsyncConnection.connect(self.conninfo, connect_timeout=CONNECT_TIMEOUT_SECS)
            conn = await asyncio.wait_for(connecting, RECHECK_SECS)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            self.note_unreachable(exc)
            answered = False
        else:
            await conn.close()
            self.note_answered()
            answered = True
        self._rechecked = (time.monotonic(), answered)
        return answered

    async def _connected(self, _conn: psycopg.AsyncConnection[dict[str, Any]]) -> None:
        """The pool made a new connection: the database answers again, if it did not, and a pool that
        could not grow grows again."""
        self.note_answered()
        self._grow_wait = RECONNECT_EVERY_SECS
        if self._capped_since is not None:
            log.info("the pool grows again, after %.0f s at the database's connection limit",
                     time.monotonic() - self._capped_since)  # fmt: skip
            self._capped_since = None

    async def _attempt_again(self, pool: AsyncConnectionPool[Any]) -> None:
        """An attempt to connect gave up: the database is unreachable, unless the pool still has
        connections (in use or idle) and the database is not known away (:attr:`down_since`), which
        only says that no more could be opened (PostgreSQL at its max_connections or the role's limit
        while a burst grows the pool); another begins soon (:meth:`_reconnect_soon`):
        :data:`RECONNECT_EVERY_SECS` after the failure, or, while the pool cannot grow, after twice
        the last wait, up to :data:`GROW_AGAIN_MAX_SECS`."""
        # Known away (a connection of the pool found closed, the request channel's, the lease's, the
        # probe's): the connections still held are closed too, their requests yet to find out (a
        # restart, with a request between two statements), and this is an outage's attempt, not a
        # pool that cannot grow: no backoff, and no "cannot grow" line in the log.
        held, waited = self._holds(pool), 0.0
        if not held and self.down_since is None and self._checked_out:
            # A check has the idle connections out: the attempt it began (checks grow the pool) was
            # refused before they were given back, as on a loaded machine at the connection limit,
            # where its statements are slower than the refusal. Whether the pool holds connections is
            # seen when the check ends; on a host gone silent it does not end soon, and this is an
            # outage's attempt, the next one no later for the wait.
            began = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._checks_back.wait(), RECONNECT_EVERY_SECS)
            held, waited = self._holds(pool), time.monotonic() - began
        capped = held and self.down_since is None
        if capped:
            self.note_unreachable(surely=False)
            if self._capped_since is None:
                self._capped_since = time.monotonic()
                # The pool's own warnings do not say that it still serves (and are written once a
                # minute, relay.logs.QuietRepeats): this says it once, in the database's words, which
                # a connection of its own asks for.
                reason = await self._why_not() or "no connection refused as it asked again"
                log.warning("the pool cannot grow: %s; its %d connections serve the requests, and it tries "
                            "again at longer intervals, up to every %.0f s", reason,
                            pool.get_stats().get("pool_size", 0), GROW_AGAIN_MAX_SECS)  # fmt: skip
            wait = self._grow_wait
        else:
            self.note_unreachable(None if self.down_reason else "the pool could not connect to it")
            wait = max(0.0, RECONNECT_EVERY_SECS - waited)
        due = time.monotonic() + wait
        pending = self._reconnecting is not None and not self._reconnecting.done()
        if pending and self._reconnect_due <= due:
            return  # an attempt begins sooner anyway
        if self._reconnecting is not None and pending:
            self._reconnecting.cancel()  # a pool that could not grow, now unreachable: sooner than that
        if capped:
            self._grow_wait = min(wait * 2, GROW_AGAIN_MAX_SECS)
        self._answering.clear()  # a new answer is waited for: this attempt's failure is newer news
        self._reconnect_due = due
        self._reconnecting = shared_task(self._reconnect_soon(wait))

    def _holds(self, pool: AsyncConnectionPool[Any]) -> bool:
        """Whether the pool has connections that serve the requests (in use or idle)."""
        return bool(self._in_use or pool.get_stats().get("pool_available", 0))

    async def _reconnect_soon(self, wait: float) -> None:
        """The pool's next attempt to connect: ``wait`` seconds after the last gave up, or as soon as
        the database is seen answering (:meth:`note_answered`), whichever comes first. The attempt
        (check() grows the pool) runs in a task of its own: on a host gone silent a check waits for
        the idle connections it took as long as their keepalive, and an attempt that fails meanwhile
        schedules the next one here."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answering.wait(), wait)
        attempt = shared_task(self._check())
        self._attempts.add(attempt)
        attempt.add_done_callback(self._attempts.discard)

    async def _renew(self, begun: asyncio.Event) -> None:
        """The pool's connections replaced by new ones (psycopg_pool's ``drain()``): the idle ones
        closed, those in use closed as they are given back. Not checked one by one: after a
        failover the old host may be silent, and a check of one of its connections waits as long
        as the keepalive (some 30 s) while holding it, the pool unable to grow in its place. The
        drain takes the idle connections out under the pool's lock as it begins, before this task
        first yields, and a request that asks for one after ``begun`` queues behind it on that lock
        (asyncio's locks are fair): none is given one of them."""
        begun.set()
        try:
            await self.pool.drain()
        except Exception as exc:  # a pool closing meanwhile: nothing to renew
            log.debug("renewing the pool's connections failed: %s", exc)

    def _check_idle(self) -> None:
        """The pool's idle connections checked and the broken ones replaced, in a task of its own
        (one at a time). Not waited for: on a host gone without a word a check can take as long
        as the connections' keepalive; the check takes the idle connections out of the pool as it
        begins, so none of them is given to a request meanwhile (the pool opens others)."""
        if self._checking is None or self._checking.done():
            self._checking = shared_task(self._check())

    async def idle_checked(self, limit: float = 5.0) -> None:
        """Waits up to ``limit`` seconds for the check of the idle connections that a lost one began,
        if any: for a statement to try again on a working connection."""
        task = self._checking
        if task is not None and not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), limit)

    async def again_if_lost(self, run: Callable[[Landed[T]], Coroutine[Any, Any, T]]) -> T:
        """``run()``, and once more if the connection under it was lost (:class:`ConnectionLost`:
        PostgreSQL restarted, a failover; the pool's idle connections broken too, and checked first):
        the database that ended it likely answers on another. For the batches refused together when
        the database is not reached (the handshakes', the disconnections'): refused, each of their
        callers would wait for its own retry. The second run waits :data:`LOST_AGAIN_WAIT_SECS` at
        most for its connection (in an outage the batch is refused soon); its failure is the caller's.
        ``run`` must be safe to run twice (guarded statements), and keeps what it returns in its
        :class:`Landed` before its COMMIT: a first run whose COMMIT was made though its connection was
        lost under it (the reply lost) is not run again, its result is the batch's."""
        first: Landed[T] = Landed()
        try:
            return await run(first)
        except ConnectionLost:
            await self.idle_checked()
            if first.xact is not None and await patiently(self._committed(first.xact), LOST_AGAIN_WAIT_SECS):
                return first.value  # type: ignore[return-value]  # kept with its xact: a T
            return await patiently(run(Landed()), LOST_AGAIN_WAIT_SECS)

    async def _committed(self, xact: str) -> bool:
        """Whether transaction ``xact`` committed; one still in progress (its server process ending)
        is asked again for a second at most, then taken as not committed (run again, the batch's
        guarded statements wait for its locks). One this server never saw (a failover to a replica
        the commit had not reached: "in the future") is not committed either."""
        for _ in range(IN_DOUBT_POLLS):
            try:
                async with self.connection() as conn:
                    cur = await conn.execute("SELECT txid_status(%s::bigint) AS status", (xact,))
                    row = await cur.fetchone()
            except DatabaseUnreachable:
                raise
            except DatabaseError:
                return False
            status = None if row is None else row["status"]
            if status != "in progress":
                return status == "committed"
            await asyncio.sleep(IN_DOUBT_POLL_SECS)
        return False

    async def _check(self) -> None:
        # What check() takes out of the pool as it begins, under the pool's lock, before this task
        # first yields (the lock is seldom held, and briefly: then a few more or less, as it finds).
        taken = int(self.pool.get_stats().get("pool_available", 0))
        self._checked_out += taken
        if self._checked_out:
            self._checks_back.clear()
        try:
            await self.pool.check()
        except Exception as exc:  # a pool closing meanwhile: nothing to check
            log.debug("checking the pool's idle connections failed: %s", exc)
        finally:
            self._checked_out -= taken
            if not self._checked_out:
                self._checks_back.set()

    @asynccontextmanager
    async def transaction(
        self, within: psycopg.AsyncConnection[dict[str, Any]] | None = None
    ) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
        """A plain transaction, for writes that belong to no instance (operator actions, settings).
        ``within``: the caller's transaction, which this one joins (a savepoint of it): what it locks
        is held, and what it writes committed, with the caller's."""
        if within is not None:
            async with within.transaction():
                yield within
            return
        async with self.connection() as conn, conn.transaction():
            yield conn

    @asynccontextmanager
    async def fenced(self) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
        """A transaction that commits only while this instance holds its lease.

        It first locks this instance's lease row ``FOR KEY SHARE``, checking the
        epoch and the expiry: an instance that was paused past its lease, or
        whose lease another instance adopted, gets :class:`Fenced` and writes
        nothing. The lock makes the check hold until the commit: whatever gives
        the lease a new epoch (an adoption, a start with this instance's id) first
        locks the row ``FOR UPDATE``, so it waits for this transaction, then finds
        the lease renewed or still expired as the case may be. A renewal (a plain
        UPDATE of the expiry) does not wait: the weakest lock that still stops an
        adoption, so that a busy instance's own writes never hold up its lease.
        """
        if self.fence is None:
            raise Fenced("this instance holds no lease yet")
        instance, epoch = self.fence
        async with self.connection() as conn, conn.transaction():
            cur = await conn.execute(
                """SELECT lease_epoch, lease_expires_at > now() AS live FROM relay_instances
                   WHERE instance_id = %s FOR KEY SHARE""",
                (instance,),
            )
            row = await cur.fetchone()
            if row is None or row["lease_epoch"] != epoch:
                raise Fenced(f"instance {instance}: lease epoch {epoch} was taken over")
            if not row["live"]:
                raise Fenced(f"instance {instance}: lease epoch {epoch} has expired")
            yield conn

    async def migrate(self) -> list[int]:
        """Apply the migrations not yet recorded; returns the versions applied.

        A database that holds migrations this release does not know (a newer release migrated it)
        is checked against its compatibility floor (:mod:`relay.store.migrations`): below it, this
        raises :class:`StartupError` having changed nothing; at or above it, a warning is logged."""
        for attempt in range(1, INDEX_BUILD_ATTEMPTS + 1):
            try:
                async with self._migration_lock() as conn:
                    return await self._migrate(conn)
            except psycopg.errors.DeadlockDetected as exc:
                # An instance of an earlier release waits for the lock inside a transaction, which
                # the index build waits for in turn: PostgreSQL cancelled the build. The lock is let
                # go (the connection closed) for that instance to see its migrations done, then
                # taken again; the index left invalid is built again.
                if attempt == INDEX_BUILD_ATTEMPTS:
                    raise DatabaseError(f"migrating the database: {exc}") from exc
                log.warning("an index build was cancelled to break a deadlock with another instance waiting "
                            "for the migrations' lock; letting the lock go, then building it again")  # fmt: skip
                await asyncio.sleep(MIGRATION_POLL_SECS)
            except psycopg.Error as exc:
                raise DatabaseError(f"migrating the database: {exc}") from exc
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def _migration_lock(self) -> AsyncIterator[psycopg.AsyncConnection[dict[str, Any]]]:
        """A connection of its own (not the pool's), holding the migrations' advisory lock for its
        session: closing it lets the lock go, whatever happened. The lock is polled for, not waited
        on in a statement: a statement waiting on it would hold a snapshot that another instance's
        ``CREATE INDEX CONCURRENTLY`` waits for in turn (a deadlock). An operator's statement or
        lock timeout does not apply to it: an index on a large table takes what it takes."""
        conn = await psycopg.AsyncConnection.connect(
            self.conninfo, autocommit=True, row_factory=dict_row, connect_timeout=CONNECT_TIMEOUT_SECS
        )
        try:
            await conn.execute("SET statement_timeout = 0")
            await conn.execute("SET lock_timeout = 0")
            waited_since = time.monotonic()
            said = False
            while True:
                cur = await conn.execute("SELECT pg_try_advisory_lock(%s) AS got", (MIGRATION_LOCK_KEY,))
                row = await cur.fetchone()
                if row is not None and row["got"]:
                    break
                if not said and time.monotonic() - waited_since > MIGRATION_WAIT_NOTICE_SECS:
                    said = True
                    log.info("waiting for another instance of Relay to finish migrating the database")
                await asyncio.sleep(MIGRATION_POLL_SECS)
            yield conn
        finally:
            await conn.close()

    async def _migrate(self, conn: psycopg.AsyncConnection[dict[str, Any]]) -> list[int]:
        newest = MIGRATIONS[-1].version
        await conn.execute(
            """CREATE TABLE IF NOT EXISTS relay_schema_migrations (
                   version     integer PRIMARY KEY,
                   applied_at  timestamptz NOT NULL DEFAULT now())"""
        )
        cur = await conn.execute("SELECT version FROM relay_schema_migrations")
        done = {int(row["version"]) for row in await cur.fetchall()}
        unknown = done - {migration.version for migration in MIGRATIONS}
        if unknown:
            await self._check_floor(conn, max(unknown), newest)
        applied: list[Migration] = []
        for batch in _batches([m for m in MIGRATIONS if m.version not in done]):
            if batch[0].indexes:
                for index in batch[0].indexes:
                    await _build_index(conn, index)
            async with conn.transaction():
                for migration in batch:
                    if migration.sql:
                        await conn.execute(migration.sql)
                    await conn.execute(
                        "INSERT INTO relay_schema_migrations (version) VALUES (%s)", (migration.version,)
                    )
                raised = max((m.version for m in batch if m.breaks_older), default=None)
                if raised is not None:
                    await conn.execute(
                        "UPDATE relay_schema_floor SET version = greatest(version, %s) WHERE id = 1", (raised,)
                    )
            applied.extend(batch)
        if applied:
            log.info("database migrated to version %d", applied[-1].version)
        return [migration.version for migration in applied]

    @staticmethod
    async def _check_floor(conn: psycopg.AsyncConnection[dict[str, Any]], schema: int, newest: int) -> None:
        """The database's schema is at ``schema``, past this release's ``newest``: refuse to start
        if its floor is above ``newest``, else warn that this release runs on a newer schema."""
        floor: int | None = None
        cur = await conn.execute("SELECT to_regclass('relay_schema_floor') IS NOT NULL AS kept")
        kept = await cur.fetchone()
        if kept is not None and kept["kept"]:
            cur = await conn.execute("SELECT version FROM relay_schema_floor WHERE id = 1")
            row = await cur.fetchone()
            floor = None if row is None else int(row["version"])
        if floor is not None and newest < floor:
            raise StartupError(
                f"the database's schema is at version {schema}, migrated by a newer release of Relay, and "
                f"needs a release that knows schema version {floor} or later (its compatibility floor); "
                f"this Relay ({__version__}) knows versions up to {newest} and does not start on it: "
                "upgrade Relay (to the release that migrated the database, or a later one)"
            )
        log.warning(
            "the database's schema is at version %d, migrated by a newer release of Relay; this Relay (%s) "
            "knows versions up to %d and runs on it, as the database's compatibility floor (%s) allows",
            schema,
            __version__,
            newest,
            "none recorded" if floor is None else floor,
        )
