"""The executor store: the only module that writes the ``executors`` table.

Every write is an event of the lifecycle table (:mod:`relay.core.lifecycle`),
and its guard comes from that table: the states the event is allowed from
(or, where the caller knows it, the one state it expects, checked against the
table before any SQL), the connection's epoch and the owning instance where
the caller knows them. A guarded write that matches no row is a lost race and
returns False; timestamps come from the database. Writes bound to what this
instance owns run in a fenced transaction (:meth:`Database.fenced`), or in the
caller's, so that a recovery step changes the executor, the recovery row and
the audit log together.

Each event is counted (applied, or lost to a race) for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.types.json import Jsonb

from relay.core.ids import ExecutorKey, grace_id
from relay.core.lifecycle import ExecutorEvent, ExecutorState, check_transition, states_allowing, targets
from relay.core.peers import Peer
from relay.core.requestid import shared_task
from relay.errors import ConnectionLost, DatabaseError, DatabaseUnreachable, Fenced, RelayError
from relay.store.apps import AppStore
from relay.store.audit import AuditEntry
from relay.store.combiner import Write
from relay.store.db import Database, Landed, deadlocked
from relay_protocol import ExecutorInfoReply
from relay_protocol.limits import has_unstorable

E = ExecutorEvent
T = TypeVar("T")
log = logging.getLogger("relay.store")

# Runs of the statement that records an instance's executors lost, when PostgreSQL fails it to break
# a deadlock (each failure waits out deadlock_timeout, 1 s by default, first).
INSTANCE_LOST_TRIES = 5
Conn = psycopg.AsyncConnection[dict[str, Any]]


@dataclass(frozen=True)
class ExecutorRecord:
    key: ExecutorKey
    state: ExecutorState
    epoch: int
    application_version: str
    hostname: str | None
    language: str | None
    dbos_version: str | None
    metadata: dict[str, Any] | None
    connected_at: datetime
    disconnected_at: datetime | None
    dead_at: datetime | None
    relay_instance: str
    blocked_reason: str | None
    first_seen_at: datetime | None = None  # when Relay first saw this executor id

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ExecutorRecord:
        return cls(
            key=ExecutorKey(row["org"], row["app"], row["executor_id"]),
            state=ExecutorState(row["state"]),
            epoch=row["epoch"],
            application_version=row["application_version"],
            hostname=row["hostname"],
            language=row["language"],
            dbos_version=row["dbos_version"],
            metadata=row["metadata"],
            connected_at=row["connected_at"],
            disconnected_at=row["disconnected_at"],
            dead_at=row["dead_at"],
            relay_instance=row["relay_instance"],
            blocked_reason=row["blocked_reason"],
            first_seen_at=row.get("first_seen_at"),
        )


@dataclass(frozen=True)
class Unfinished:
    """An executor that is not HEALTHY, as the repair sweep sees it."""

    key: ExecutorKey
    state: ExecutorState
    epoch: int
    # Its disconnection is older than the app's grace period (the app's value now).
    grace_over: bool
    # Seconds since its disconnection, by the database's clock (None: no disconnection recorded).
    disconnected_secs: float | None = None


# What an event sets besides the state (the state itself comes from the table).
_EFFECTS: dict[ExecutorEvent, str] = {
    E.LOST: ", disconnected_at = now()",
    E.INSTANCE_LOST: ", disconnected_at = now()",
    E.GRACE_EXPIRED: ", dead_at = now()",
    E.DECLARED_DEAD: ", dead_at = now()",
    E.BLOCKED: ", blocked_reason = %(reason)s",
    E.RECOVERY_SENT: ", blocked_reason = NULL",
}
# The order in which a transaction that writes several executors' rows locks them: by key, code point
# by code point (COLLATE "C"), as ExecutorKey compares (a batch of handshakes, the combined writes).
_LOCK_ORDER = 'org COLLATE "C", app COLLATE "C", executor_id COLLATE "C"'


async def lock_ids(conn: Conn, keys: list[ExecutorKey]) -> None:
    """Lock the remembered ids of these executors (``keys``: distinct, in key order) as the writes that
    update them would (``FOR NO KEY UPDATE``), in key order (_LOCK_ORDER), before any of their records:
    what a combined transaction of several executors' writes does first (the locker of
    :meth:`ExecutorStore.combined`), as a batch of handshakes writes every id of its batch, then every
    record. A write that deletes a record (a recovery verified) updates its id's row before the record:
    run after another executor's write, it held that executor's record while it waited for an id row
    such a batch held, waiting for that record (a deadlock)."""
    # A key PostgreSQL cannot store has no id to lock: its write fails alone, as any bad row. One
    # executor's writes lock its id themselves, before its record.
    storable = [k for k in keys if not any(has_unstorable(part) for part in (k.org, k.app, k.executor_id))]
    if len(storable) < 2:
        return
    await conn.execute(
        f"""SELECT 1 FROM executor_ids WHERE (org, app, executor_id) IN (
                SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]))
            ORDER BY {_LOCK_ORDER} FOR NO KEY UPDATE""",
        ([k.org for k in storable], [k.app for k in storable], [k.executor_id for k in storable]),
    )


_SEEN = "UPDATE executor_ids SET last_seen_at = now() WHERE org = %(org)s AND app = %(app)s AND executor_id = %(id)s"
# Events with a statement of their own: a batched upsert, and a move of every row of an instance.
_OWN_STATEMENT = (E.CONNECTED, E.ADOPTED, E.STRANDED)

# The remembered id's first sighting, looked up by its primary key for each row read. (A join here
# let the planner, on tables not analyzed yet (a new database whose fleet has just connected), read
# the app's every remembered id once per executor: 2,000 executors cost 2 million row visits and
# 0.4 s per page.)
_WITH_FIRST_SEEN = """e.*, (SELECT i.first_seen_at FROM executor_ids i
    WHERE i.org = e.org AND i.app = e.app AND i.executor_id = e.executor_id) AS first_seen_at
    FROM executors e"""

# A page of an app's executors (optionally of one state) in order of id.
LIST_PAGE = f"""SELECT {_WITH_FIRST_SEEN} WHERE e.org = %s AND e.app = %s
    AND (%s::text IS NULL OR e.state = %s) ORDER BY e.executor_id LIMIT %s OFFSET %s"""

CONNECT_BATCH = 500


@dataclass(frozen=True)
class Handshake:
    """A completed ``executor_info`` handshake to record."""

    key: ExecutorKey
    info: ExecutorInfoReply
    instance: str
    key_id: str  # the permanent id of the key the executor presented
    # Register the app with default settings if it is missing (autoRegisterApps), in the transaction
    # that writes the executor's row; else a missing app refuses the handshake (AppGone).
    register_app: bool = False
    client: str = "unknown"  # the executor's address (host:port), named in the audit of an app it registers


@dataclass(frozen=True)
class Connected:
    """The record of a handshake: the connection's epoch, and what the row held before, if anything."""

    epoch: int
    previous_epoch: int | None
    previous_state: ExecutorState | None
    previous_instance: str | None


class IdentityTaken(RelayError):
    """The executor id was first registered under another key: this key may not present it."""


class AppGone(RelayError):
    """The executor's app is not registered (deleted since the handshake began), and apps are not
    registered by their executors' connections."""


_PendingConnect = tuple[Handshake, "asyncio.Future[Connected]"]
# A disconnection to record: the executor, its epoch, the instance that held its socket.
_Lost = tuple[ExecutorKey, int, str]
_PendingLost = tuple[_Lost, "asyncio.Future[bool]"]


class _Registrations:
    """The apps a batch of handshakes registers (:meth:`AppStore.hold`), of those it finds missing:
    each with a handshake the batch accepts, audited as that executor's doing (the first of them in
    key order: ``executor:<id>@<host:port>``, ``executorId`` its id). A handshake whose id is bound
    to another key (an earlier app of that name) is refused (:class:`IdentityTaken`): it neither
    registers the app nor names it; an app whose handshakes are all refused so is not registered
    (``refused``: refused as IdentityTaken, not as AppGone)."""

    def __init__(self, rows: list[Handshake]) -> None:
        self.rows = [h for h in rows if h.register_app]
        self.refused: set[tuple[str, str]] = set()

    async def __call__(self, conn: Conn, missing: list[tuple[str, str]]) -> dict[tuple[str, str], AuditEntry]:
        wanted = set(missing)
        rows = [h for h in self.rows if (h.key.org, h.key.app) in wanted]
        cur = await conn.execute(
            """SELECT i.org, i.app, i.executor_id FROM executor_ids i
               JOIN unnest(%s::text[], %s::text[], %s::text[], %s::text[]) AS h(org, app, id, key_id)
               ON i.org = h.org AND i.app = h.app AND i.executor_id = h.id WHERE i.key_id <> h.key_id""",
            ([h.key.org for h in rows], [h.key.app for h in rows], [h.key.executor_id for h in rows],
             [h.key_id for h in rows]),
        )  # fmt: skip
        taken = {(r["org"], r["app"], r["executor_id"]) for r in await cur.fetchall()}
        entries: dict[tuple[str, str], AuditEntry] = {}
        for h in sorted(rows, key=lambda h: (h.key.org, h.key.app, h.key.executor_id)):
            app = (h.key.org, h.key.app)
            if app not in entries and (h.key.org, h.key.app, h.key.executor_id) not in taken:
                detail = {"result": "success", "executorId": h.key.executor_id, "address": h.client}
                actor = f"executor:{h.key.executor_id}@{h.client}"
                entries[app] = AuditEntry("application.create", actor, h.key.executor_id, detail=detail)
        self.refused = {(h.key.org, h.key.app) for h in rows} - set(entries)
        return entries


def _database_error(exc: Exception, what: str = "a connection") -> DatabaseError:
    return exc if isinstance(exc, DatabaseError) else DatabaseError(f"cannot record {what}: {exc}")


def _settle_one(future: asyncio.Future[bool], outcome: bool | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _fail(batch: list[_PendingConnect] | list[_PendingLost], exc: BaseException) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)


def _state_case(event: ExecutorEvent, column: str = "state") -> str:
    """``CASE state WHEN ... END``: the state after ``event``, from the table, for each state before."""
    whens = " ".join(f"WHEN '{before.value}' THEN '{after.value}'" for before, after in targets(event).items() if after)
    return f"CASE {column} {whens} END"


class HealthyRead:
    """One read of an app's HEALTHY executors, shared by the callers that accept it (rows: id,
    version, language, instance); its :attr:`peers` are built once, for all of them."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    @functools.cached_property
    def peers(self) -> tuple[Peer, ...]:
        return tuple(Peer(r["executor_id"], r["application_version"], r["language"]) for r in self.rows)


class ExecutorStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        # (event, "applied" | "lost_race") -> rows, for /metrics
        self.events: Counter[tuple[str, str]] = Counter()
        self._connect_queue: list[_PendingConnect] = []
        # (org, app) -> (when the read began, the read): healthy_peers' shared reads.
        self._peer_reads: dict[tuple[str, str], tuple[float, asyncio.Task[HealthyRead]]] = {}
        self._connect_writer: asyncio.Task[None] | None = None
        self._lost_queue: list[_PendingLost] = []
        self._lost_writer: asyncio.Task[None] | None = None
        self.lost_batches = 0  # for the tests: statements that recorded disconnections together

    async def settled(self, timeout: float) -> None:
        """Wait, at most ``timeout`` seconds, until the batched connections and disconnections being
        written now are written (a stop's first step, as :meth:`relay.store.combiner.WriteCombiner.settled`:
        they do not go through the combiner, and lock the rows a stop's :meth:`instance_lost` is about to)."""
        running = [t for t in (self._lost_writer, self._connect_writer) if t is not None and not t.done()]
        if running:
            await asyncio.wait(running, timeout=timeout)

    async def combined(self, write: Write[T], key: ExecutorKey) -> T:
        """``write``, which locks ``key``'s rows (its record, its id, its recoveries), run by the
        combiner (:mod:`relay.store.combiner`): in a transaction shared with the writes queued with it,
        in key order, several executors' ids locked first (:func:`lock_ids`)."""
        return await self.db.writes.run(write, locks=key, lock_keys=lock_ids)

    def _count(self, event: ExecutorEvent, applied: int, attempted: int = 1) -> None:
        if applied:
            self.events[(event.value, "applied")] += applied
        if attempted > applied:
            self.events[(event.value, "lost_race")] += attempted - applied

    # -- writes: every one an event of the lifecycle table ----------------------------

    async def apply(
        self,
        key: ExecutorKey,
        event: ExecutorEvent,
        *,
        epoch: int | None = None,
        instance: str | None = None,
        expected: ExecutorState | None = None,
        reason: str | None = None,
        conn: Conn | None = None,
    ) -> bool:
        """Apply ``event`` to one executor if its row is still where the table allows it.

        ``expected``, when the caller knows the state, narrows the guard to it
        and is checked against the table first (:class:`IllegalTransition`).
        ``epoch`` and ``instance``, when given, must match too. Returns whether
        the row changed (or was deleted, for RECOVERED).
        """
        if event in _OWN_STATEMENT:
            raise ValueError(f"{event.value} is written by its own method")
        if expected is not None:
            check_transition(expected, event)
            sources = [expected]
        else:
            sources = states_allowing(event)
        guard = (
            "WHERE org = %(org)s AND app = %(app)s AND executor_id = %(id)s AND state = ANY(%(sources)s) "
            "AND (%(epoch)s::bigint IS NULL OR epoch = %(epoch)s) "
            "AND (%(instance)s::text IS NULL OR relay_instance = %(instance)s)"
        )
        deletes = check_transition(sources[0], event) is None
        if deletes:
            query = f"DELETE FROM executors {guard}"
        else:
            query = f"UPDATE executors SET state = {_state_case(event)}{_EFFECTS.get(event, '')} {guard}"
        params = {
            "org": key.org,
            "app": key.app,
            "id": key.executor_id,
            "sources": [s.value for s in sources],
            "epoch": epoch,
            "instance": instance,
            "reason": reason,
        }

        async def write(c: Conn) -> bool:
            if deletes:
                # The record goes: its id is seen now, whenever it last connected. Retention forgets an
                # id executorIdsDays after that (one presented only at a connection 40 days old was
                # forgotten as soon as its record went, and the work its recovery left behind with it).
                # Before the record, as a handshake locks them: the other order could deadlock with one.
                await c.execute(_SEEN, params)
            cur = await c.execute(query, params)
            return cur.rowcount == 1

        changed = await (write(conn) if conn is not None else self.combined(write, key))
        self._count(event, int(changed))
        return changed

    async def lost(self, key: ExecutorKey, epoch: int, instance: str) -> bool:
        """LOST: the socket that ``instance`` held for ``key`` at ``epoch`` closed. Returns whether
        the row changed (it is still that epoch's, HEALTHY, held by ``instance``).

        Disconnections that arrive while a write of them is in flight are written together, in one
        statement: 5,000 sockets closing at once cost a few round trips, not 5,000. The guard is
        each row's own (state, epoch, instance), and the transaction is fenced: a stale instance's
        batch changes nothing and each of its callers gets :class:`Fenced`; one that did not reach the
        database (:class:`DatabaseUnreachable`) is refused together, at one wait for the pool (one whose
        connection the server ended is written once more on another first: :meth:`Database.again_if_lost`). A batch
        that fails otherwise is written again row by row (:meth:`apply`, combined), so that one bad row
        never refuses another.
        """
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._lost_queue.append(((key, epoch, instance), future))
        if self._lost_writer is None or self._lost_writer.done():
            self._lost_writer = shared_task(self._write_losts())
        return await future

    async def _write_losts(self) -> None:
        while self._lost_queue:
            batch, self._lost_queue = self._lost_queue[:CONNECT_BATCH], self._lost_queue[CONNECT_BATCH:]
            try:
                # Once more on another connection if the server ended this one (PostgreSQL restarted and
                # back): refused, each row would wait for the socket check (pingIntervalSecs).
                rows = [lost for lost, _ in batch]
                changed = await self.db.again_if_lost(functools.partial(self._update_lost, rows))
            except Fenced as exc:
                _fail(batch, exc)
                continue
            except Exception as exc:
                if len(batch) == 1 or isinstance(exc, DatabaseUnreachable):
                    # The database not reached: each row on its own would wait for the pool in turn, as
                    # a batch of handshakes would. Each caller keeps its row HEALTHY for its socket check.
                    _fail(batch, _database_error(exc, "a disconnection"))
                    continue
                alone = await asyncio.gather(
                    *(self.apply(key, E.LOST, epoch=epoch, instance=instance) for (key, epoch, instance), _ in batch),
                    return_exceptions=True,
                )
                for (_, future), outcome in zip(batch, alone, strict=True):
                    _settle_one(future, outcome)
                continue
            self.lost_batches += 1
            self._count(E.LOST, len(changed), len(batch))
            for (key, epoch, _), future in batch:
                _settle_one(future, (key, epoch) in changed)

    async def _update_lost(
        self, rows: list[_Lost], landed: Landed[set[tuple[ExecutorKey, int]]] | None = None
    ) -> set[tuple[ExecutorKey, int]]:
        async with self.db.fenced() as conn:
            # Rows locked in key order (_LOCK_ORDER), as a batch of handshakes and an adoption lock
            # them: in the join's order, executors disconnecting and connecting again at once (a network
            # blip) could each hold a row the other's batch waited for, and PostgreSQL failed one batch.
            cur = await conn.execute(
                f"""WITH mine AS (
                        SELECT org, app, executor_id FROM executors
                        WHERE (org, app, executor_id, epoch, relay_instance) IN (
                                SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::bigint[], %s::text[]))
                          AND state = ANY(%s)
                        ORDER BY {_LOCK_ORDER} FOR UPDATE)
                    UPDATE executors e SET state = {_state_case(E.LOST, "e.state")}{_EFFECTS[E.LOST]}
                    FROM mine m WHERE e.org = m.org AND e.app = m.app AND e.executor_id = m.executor_id
                    RETURNING e.org, e.app, e.executor_id, e.epoch, txid_current()::text AS xact""",
                (
                    [key.org for key, _, _ in rows],
                    [key.app for key, _, _ in rows],
                    [key.executor_id for key, _, _ in rows],
                    [epoch for _, epoch, _ in rows],
                    [instance for _, _, instance in rows],
                    [s.value for s in states_allowing(E.LOST)],
                ),
            )
            found = await cur.fetchall()
            changed = {(ExecutorKey(r["org"], r["app"], r["executor_id"]), int(r["epoch"])) for r in found}
            if landed is not None and found:  # (again_if_lost: this, if the COMMIT is made but its reply lost)
                landed.keep(str(found[0]["xact"]), changed)
        return changed

    async def instance_lost(self, instance: str) -> int:
        """INSTANCE_LOST for every executor this instance held (start-up, shutdown).

        After a crash the sockets are gone but their rows still say HEALTHY.

        The rows are locked in key order (_LOCK_ORDER), as the batches of handshakes and of
        disconnections lock them: executors connecting again to another instance while this one
        stops wait for this statement, or it for them, without a deadlock; so do the combined
        writes (:mod:`relay.store.combiner`), which run in key order too. A deadlock with writes
        that lock in another order (another session's) makes PostgreSQL fail one of the two
        transactions; this one then runs again.
        """
        for attempt in range(1, INSTANCE_LOST_TRIES + 1):
            try:
                async with self.db.fenced() as conn:
                    cur = await conn.execute(  # in key order, as handshakes lock them (_LOCK_ORDER)
                        f"""WITH held AS (
                                SELECT org, app, executor_id FROM executors
                                WHERE relay_instance = %s AND state = ANY(%s) ORDER BY {_LOCK_ORDER} FOR UPDATE)
                            UPDATE executors e
                            SET state = {_state_case(E.INSTANCE_LOST, "e.state")}{_EFFECTS[E.INSTANCE_LOST]}
                            FROM held h WHERE e.org = h.org AND e.app = h.app AND e.executor_id = h.executor_id""",
                        (instance, [s.value for s in states_allowing(E.INSTANCE_LOST)]),
                    )
                break
            except DatabaseError as exc:
                # Idempotent, so run again after a deadlock, and after a connection the server had
                # closed (a failover or a restart of PostgreSQL while this instance ran).
                if attempt == INSTANCE_LOST_TRIES or not (deadlocked(exc) or isinstance(exc, ConnectionLost)):
                    raise
                why = "a deadlock" if deadlocked(exc) else "a lost connection"
                if isinstance(exc, ConnectionLost):
                    await self.db.idle_checked()  # the pool's other idle connections are likely lost too
                log.info("instance %s: recording its executors' disconnection met %s; again (%d)",
                         instance, why, attempt)  # fmt: skip
        self._count(E.INSTANCE_LOST, cur.rowcount, cur.rowcount)
        return cur.rowcount

    async def adopted(self, conn: Conn, dead_instance: str, adopter: str) -> tuple[int, dict[str, int]]:
        """ADOPTED for every executor of ``dead_instance``, in the caller's adoption transaction.

        Those still HEALTHY (their sockets died with the instance) become
        DISCONNECTED; all of them name the adopter, which now runs their timers.
        Returns how many became DISCONNECTED, and the executors moved per org.
        """
        cur = await conn.execute(
            f"""WITH before AS (
                    SELECT org, app, executor_id, state FROM executors
                    WHERE relay_instance = %(dead)s AND state = ANY(%(sources)s) ORDER BY {_LOCK_ORDER} FOR UPDATE),
                moved AS (
                    UPDATE executors e SET state = {_state_case(E.ADOPTED, "e.state")},
                        relay_instance = %(adopter)s,
                        disconnected_at = CASE WHEN e.state = 'HEALTHY' THEN now() ELSE e.disconnected_at END
                    FROM before b WHERE e.org = b.org AND e.app = b.app AND e.executor_id = b.executor_id
                    RETURNING e.org, b.state AS was)
                SELECT org, count(*) AS n, count(*) FILTER (WHERE was = 'HEALTHY') AS dropped
                FROM moved GROUP BY org""",
            {"adopter": adopter, "dead": dead_instance, "sources": [s.value for s in states_allowing(E.ADOPTED)]},
        )
        rows = await cur.fetchall()
        per_org = {str(r["org"]): int(r["n"]) for r in rows}
        self._count(E.ADOPTED, sum(per_org.values()), sum(per_org.values()))
        return sum(int(r["dropped"]) for r in rows), per_org

    async def connected(self, handshake: Handshake) -> Connected:
        """CONNECTED: record a completed handshake.

        A new executor id gets a new record; a known one returns to HEALTHY in
        the same record with a new epoch (from a sequence: epochs never repeat),
        so that the old connection's late close (same id, older epoch) cannot
        mark it DISCONNECTED. An executor id belongs to the key that first
        presented it: another key gets :class:`IdentityTaken`.

        Handshakes that arrive while a write is in flight are written together:
        a thousand executors reconnecting at once cost a few round trips, not a
        thousand. A batch that fails is written again row by row, so that one
        bad row never refuses another; one that does not reach the database is
        refused together (its executors try again), unless the server ended the
        connection under it (PostgreSQL restarted and back): it is written once
        more on another first (:meth:`Database.again_if_lost`).
        """
        future: asyncio.Future[Connected] = asyncio.get_running_loop().create_future()
        self._connect_queue.append((handshake, future))
        if self._connect_writer is None or self._connect_writer.done():
            self._connect_writer = shared_task(self._write_connects())
        return await future

    async def _write_connects(self) -> None:
        while self._connect_queue:
            batch: list[_PendingConnect] = []
            later: list[_PendingConnect] = []
            seen: set[ExecutorKey] = set()
            for item in self._connect_queue[:CONNECT_BATCH]:
                # One statement may not touch a row twice: the same id twice waits a round.
                (later if item[0].key in seen else batch).append(item)
                seen.add(item[0].key)
            self._connect_queue = later + self._connect_queue[CONNECT_BATCH:]
            try:
                # Once more on another connection if the server ended this one (PostgreSQL restarted and
                # back): refused, every executor of the batch would connect again a second later.
                handshakes = [h for h, _ in batch]
                results, gone = await self.db.again_if_lost(functools.partial(self._upsert_connected, handshakes))
            except Fenced as exc:
                _fail(batch, exc)
                continue
            except Exception as exc:
                if len(batch) == 1 or isinstance(exc, DatabaseUnreachable):
                    # The database not reached: each row on its own would wait the pool's 10 s in turn
                    # (a fleet reconnecting during an outage refused one handshake every 10 s).
                    _fail(batch, _database_error(exc))
                else:  # one bad row must not refuse the others: each on its own
                    for item in batch:
                        await self._write_one(item)
                continue
            self._settle(batch, results, gone)

    async def _write_one(self, item: _PendingConnect) -> None:
        try:
            results, gone = await self._upsert_connected([item[0]])
        except Exception as exc:
            _fail([item], _database_error(exc))
            return
        self._settle([item], results, gone)

    def _settle(
        self, batch: list[_PendingConnect], results: dict[ExecutorKey, Connected], gone: set[tuple[str, str]]
    ) -> None:
        self._count(E.CONNECTED, len(results), len(batch))
        for handshake, future in batch:
            if future.done():
                continue
            result = results.get(handshake.key)
            if result is None and (handshake.key.org, handshake.key.app) in gone:
                future.set_exception(AppGone(f"no app {handshake.key.app!r} in org {handshake.key.org!r}"))
            elif result is None:
                future.set_exception(IdentityTaken(f"executor id {handshake.key.executor_id!r} belongs to another key"))
            else:
                future.set_result(result)

    async def _upsert_connected(
        self,
        rows: list[Handshake],
        landed: Landed[tuple[dict[ExecutorKey, Connected], set[tuple[str, str]]]] | None = None,
    ) -> tuple[dict[ExecutorKey, Connected], set[tuple[str, str]]]:
        """The batch's records, and the apps (org, name) that are gone: their executors' rows are not
        written."""
        allowed = [s.value for s in states_allowing(E.CONNECTED)]
        # Rows locked in key order, as an adoption locks them (_LOCK_ORDER): in the order the handshakes
        # came, a batch of executors connecting again and the adoption of the instance they were connected
        # to each held a row the other waited for, and PostgreSQL failed one of them.
        rows = sorted(rows, key=lambda h: (h.key.org, h.key.app, h.key.executor_id))
        columns: list[list[Any]] = [[] for _ in range(10)]
        for h in rows:
            info = h.info
            values = (
                h.key.org,
                h.key.app,
                h.key.executor_id,
                info.application_version,
                info.hostname,
                info.language,
                info.dbos_version,
                Jsonb(info.executor_metadata) if info.executor_metadata is not None else None,
                h.instance,
                h.key_id,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
        async with self.db.fenced() as conn:
            # The apps first, held until the rows are written: an app deleted meanwhile is registered
            # again (as an unknown app's first connection registers it) or refuses its executors; its
            # deletion, if it comes after, waits for this commit and finds the executors (409).
            apps = [(h.key.org, h.key.app) for h in rows]
            registrations = _Registrations(rows)
            held = await AppStore.hold(conn, apps, registrations)
            gone = set(apps) - held - registrations.refused
            rows = [h for h in rows if (h.key.org, h.key.app) in held]
            columns = [[v for v, a in zip(column, apps, strict=True) if a in held] for column in columns]
            if not rows:
                return {}, gone
            ids = (columns[0], columns[1], columns[2], columns[9])
            # The ids this batch's keys may present: new ones are bound to their key here.
            cur = await conn.execute(
                """INSERT INTO executor_ids AS i (org, app, executor_id, key_id)
                   SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[])
                   ON CONFLICT (org, app, executor_id) DO UPDATE SET last_seen_at = now()
                   WHERE i.key_id = EXCLUDED.key_id
                   RETURNING org, app, executor_id""",
                ids,
            )
            bound = {(r["org"], r["app"], r["executor_id"]) for r in await cur.fetchall()}
            keep = [i for i, h in enumerate(rows) if (h.key.org, h.key.app, h.key.executor_id) in bound]
            if not keep:
                return {}, gone
            mine = [[column[i] for i in keep] for column in columns[:9]]
            cur = await conn.execute(
                """WITH t AS (
                       SELECT * FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[],
                                            %s::text[], %s::text[], %s::jsonb[], %s::text[])
                           AS t(org, app, id, version, hostname, language, dbos_version, metadata, instance)),
                   old AS (  -- the rows as the statement found them (no FOR UPDATE: it would skip them)
                       SELECT e.org, e.app, e.executor_id, e.state, e.relay_instance FROM executors e
                       JOIN t ON t.org = e.org AND t.app = e.app AND t.id = e.executor_id),
                   up AS (
                       INSERT INTO executors AS e (org, app, executor_id, state, application_version,
                            hostname, language, dbos_version, metadata, connected_at, relay_instance)
                       SELECT org, app, id, 'HEALTHY', version, hostname, language, dbos_version, metadata,
                            now(), instance FROM t
                       ON CONFLICT (org, app, executor_id) DO UPDATE SET
                            state = 'HEALTHY', epoch = EXCLUDED.epoch, previous_epoch = e.epoch,
                            application_version = EXCLUDED.application_version,
                            hostname = EXCLUDED.hostname, language = EXCLUDED.language,
                            dbos_version = EXCLUDED.dbos_version, metadata = EXCLUDED.metadata,
                            connected_at = now(), dead_at = NULL, blocked_reason = NULL,
                            relay_instance = EXCLUDED.relay_instance
                       WHERE e.state = ANY(%s)
                       RETURNING org, app, executor_id, epoch, previous_epoch)
                   SELECT up.*, old.state AS previous_state, old.relay_instance AS previous_instance,
                          txid_current()::text AS xact
                   FROM up LEFT JOIN old USING (org, app, executor_id)""",
                (*mine, allowed),
            )
            found = await cur.fetchall()
            results = {
                ExecutorKey(r["org"], r["app"], r["executor_id"]): Connected(
                    int(r["epoch"]),
                    r["previous_epoch"],
                    ExecutorState(r["previous_state"]) if r["previous_state"] else None,
                    r["previous_instance"],
                )
                for r in found
            }
            if landed is not None and found:
                # Kept before the COMMIT (again_if_lost): if it is made but its reply is lost, a second run
                # would find these rows HEALTHY already and tell each caller so, not what they were before
                # (its grace period not ended, its death's recovery records not ended).
                landed.keep(str(found[0]["xact"]), (results, gone))
            return results, gone

    async def stranded(
        self, conn: Conn, key: ExecutorKey, version: str, instance: str, audit_mark: int | None
    ) -> int | None:
        """STRANDED: the record of an executor that has none comes back DEAD, owned by ``instance``
        (whose repair sweep then watches its recovery), in the caller's fenced transaction.

        Returns its epoch; None if it has a record now (it connected, or another run of the
        reconciler brought it back), if its app was deleted meanwhile, or if an audit entry about it was written after
        ``audit_mark`` (:meth:`audit_mark`, read before its work was listed): the listing may
        predate a recovery that has moved that work since, so a later run looks again.
        """
        check_transition(None, E.STRANDED)
        if not await AppStore.hold(conn, [(key.org, key.app)]):
            # The app was deleted since its work was listed (it had no executor in the registry): the
            # record would refer to no app. Nothing to recover for Relay then; the operator deleted it.
            self._count(E.STRANDED, 0)
            return None
        cur = await conn.execute(
            """INSERT INTO executors AS e (org, app, executor_id, state, application_version,
                    connected_at, disconnected_at, dead_at, relay_instance)
               SELECT %(org)s, %(app)s, %(id)s, 'DEAD', %(version)s,
                    COALESCE(i.first_seen_at, now()), COALESCE(i.last_seen_at, now()), now(), %(instance)s
               FROM (SELECT 1) one LEFT JOIN executor_ids i
                    ON i.org = %(org)s AND i.app = %(app)s AND i.executor_id = %(id)s
               WHERE %(mark)s::bigint IS NULL
                  OR NOT EXISTS (SELECT 1 FROM audit_log a
                                 WHERE a.org = %(org)s AND a.app = %(app)s AND a.executor_id = %(id)s
                                   AND a.id > %(mark)s::bigint)
               ON CONFLICT (org, app, executor_id) DO NOTHING
               RETURNING epoch""",
            {"org": key.org, "app": key.app, "id": key.executor_id, "version": version, "instance": instance,
             "mark": audit_mark},
        )  # fmt: skip
        row = await cur.fetchone()
        self._count(E.STRANDED, int(row is not None))
        return None if row is None else int(row["epoch"])

    async def audit_mark(self) -> int:
        """The newest audit entry's id: what :meth:`stranded` takes as its ``audit_mark``."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT COALESCE(max(id), 0) AS mark FROM audit_log")
            row = await cur.fetchone()
            return int(row["mark"]) if row else 0

    # -- reads ----------------------------------------------------------------------

    async def gone(self, org: str, app: str, executor_ids: list[str]) -> dict[str, bool]:
        """Of these executor ids, those with no record in the registry: id -> whether Relay
        registered it once (its id is remembered) rather than never having seen it."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT x.id, EXISTS (SELECT 1 FROM executor_ids i
                                        WHERE i.org = %(org)s AND i.app = %(app)s AND i.executor_id = x.id) AS seen
                   FROM unnest(%(ids)s::text[]) AS x(id)
                   WHERE NOT EXISTS (SELECT 1 FROM executors e
                                     WHERE e.org = %(org)s AND e.app = %(app)s AND e.executor_id = x.id)""",
                {"org": org, "app": app, "ids": executor_ids},
            )
            return {str(r["id"]): bool(r["seen"]) for r in await cur.fetchall()}

    @staticmethod
    async def at_epoch(conn: Conn, key: ExecutorKey, epoch: int, states: tuple[ExecutorState, ...]) -> bool:
        """Whether the executor's row is at ``epoch`` in one of ``states`` (a step re-run after a crash
        finds its own change already made)."""
        cur = await conn.execute(
            "SELECT state, epoch FROM executors WHERE org = %s AND app = %s AND executor_id = %s",
            (key.org, key.app, key.executor_id),
        )
        row = await cur.fetchone()
        return row is not None and row["epoch"] == epoch and row["state"] in {s.value for s in states}

    async def still_dead(self, key: ExecutorKey, epoch: int) -> bool:
        async with self.db.connection() as conn:
            return await self.at_epoch(conn, key, epoch, (ExecutorState.DEAD, ExecutorState.RECOVERING))

    async def dead_and_language(self, key: ExecutorKey, epoch: int) -> tuple[bool, str | None]:
        """:meth:`still_dead`, and the language of the executor's SDK as its handshake said (None:
        not known, or no such row), in one read: a recovery's every round asks both."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT state, epoch, language FROM executors WHERE org = %s AND app = %s AND executor_id = %s",
                (key.org, key.app, key.executor_id),
            )
            row = await cur.fetchone()
        if row is None:
            return False, None
        dead = row["epoch"] == epoch and row["state"] in (ExecutorState.DEAD.value, ExecutorState.RECOVERING.value)
        return dead, row["language"] or None

    async def disconnected_secs(self, key: ExecutorKey, epoch: int) -> float | None:
        """How long ago the executor's disconnection at ``epoch`` was, by the database's clock (as the
        repair sweep reads it); None if its row is not DISCONNECTED at that epoch."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT extract(epoch FROM now() - disconnected_at) AS secs FROM executors
                   WHERE org = %s AND app = %s AND executor_id = %s AND epoch = %s AND state = 'DISCONNECTED'""",
                (key.org, key.app, key.executor_id, epoch),
            )
            row = await cur.fetchone()
        return None if row is None or row["secs"] is None else float(row["secs"])

    async def version_of(self, conn: Conn, key: ExecutorKey) -> str | None:
        cur = await conn.execute(
            "SELECT application_version FROM executors WHERE org = %s AND app = %s AND executor_id = %s",
            (key.org, key.app, key.executor_id),
        )
        row = await cur.fetchone()
        return None if row is None else str(row["application_version"])

    async def get(self, key: ExecutorKey) -> ExecutorRecord | None:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"SELECT {_WITH_FIRST_SEEN} WHERE e.org = %s AND e.app = %s AND e.executor_id = %s",
                (key.org, key.app, key.executor_id),
            )
            row = await cur.fetchone()
        return ExecutorRecord.from_row(row) if row else None

    async def grace_ends(self, records: list[ExecutorRecord]) -> dict[ExecutorKey, datetime]:
        """When each DISCONNECTED one of ``records`` is declared DEAD unless it reconnects.

        The deadline its grace period recorded as it began to wait (the durable timer of its
        ``DBOS.recv``, DBOS's ``DBOS.sleep`` row: the wake time, in seconds), so that what is shown is
        what that workflow waits for, however late it started (adopted from another instance, started
        by the repair sweep) and whatever the app's setting became since. Before it has recorded one
        (waiting in its queue, about a second), or once it ended without declaring the executor dead
        (the repair sweep declares it then), the disconnection plus the app's ``executorTimeoutSecs``,
        which is what either will count."""
        waiting = {grace_id(r.key, r.epoch): r for r in records if r.state is ExecutorState.DISCONNECTED}
        if not waiting:
            return {}
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT o.workflow_uuid, o.output, o.serialization FROM dbos.operation_outputs o
                   JOIN dbos.workflow_status w ON w.workflow_uuid = o.workflow_uuid
                   WHERE o.workflow_uuid = ANY(%s) AND o.function_name = 'DBOS.sleep'
                     AND w.status IN ('PENDING', 'ENQUEUED', 'DELAYED')""",
                (list(waiting),),
            )
            timers = {
                str(r["workflow_uuid"]): _wake_time(r["output"], r["serialization"]) for r in await cur.fetchall()
            }
            apps = sorted({(r.key.org, r.key.app) for r in waiting.values()})
            cur = await conn.execute(
                """SELECT org, name, executor_timeout_secs FROM apps
                   WHERE (org, name) IN (SELECT * FROM unnest(%s::text[], %s::text[]))""",
                ([org for org, _ in apps], [app for _, app in apps]),
            )
            grace = {(str(r["org"]), str(r["name"])): float(r["executor_timeout_secs"]) for r in await cur.fetchall()}
        ends: dict[ExecutorKey, datetime] = {}
        for workflow_id, rec in waiting.items():
            timer = timers.get(workflow_id)
            secs = grace.get((rec.key.org, rec.key.app))
            if timer is not None:
                ends[rec.key] = timer
            elif rec.disconnected_at is not None and secs is not None:
                ends[rec.key] = rec.disconnected_at + timedelta(seconds=secs)
        return ends

    async def list_executors(
        self, org: str, app: str, state: ExecutorState | None = None, limit: int = 100, offset: int = 0
    ) -> list[ExecutorRecord]:
        """A page of the app's executors in order of id: a reconnect (which changes ``connected_at``)
        between two pages moves no executor from one page to another."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                LIST_PAGE, (org, app, state.value if state else None, state.value if state else None, limit, offset)
            )
            rows = await cur.fetchall()
        return [ExecutorRecord.from_row(row) for row in rows]

    async def _healthy(self, org: str, app: str) -> HealthyRead:
        """The app's HEALTHY executors (id, version, language, instance), leaving out those whose
        instance's lease ran out: their sockets died with it. Peer choice and the API's routing read
        this one query."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT e.executor_id, e.application_version, e.language, e.relay_instance FROM executors e
                   JOIN relay_instances i ON i.instance_id = e.relay_instance AND i.lease_expires_at > now()
                   WHERE e.org = %s AND e.app = %s AND e.state = 'HEALTHY' ORDER BY e.executor_id""",
                (org, app),
            )
            return HealthyRead(await cur.fetchall())

    async def why_none_serving(self, org: str, app: str) -> str | None:
        """Why :meth:`serving` has nobody, for an operator: the app's executors by state, and
        HEALTHY ones held by an instance whose lease ran out (it stalled or lost the database;
        another instance adopts it, or it renews in time and serves them again). None: there is
        no such app (no row in ``apps``, no executor)."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT 1 FROM apps WHERE org = %s AND name = %s", (org, app))
            known = await cur.fetchone() is not None
            cur = await conn.execute(
                """SELECT e.state, e.relay_instance,
                          i.lease_expires_at IS NOT NULL AND i.lease_expires_at <= now() AS lapsed,
                          extract(epoch FROM now() - i.lease_expires_at) AS lapsed_secs, count(*) AS n
                   FROM executors e LEFT JOIN relay_instances i ON i.instance_id = e.relay_instance
                   WHERE e.org = %s AND e.app = %s
                   GROUP BY 1, 2, 3, 4 ORDER BY 1, 2""",
                (org, app),
            )
            rows = await cur.fetchall()
        states: Counter[str] = Counter()
        lapsed: list[str] = []
        for row in rows:
            states[row["state"]] += row["n"]
            if row["state"] == ExecutorState.HEALTHY.value and row["lapsed"]:
                lapsed.append(f"{row['n']} held by {row['relay_instance']}, whose lease ran out"
                              f" {float(row['lapsed_secs']):.1f} s ago")  # fmt: skip
        if lapsed:
            return "HEALTHY " + "; ".join(lapsed)
        if not states:
            return "none has connected" if known else None
        return ", ".join(f"{n} {state}" for state, n in sorted(states.items()))

    async def healthy_peers(self, org: str, app: str, max_age: float = 0.0) -> tuple[Peer, ...]:
        """The app's HEALTHY executors (id and application version), in order of id.

        ``max_age``: a read begun up to this many seconds ago will do, and so will one in flight.
        A group of deaths of one app then shares a read instead of each reading every survivor
        (a cost that grew with deaths times survivors), and the same tuple: it is built once per
        read, not once per caller. Every read, ``max_age`` 0 included, is the one the next
        callers share.
        """
        read, _ = await self._shared_healthy(org, app, max_age)
        return read.peers

    async def healthy_languages(self, org: str, app: str) -> frozenset[str]:
        """The languages the app's HEALTHY executors' handshakes gave (those known). A read of its
        own, not :meth:`healthy_peers`' shared one: a read made as an executor connects would be the
        one the API's routing and peer choice take for a second after, without the executors that
        connected in that second."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT DISTINCT language FROM executors
                   WHERE org = %s AND app = %s AND state = 'HEALTHY' AND language IS NOT NULL AND language <> ''""",
                (org, app),
            )
            return frozenset(str(r["language"]) for r in await cur.fetchall())

    def forget_healthy(self, org: str, app: str) -> None:
        """The shared read of the app's healthy executors is stale (one of them failed a request):
        the next caller reads again."""
        self._peer_reads.pop((org, app), None)

    async def _shared_healthy(self, org: str, app: str, max_age: float) -> tuple[HealthyRead, bool]:
        """The read, and whether it is shared with earlier callers (not one begun now)."""
        # The read is a task of its own, shared: not a request's (relay.store.db.hastily), so it waits
        # for the pool's 10 s. A request is refused here at once while the database is known away.
        await self.db.refuse_if_hasty()
        loop = asyncio.get_running_loop()
        now = loop.time()
        held = self._peer_reads.get((org, app))
        if held is not None and max_age > 0 and now - held[0] <= max_age:
            return await asyncio.shield(held[1]), True
        read = shared_task(self._healthy(org, app))  # it serves later callers too: no request's id
        self._peer_reads[(org, app)] = (now, read)

        def forget_failed(task: asyncio.Task[HealthyRead]) -> None:
            if (task.cancelled() or task.exception() is not None) and self._peer_reads.get((org, app)) == (now, task):
                del self._peer_reads[(org, app)]

        read.add_done_callback(forget_failed)
        return await asyncio.shield(read), False

    async def serving(self, org: str, app: str, max_age: float = 0.0) -> tuple[list[tuple[str, str]], bool]:
        """(executor id, instance holding its socket) of the app's HEALTHY executors: the executors
        and their :meth:`owner` in one query, shared as :meth:`healthy_peers` shares it; and
        whether the list is a shared read (not one begun now)."""
        read, shared = await self._shared_healthy(org, app, max_age)
        return [(r["executor_id"], r["relay_instance"]) for r in read.rows], shared

    async def owner(self, key: ExecutorKey) -> str | None:
        """The instance holding the executor's socket; None if it is not HEALTHY or its instance's
        lease has run out (it died, and its adopter will mark it DISCONNECTED)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT e.relay_instance FROM executors e
                   JOIN relay_instances i ON i.instance_id = e.relay_instance AND i.lease_expires_at > now()
                   WHERE e.org = %s AND e.app = %s AND e.executor_id = %s AND e.state = 'HEALTHY'""",
                (key.org, key.app, key.executor_id),
            )
            row = await cur.fetchone()
        return None if row is None else str(row["relay_instance"])

    async def healthy_of_instance(self, instance: str, settled_secs: float) -> dict[ExecutorKey, int]:
        """HEALTHY rows this instance owns that connected more than ``settled_secs`` ago: key -> epoch."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, app, executor_id, epoch FROM executors
                   WHERE relay_instance = %s AND state = 'HEALTHY'
                     AND connected_at < now() - make_interval(secs => %s)""",
                (instance, settled_secs),
            )
            return {ExecutorKey(r["org"], r["app"], r["executor_id"]): int(r["epoch"]) for r in await cur.fetchall()}

    async def owns(self, key: ExecutorKey, epoch: int, instance: str) -> bool:
        """Whether the row is HEALTHY at ``epoch`` on ``instance``."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT 1 FROM executors WHERE org = %s AND app = %s AND executor_id = %s
                   AND state = 'HEALTHY' AND epoch = %s AND relay_instance = %s""",
                (key.org, key.app, key.executor_id, epoch, instance),
            )
            return await cur.fetchone() is not None

    async def disconnected_of_instance(self, instance: str) -> list[tuple[ExecutorKey, int]]:
        """DISCONNECTED executors this instance owns: each needs a grace period running."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, app, executor_id, epoch FROM executors
                   WHERE relay_instance = %s AND state = 'DISCONNECTED'""",
                (instance,),
            )
            return [(ExecutorKey(r["org"], r["app"], r["executor_id"]), int(r["epoch"])) for r in await cur.fetchall()]

    async def needing_timers(self, instance: str) -> list[Unfinished]:
        """Executors this instance owns that are not HEALTHY: each needs a grace period
        (DISCONNECTED) or a recovery (DEAD, RECOVERING) running, which the repair sweep checks."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT e.org, e.app, e.executor_id, e.state, e.epoch,
                          COALESCE(e.disconnected_at + make_interval(secs => a.executor_timeout_secs) <= now(), true)
                              AS grace_over,
                          extract(epoch FROM now() - e.disconnected_at) AS disconnected_secs
                   FROM executors e LEFT JOIN apps a ON a.org = e.org AND a.name = e.app
                   WHERE e.relay_instance = %s AND e.state <> 'HEALTHY'
                   ORDER BY e.org, e.app, e.executor_id""",
                (instance,),
            )
            rows = await cur.fetchall()
        return [
            Unfinished(ExecutorKey(r["org"], r["app"], r["executor_id"]), ExecutorState(r["state"]), int(r["epoch"]),
                       bool(r["grace_over"]),
                       None if r["disconnected_secs"] is None else float(r["disconnected_secs"]))
            for r in rows
        ]  # fmt: skip

    async def apps_with_healthy(self) -> list[tuple[str, str]]:
        """(org, app) of every app with a HEALTHY executor: those the reconciler can ask."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT DISTINCT org, app FROM executors WHERE state = 'HEALTHY' ORDER BY org, app"
            )
            return [(str(r["org"]), str(r["app"])) for r in await cur.fetchall()]

    async def count_blocked(self) -> dict[tuple[str, str, str], int]:
        """DEAD executors waiting, per (org, app, blocked reason), for /metrics."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, app, blocked_reason, count(*) AS n FROM executors
                   WHERE blocked_reason IS NOT NULL GROUP BY org, app, blocked_reason"""
            )
            rows = await cur.fetchall()
        return {(r["org"], r["app"], r["blocked_reason"]): int(r["n"]) for r in rows}

    async def count_by_state(self) -> dict[tuple[str, str, str], int]:
        """Executors per (org, app, state), for /metrics."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT org, app, state, count(*) AS n FROM executors GROUP BY org, app, state")
            rows = await cur.fetchall()
        return {(r["org"], r["app"], r["state"]): int(r["n"]) for r in rows}


def _wake_time(output: str | None, serialization: str | None) -> datetime | None:
    """A recorded ``DBOS.sleep``'s wake time: DBOS 3 writes it as portable JSON, seconds since 1970.
    None for any other form (a timer an older DBOS recorded): the caller counts the deadline itself."""
    if serialization != "portable_json" or output is None:
        return None
    try:
        return datetime.fromtimestamp(float(json.loads(output)), UTC)
    except (ValueError, TypeError, OverflowError):
        return None
