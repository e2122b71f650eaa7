"""Migrations of indexes (relay/store/migrations.py): built ``CONCURRENTLY``, outside the
migrations' transaction, so the instances still running during a rolling upgrade keep writing;
once across instances starting together; begun again after a build cut short.

A transaction left open by the test (a slow write of an instance still running) makes
``CREATE INDEX CONCURRENTLY`` wait for it, which holds a build in the middle for as long as the
test needs: to write beside it, to start a second instance, or to terminate it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from harness.postgres import Postgres
from harness.waiting import assert_eventually
from relay.api.audit import conductor_entry
from relay.core.ids import ExecutorKey, RecoveryRef, recovery_id
from relay.errors import DatabaseError
from relay.store import db as db_module
from relay.store.alerts import AlertStore
from relay.store.audit import AuditEntry, AuditMatch, AuditStore, audit_page, requested_from
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.lease import Lease
from relay.store.migrations import MIGRATIONS, Migration
from relay.store.recoveries import RecoveryStore
from tests.test_upgrade import schema_versions

AT_15 = [m for m in MIGRATIONS if m.version <= 15]
NEW = [m.version for m in MIGRATIONS if m.version > 15]
# Migration 16 as it was first written (never released): its indexes built in the transaction.
FIRST_16 = Migration(
    16,
    """CREATE INDEX recoveries_by_created ON recoveries (org, app, created_at, run, id);
       CREATE INDEX audit_by_action ON audit_log (org, action, id);""",
)
# Writes of Relay 0.2.0, still running during the upgrade (its relay/recoveries.py, as released).
OLD_AUDIT = """INSERT INTO audit_log (org, app, action, executor_id, peer_executor_id, actor, detail, dedupe_key)
               VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (dedupe_key) DO NOTHING"""
OLD_RECOVERY = """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                  VALUES (%s, %s, %s, %s, %s, %s, %s, 'dispatching') ON CONFLICT (id) DO NOTHING"""


async def _migrate(url: str, migrations: list[Migration] | None = None, instances: int = 1) -> list[list[int]]:
    saved = db_module.MIGRATIONS
    if migrations is not None:
        db_module.MIGRATIONS = migrations
    dbs = [Database(url, min_size=1, max_size=1) for _ in range(instances)]
    try:
        for db in dbs:
            await db.open()
        return list(await asyncio.gather(*(db.migrate() for db in dbs)))
    finally:
        db_module.MIGRATIONS = saved
        for db in dbs:
            await db.close()


def migrate(url: str, migrations: list[Migration] | None = None) -> list[int]:
    return asyncio.run(_migrate(url, migrations))[0]


def at_15(postgres: Postgres, name: str, rows: int = 2_000) -> str:
    """A database a release with migrations 1 to 15 made, with ``rows`` audit entries."""
    url = postgres.create_database(name)
    assert migrate(url, AT_15) == [m.version for m in AT_15]
    with psycopg.connect(url) as conn:
        conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor)
               SELECT 'acme', 'app-' || (i %% 20), 'executor.connected', 'ex-' || (i %% 200), 'relay'
               FROM generate_series(1, %s) AS i""",
            (rows,),
        )
    return url


class InBackground:
    """Call ``run`` in a thread; :meth:`result` waits for it and returns or raises what it did."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[], Any]) -> None:
        try:
            self._outcome.append(("value", run()))
        except BaseException as exc:  # handed to the test's thread
            self._outcome.append(("error", exc))

    def result(self, timeout: float = 60) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the migration did not end"
        kind, value = self._outcome[0]
        if kind == "error":
            raise value
        return value


def open_write(url: str) -> psycopg.Connection[Any]:
    """A transaction of an instance still running that wrote and has not committed yet."""
    conn = psycopg.connect(url)
    conn.execute(OLD_AUDIT, ("acme", "app-0", "executor.connected", "slow", None, "relay", Jsonb({}), "slow:1"))
    conn.execute(OLD_RECOVERY, ("slow", "acme", "app-0", "slow", "v1", 1, "grace_period"))
    return conn


def index_builds(url: str) -> list[tuple[int, str]]:
    """The backends building an index of ``url``'s database and waiting on a lock: pid, statement."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            """SELECT pid, query FROM pg_stat_activity
               WHERE datname = current_database() AND query ILIKE '%%CREATE INDEX%%' AND wait_event_type = 'Lock'
               AND pid <> pg_backend_pid()"""
        ).fetchall()
    return [(int(pid), str(query)) for pid, query in rows]


def lock_waits(url: str) -> list[tuple[int, str]]:
    """The backends of ``url``'s database waiting on a lock: pid, statement."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            """SELECT pid, query FROM pg_stat_activity
               WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"""
        ).fetchall()
    return [(int(pid), str(query)) for pid, query in rows]


def lock_pollers(url: str) -> int:
    """The backends that last asked for the migrations' lock and did not get it (polling for it)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            """SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle'
               AND query LIKE 'SELECT pg_try_advisory_lock%%'
               AND pid NOT IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted)"""
        ).fetchone()
    return int(row[0]) if row else 0


def invalid_indexes(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid").fetchall()
    return [str(r[0]) for r in rows]


def indexes(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'").fetchall()
    return {str(name): str(definition) for name, definition in rows}


def old_release_writes(url: str, n: int) -> None:
    """Writes of 0.2.0, each its own transaction, that give up if a lock holds them for a second."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '1s'")
        for i in range(n):
            conn.execute(OLD_AUDIT, ("acme", "app-1", "executor.dead", f"old-{i}", None, "relay", Jsonb({}), f"o:{i}"))
            conn.execute(OLD_RECOVERY, (f"old-{i}", "acme", "app-1", f"old-{i}", "v1", i, "grace_period"))


def test_two_instances_starting_on_a_database_at_15_build_the_indexes_once_as_older_writes_go_on(
    postgres: Postgres,
) -> None:
    url = at_15(postgres, "index_once")
    slow = open_write(url)
    try:
        both = InBackground(lambda: asyncio.run(_migrate(url, instances=2)))
        # One instance builds, held by the slow write; the other waits for the migrations' lock.
        ((_, query),) = assert_eventually(lambda: index_builds(url), 20)
        # Meanwhile the older instance's writes to both tables go on (a build inside the
        # migrations' transaction would hold them behind it: lock_timeout).
        old_release_writes(url, 5)
        assert "CONCURRENTLY" in query, query
        assert_eventually(lambda: lock_pollers(url) == 1, 10)
    finally:
        slow.commit()
        slow.close()
    assert sorted(both.result()) == [[], NEW]
    assert schema_versions(url) == [m.version for m in MIGRATIONS]
    assert invalid_indexes(url) == []
    assert {"recoveries_by_created", "audit_by_action", "audit_by_executor_id"} <= set(indexes(url))
    assert migrate(url) == []


def test_a_build_killed_midway_is_dropped_and_built_again_at_the_next_start(
    postgres: Postgres, caplog: pytest.LogCaptureFixture
) -> None:
    url = at_15(postgres, "index_killed")
    slow = open_write(url)
    try:
        run = InBackground(lambda: migrate(url))
        ((pid, query),) = assert_eventually(lambda: index_builds(url), 20)
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)
        with pytest.raises(DatabaseError, match="migrating the database"):
            run.result()
    finally:
        slow.commit()
        slow.close()
    # The build left its index INVALID and the version unrecorded.
    (left,) = invalid_indexes(url)
    assert left in query, (left, query)
    assert schema_versions(url) == [m.version for m in AT_15]

    with caplog.at_level(logging.INFO, logger="relay.db"):
        assert migrate(url) == NEW
    assert f"index {left} was left invalid by a build cut short: dropping it to build it again" in caplog.text
    assert invalid_indexes(url) == []
    assert schema_versions(url) == [m.version for m in MIGRATIONS]
    assert indexes(url) == indexes(fresh(postgres, "index_fresh"))


def fresh(postgres: Postgres, name: str) -> str:
    url = postgres.create_database(name)
    migrate(url)
    return url


# What migrations 7 and 9 built in the transaction as first written (never released); 16 builds them now.
FIRST_7_AND_9 = """CREATE INDEX audit_by_at ON audit_log (at);
                   CREATE INDEX recoveries_by_updated ON recoveries (updated_at);
                   CREATE INDEX audit_by_executor ON audit_log (org, app, executor_id, id);"""


def test_the_schema_is_the_same_whether_16_was_applied_as_first_written_or_concurrently(postgres: Postgres) -> None:
    """A database an unreleased build migrated to 16 (7, 9 and 16 building their indexes in the
    transaction) runs 17 only and ends with the schema a fresh one gets."""
    first = at_15(postgres, "index_first_16", rows=10)
    with psycopg.connect(first) as conn:
        conn.execute(FIRST_7_AND_9)
    assert migrate(first, [*AT_15, FIRST_16]) == [16]
    assert migrate(first) == [v for v in NEW if v > 16]
    at_15_before = at_15(postgres, "index_first_15", rows=10)
    with psycopg.connect(at_15_before) as conn:
        conn.execute(FIRST_7_AND_9)
    assert migrate(at_15_before) == NEW
    assert indexes(first) == indexes(at_15_before) == indexes(fresh(postgres, "index_new_16"))


# 0.2.0's relay/registry.py, Registry.connected (the columns it leaves to their defaults left out).
OLD_CONNECTED = """INSERT INTO executors AS e (org, app, executor_id, state, application_version, connected_at,
                        relay_instance)
                   VALUES ('acme', 'ledger', %s, 'HEALTHY', 'v1', now(), 'relay-old')
                   ON CONFLICT (org, app, executor_id) DO UPDATE SET state = 'HEALTHY', epoch = e.epoch + 1,
                        connected_at = now(), relay_instance = EXCLUDED.relay_instance"""


def test_an_upgrade_from_0_2_0_indexes_the_audit_log_outside_the_transaction(postgres: Postgres) -> None:
    """From 0.2.0's schema (1 and 2), migrations 3 to 15 alter ``executors`` in their transaction
    (its lock held to the commit): the audit log's indexes are built after it, concurrently, so
    the running 0.2.0 instances' executors and audit entries are written meanwhile."""
    url = postgres.create_database("index_from_0_2_0")
    assert migrate(url, MIGRATIONS[:2]) == [1, 2]
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO orgs (name) VALUES ('acme')")
        conn.execute("INSERT INTO apps (org, name, executor_timeout_secs) VALUES ('acme', 'ledger', 30)")
        conn.execute(OLD_CONNECTED, ("before",))
    slow = psycopg.connect(url)  # an audit entry of 0.2.0 being written
    slow.execute(OLD_AUDIT, ("acme", "ledger", "executor.dead", "slow", None, "relay", Jsonb({}), "slow:1"))
    try:
        run = InBackground(lambda: migrate(url))
        # The migration waits for the slow write: in its transaction (migration 7's text, too long
        # for pg_stat_activity to show its CREATE INDEX), or building an index concurrently after it.
        ((_, query),) = assert_eventually(lambda: lock_waits(url), 20)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '1s'")
            for i in range(3):
                conn.execute(OLD_CONNECTED, (f"during-{i}",))
                conn.execute(OLD_AUDIT, ("acme", "ledger", "executor.connected", f"during-{i}", None, "relay",
                                         Jsonb({}), f"during:{i}"))  # fmt: skip
        assert "CONCURRENTLY" in query, query
        assert schema_versions(url)[-1] == 15  # 3 to 15 committed, their locks let go
    finally:
        slow.commit()
        slow.close()
    assert run.result() == list(range(3, MIGRATIONS[-1].version + 1))
    assert invalid_indexes(url) == []


def test_the_audit_of_one_executor_without_its_app_is_read_along_its_own_index(postgres: Postgres) -> None:
    """``GET /audit?executorId=`` without ``app``: migration 17's index gives the page in id order
    (PostgreSQL 18 would otherwise skip-scan audit_by_executor over every app, then sort)."""
    url = at_15(postgres, "index_plan", rows=20_000)
    migrate(url)
    params = dict.fromkeys(("app", "since", "action", "until"))
    params.update({"org": "acme", "executor": "ex-7", "limit": 100, "offset": 0})
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE audit_log")
        print(conn.execute("SHOW server_version").fetchone())
        for newest_first in (False, True):
            plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + audit_page(newest_first), params).fetchall())
            assert "Index Scan" in plan and "audit_by_executor_id" in plan and "Sort" not in plan, plan


def test_an_earlier_release_waiting_for_the_lock_in_a_transaction_does_not_stop_the_build(postgres: Postgres) -> None:
    """An instance of an earlier release (0.2.0, or a build before this one) starting meanwhile
    waits for the migrations' lock inside a transaction: the build waits for that transaction, which
    waits for the lock the build's session holds. PostgreSQL breaks the deadlock by cancelling the
    build; the runner lets the lock go for the earlier release to see its migrations done, then
    takes it again and builds."""
    url = at_15(postgres, "index_deadlock")
    slow = open_write(url)
    earlier: list[object] = []

    def earlier_release() -> None:
        with psycopg.connect(url) as conn:  # one transaction, as releases before this one migrated
            # PostgreSQL cancels one of the two: the build here (a waiter that checks first is
            # cancelled instead, and that release's start fails, as it would on any deadlock).
            conn.execute("SET deadlock_timeout = '60s'")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (db_module.MIGRATION_LOCK_KEY,))
            earlier.append(conn.execute("SELECT max(version) FROM relay_schema_migrations").fetchone())

    try:
        run = InBackground(lambda: migrate(url))
        assert_eventually(lambda: index_builds(url), 20)
        waiter = InBackground(earlier_release)
        assert_eventually(lambda: lock_waiters(url) == 1, 10)
    finally:
        slow.commit()
        slow.close()
    assert run.result() == NEW
    waiter.result()
    assert earlier == [(15,)]
    assert invalid_indexes(url) == []
    assert schema_versions(url) == [m.version for m in MIGRATIONS]


def lock_waiters(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()
    return int(row[0]) if row else 0


def test_migration_20_reads_the_audit_log_along_its_index_while_it_holds_the_alerts(postgres: Postgres) -> None:
    """Migration 20 adds ``alerts.resolved_at`` (the alerts table locked until it commits, with every
    instance of the earlier release still delivering alerts) and marks the alerts whose
    ``alert.resolved`` is in the audit log. It joined the two tables: PostgreSQL hashed every entry of
    the audit log (3.3 s for 2 million entries, 1.5 GB; as long again per such size) to find a few.
    Now each alert is looked up by the entry's unique key: the time goes with the alerts, not the
    audit log. The alerts it marks are those the join marked."""
    url = at_15(postgres, "resolved_plan", rows=20_000)
    assert migrate(url, [m for m in MIGRATIONS if m.version <= 19])[-1] == 19
    (twenty,) = [m for m in MIGRATIONS if m.version == 20]
    statements = [s for s in twenty.sql.split(";") if "UPDATE" in s]
    assert statements, twenty.sql
    with psycopg.connect(url) as conn:
        conn.execute("""INSERT INTO alerts (idempotency_key, rule_id, org, app, kind, subject, status)
                        SELECT 'r:s' || i || ':1', 'r', 'acme', 'ledger', 'ExecutorDead', 's' || i, 'sent'
                        FROM generate_series(1, 500) AS i""")  # fmt: skip
        conn.execute("""INSERT INTO audit_log (org, app, action, executor_id, actor, dedupe_key)
                        SELECT 'acme', 'ledger', 'alert.resolved', 's' || i, 'relay', 'alert.resolved:r:s' || i || ':1'
                        FROM generate_series(1, 500, 10) AS i""")  # fmt: skip
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")
        with conn.transaction(force_rollback=True):
            conn.execute("ALTER TABLE alerts ADD COLUMN resolved_at timestamptz")
            for statement in statements:
                plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + statement).fetchall())
                assert "Seq Scan on audit_log" not in plan, plan
    migrate(url)
    with psycopg.connect(url) as conn:
        marked = conn.execute("SELECT subject FROM alerts WHERE resolved_at IS NOT NULL ORDER BY 1").fetchall()
        wrong = conn.execute(
            """SELECT count(*) FROM alerts a JOIN audit_log l ON l.dedupe_key = 'alert.resolved:' || a.idempotency_key
               WHERE a.resolved_at IS DISTINCT FROM l.at"""
        ).fetchone()
    assert sorted(s for (s,) in marked) == sorted(f"s{i}" for i in range(1, 501, 10))
    assert wrong == (0,)


def test_migration_22_leaves_the_entries_it_finds_and_those_of_earlier_releases_without_an_address(
    relay_db: str,
) -> None:
    """Migration 22 adds ``audit_log.source_ip``, where an API key's entry records the address of
    its request (Conductor's ``sourceIp``). The entries written before it, and those an instance of
    the earlier release still running writes after it (its insert leaves the column out), have none:
    Conductor's listing answers "" for them. Relay's own entries have none either, even when a
    request started the work that wrote them."""
    assert migrate(relay_db, [m for m in MIGRATIONS if m.version <= 21])[-1] == 21
    with psycopg.connect(relay_db) as conn:
        conn.execute(OLD_AUDIT, ("acme", None, "token.created", None, None, "api:before", Jsonb({}), "before:1"))
    assert migrate(relay_db, [m for m in MIGRATIONS if m.version <= 22]) == [22]
    with psycopg.connect(relay_db) as conn:
        conn.execute(OLD_AUDIT, ("acme", None, "token.created", None, None, "api:still-old", Jsonb({}), "old:1"))
    migrate(relay_db)  # the later migrations, under which the code below runs

    async def written_and_read() -> list[dict[str, Any]]:
        db = Database(relay_db, min_size=1, max_size=1)
        await db.open()
        try:
            audit = AuditStore(db)
            with requested_from("192.0.2.7"):
                await audit.write("acme", None, AuditEntry("token.created", "api:upgraded"))
                await audit.write("acme", "ledger", AuditEntry("recovery.manual_requested", "relay"))
            await audit.write("acme", None, AuditEntry("token.deleted", "api:no-request"))
            return await audit.find("acme", AuditMatch(), 10, 0)
        finally:
            await db.close()

    found = [(e.subject.id, e.sourceIp) for e in map(conductor_entry, asyncio.run(written_and_read()))]
    assert found == [("no-request", ""), ("relay", ""), ("upgraded", "192.0.2.7"), ("still-old", ""), ("before", "")]


@contextlib.asynccontextmanager
async def leased(url: str) -> AsyncIterator[Database]:
    """Relay's database, open, under instance relay-1's lease (the stores' writes commit only under one)."""
    db = Database(url, min_size=1, max_size=2)
    await db.open()
    lease = Lease(db, "relay-1", 30)
    await lease.acquire()
    try:
        yield db
    finally:
        await lease.stop()
        await db.close()


# A rule as the releases before migration 24 insert one (relay.store.alerts, AlertStore.create).
OLD_RULE = """INSERT INTO alert_rules (id, org, app, kind, params, min_interval_secs, webhook_url, format, source)
              VALUES (%s, 'acme', 'ledger', 'WorkflowFailure', '{"windowSecs": 1}', 0, 'http://127.0.0.1:9/', 'json',
                      'api')"""


def test_migration_24_leaves_rules_never_counted_and_keeps_the_count_that_settles(relay_db: str) -> None:
    """Migration 24 adds ``alert_rules.counted_at``: when a WorkflowFailure rule's failures were last
    counted, for the next count, on any instance, to reach back to. The rules made before it, and
    those an instance of the earlier release still running makes after it (its insert leaves the
    column out), have none: their next count reaches back one check interval, as before. A count
    keeps its moment as its evaluation settles, and a reading older than one settled first keeps
    nothing (it changes nothing else either)."""
    assert migrate(relay_db, [m for m in MIGRATIONS if m.version <= 23])[-1] == 23
    with psycopg.connect(relay_db) as conn:
        conn.execute("INSERT INTO orgs (name) VALUES ('acme')")
        conn.execute("INSERT INTO apps (org, name, executor_timeout_secs) VALUES ('acme', 'ledger', 5)")
        conn.execute(OLD_RULE, ("before",))
    assert migrate(relay_db, [m for m in MIGRATIONS if m.version <= 24]) == [24]
    with psycopg.connect(relay_db) as conn:
        conn.execute(OLD_RULE, ("still-old",))
    migrate(relay_db)  # the later migrations, under which the code below runs

    async def counted() -> tuple[list[float | None], list[float | None]]:
        async with leased(relay_db) as db:  # a settle commits only under a lease
            store = AlertStore(db)
            found = [await store.counted_at(rule_id) for rule_id in ("before", "still-old")]
            record = await store.get_rule("before")
            assert record is not None
            older, newer = await store.reading(), await store.reading()
            await store.settle(record.rule(), [], 0.0, newer, counted_at=1_700_000_000.25)
            await store.settle(record.rule(), [], 0.0, older, counted_at=1_700_000_009.0)  # stale: kept nothing
            return found, [await store.counted_at(rule_id) for rule_id in ("before", "still-old")]

    found, kept = asyncio.run(counted())
    assert found == [None, None]
    assert kept == [1_700_000_000.25, None]


def test_migration_25_keeps_a_runs_language_and_lists_an_older_runs_from_its_record_while_there(relay_db: str) -> None:
    """Migration 25 adds ``recovery_languages``: a run's language, taken from its executor's record
    as it opens: the record is deleted by the run that succeeds, or replaced as its executor
    reconnects, and the run could then no longer say which language it waited for. A run an earlier
    release opened (it writes no language) gives its record's while the record is there, and none
    once it is gone; a run deleted (retention) takes its language with it."""
    assert migrate(relay_db, [m for m in MIGRATIONS if m.version <= 24])[-1] == 24
    old_run = """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                 VALUES (%s, 'acme', 'ledger', %s, 'v1', 1, 'grace_period', 'waiting_for_peer')"""
    with psycopg.connect(relay_db) as conn:
        conn.execute("INSERT INTO orgs (name) VALUES ('acme')")
        conn.execute("INSERT INTO apps (org, name, executor_timeout_secs) VALUES ('acme', 'ledger', 5)")
        for executor in ("old-kept", "old-gone", "new"):
            conn.execute(
                """INSERT INTO executors (org, app, executor_id, state, application_version, language, epoch,
                                          connected_at, disconnected_at, dead_at, relay_instance)
                   VALUES ('acme', 'ledger', %s, 'DEAD', 'v1', 'typescript', 1, now(), now(), now(), 'relay-1')""",
                (executor,),
            )
        conn.execute(old_run, ("run-old-kept", "old-kept"))
        conn.execute(old_run, ("run-old-gone", "old-gone"))
    assert migrate(relay_db) == [m.version for m in MIGRATIONS if m.version >= 25]

    async def languages() -> dict[str, str | None]:
        async with leased(relay_db) as db:  # a run opens only under a lease
            executors = ExecutorStore(db)
            store = RecoveryStore(db, executors)
            key = ExecutorKey("acme", "ledger", "new")
            assert await store.open(RecoveryRef(key, 1, recovery_id(key, 1)), "grace_period") == "v1"
            async with db.transaction() as conn:  # as a run that succeeded deletes them
                await conn.execute("DELETE FROM executors WHERE executor_id IN ('new', 'old-gone')")
            languages = {r.executor_id: r.language for r in await store.get("acme", "ledger")}
            async with db.transaction() as conn:  # as retention deletes runs, knowing of no languages
                await conn.execute("DELETE FROM recoveries WHERE executor_id = 'new'")
                cur = await conn.execute("SELECT count(*) AS n FROM recovery_languages")
                assert (await cur.fetchone()) == {"n": 0}
            return languages

    assert asyncio.run(languages()) == {"old-kept": "typescript", "old-gone": None, "new": "typescript"}


# The columns of ``recoveries`` that the release before reads with ``SELECT *`` into its RecoveryRow
# (relay/store/recoveries.py, ``recovery_page``), which takes no other.
RECOVERY_COLUMNS_OF_THE_RELEASE_BEFORE = {
    "id", "org", "app", "executor_id", "application_version", "epoch", "run", "trigger", "status", "error",
    "created_at", "updated_at",
}  # fmt: skip


def test_recoveries_keeps_the_columns_the_release_before_lists_its_runs_with(relay_db: str) -> None:
    """In a rolling upgrade, instances of the release before run on the migrated database and list
    recovery runs as ``SELECT r.*`` into a row type of these columns: a column added to ``recoveries``
    fails every listing of theirs (the API's, the console's). What a run gains goes in a table of its
    own (``recovery_languages``, migration 25)."""
    migrate(relay_db)
    with psycopg.connect(relay_db) as conn:
        rows = conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'recoveries'"
        ).fetchall()
    assert {name for (name,) in rows} == RECOVERY_COLUMNS_OF_THE_RELEASE_BEFORE
