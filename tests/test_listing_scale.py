"""The registry's listing on real PostgreSQL stays linear in the fleet, even before PostgreSQL has
analyzed its tables (a new database whose fleet has just connected)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import relay_yaml
from relay.config import RelayConfig
from relay.core.ids import ExecutorKey
from relay.store.apps import AppStore
from relay.store.audit import AuditStore, audit_page
from relay.store.db import Database
from relay.store.executors import LIST_PAGE, ExecutorStore, Handshake
from relay.store.lease import Lease
from relay.store.recoveries import _RUNS, RecoveryStore, recovery_page
from relay_protocol import ExecutorInfoReply

FLEET = 2000
PAGE = 1000
# Rows a listing may visit per executor it passes (the executor's, its remembered id's): a plan
# that reads the app's every remembered id per executor visits about as many as the app has.
ROWS_PER_EXECUTOR = 4


def _rows_visited(node: dict[str, Any]) -> int:
    """Rows the plan's nodes produced or read and threw away, over all their loops."""
    own = int(node["Actual Rows"] * node["Actual Loops"])
    removed = sum(int(node.get(k, 0)) for k in ("Rows Removed by Filter", "Rows Removed by Join Filter"))
    return own + removed + sum(_rows_visited(child) for child in node.get("Plans", []))


@asynccontextmanager
async def _migrated(url: str, *, app: bool = True) -> AsyncIterator[Database]:
    """The database at ``url`` migrated, with a relay.yaml's apps (acme/ledger) if ``app``; closed after."""
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
        if app:
            await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        yield db
    finally:
        await db.close()


async def _a_fresh_fleets_listing(url: str) -> None:
    async with _migrated(url, app=False) as db:
        # Statistics are what this test holds back: no ANALYZE may run while it does.
        async with db.connection() as conn:
            for table in ("executors", "executor_ids"):
                await conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        await AppStore(db).sync_config(RelayConfig.model_validate(relay_yaml(free_port())))
        lease = Lease(db, "relay-1", 30)
        await lease.acquire()
        executors = ExecutorStore(db)

        def handshake(i: int) -> Handshake:
            info = ExecutorInfoReply(
                request_id="r", executor_id=f"ex-{i:05}", application_version="v1", hostname="h", language="python"
            )
            return Handshake(ExecutorKey("acme", "ledger", info.executor_id), info, "relay-1", "key")

        await asyncio.gather(*(executors.connected(handshake(i)) for i in range(FLEET)))
        async with db.connection() as conn:
            cur = await conn.execute(
                "SELECT count(*) AS n FROM pg_stats WHERE tablename IN ('executors', 'executor_ids')"
            )
            row = await cur.fetchone()
            assert row is not None and row["n"] == 0, "the tables have statistics: the test shows nothing"
            for state in (None, "HEALTHY"):
                for offset in (0, PAGE):
                    params = ("acme", "ledger", state, state, PAGE, offset)
                    cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + LIST_PAGE, params)
                    explained = await cur.fetchone()
                    assert explained is not None
                    plan = next(iter(explained.values()))[0]["Plan"]
                    passed = offset + PAGE
                    assert plan["Actual Rows"] == PAGE
                    assert _rows_visited(plan) <= ROWS_PER_EXECUTOR * passed, (state, offset, _rows_visited(plan))
        # And what the listing returns: every executor, in order, with the moment its id was first seen.
        pages = [await executors.list_executors("acme", "ledger", limit=PAGE, offset=o) for o in (0, PAGE)]
        listed = [r for page in pages for r in page]
        assert [r.key.executor_id for r in listed] == [f"ex-{i:05}" for i in range(FLEET)]
        assert all(r.first_seen_at is not None for r in listed)
        await lease.stop()


def test_the_listing_of_a_fleet_just_connected_visits_each_executor_a_few_times(postgres: Postgres) -> None:
    asyncio.run(_a_fresh_fleets_listing(postgres.create_database("listing_fresh")))


RECOVERIES = 5000
RECOVERY_PAGE = 20


async def _a_long_history_of_recoveries(url: str) -> None:
    async with _migrated(url) as db:
        async with db.transaction() as conn:
            # Runs of earlier deaths, one a second, each with its attempt and its audit entries (the
            # executor.dead of its death, then the run's own), as a few mass failures leave them.
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status,
                                           run, created_at, updated_at)
                   SELECT 'rec-' || g, 'acme', 'ledger', 'ex-' || g, 'v1', g, 'grace_period', 'succeeded', 1,
                          timestamptz '2026-01-01' + make_interval(secs => g), now()
                   FROM generate_series(1, %s) AS g""",
                (RECOVERIES,),
            )
            await conn.execute(
                """INSERT INTO recovery_attempts (recovery_id, attempt, peer_executor_id, mode, outcome)
                   SELECT 'rec-' || g, 1, 'peer-' || g, 'recover', 'succeeded' FROM generate_series(1, %s) AS g""",
                (RECOVERIES,),
            )
            await conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                   SELECT 'acme', 'ledger', a, 'ex-' || g, 'relay',
                          CASE WHEN a = 'executor.dead' THEN jsonb_build_object('epoch', g)
                               ELSE jsonb_build_object('recoveryId', 'rec-' || g, 'attempt', 1) END
                   FROM generate_series(1, %s) AS g,
                        unnest(ARRAY['executor.dead', 'recovery.dispatched', 'recovery.succeeded'])
                            WITH ORDINALITY AS u(a, k)
                   ORDER BY g, k""",
                (RECOVERIES,),
            )
            await conn.execute("ANALYZE recoveries; ANALYZE recovery_attempts; ANALYZE audit_log")
        async with db.connection() as conn:
            for newest_first in (False, True):
                for offset in (0, 100):
                    sql = recovery_page(newest_first)
                    params = (
                        "acme",
                        "ledger",
                        *(None,) * 10,
                        RECOVERY_PAGE,
                        offset,
                    )  # no run id, executor, status, time, deletion
                    cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
                    explained = await cur.fetchone()
                    assert explained is not None
                    plan = next(iter(explained.values()))[0]["Plan"]
                    assert plan["Actual Rows"] == RECOVERY_PAGE
                    # The runs before and on the page (each counted by the few plan nodes it passes), and the
                    # attempts of the page: not every run of the app.
                    passed = offset + RECOVERY_PAGE
                    assert _rows_visited(plan) <= 8 * passed, (newest_first, offset, _rows_visited(plan))
        store = RecoveryStore(db, ExecutorStore(db))
        newest = await store.get("acme", "ledger", limit=RECOVERY_PAGE, offset=100, newest_first=True)
        assert [r.id for r in newest] == [f"rec-{g}" for g in range(RECOVERIES - 100, RECOVERIES - 120, -1)]
        # The largest page: each run with its own attempt and timeline, none of another run's.
        largest = await store.get("acme", "ledger", limit=1000)
        assert [r.id for r in largest] == [f"rec-{g}" for g in range(1, 1001)]
        for row in largest:
            assert [a["peerExecutorId"] for a in row.attempts] == [f"peer-{row.epoch}"]
            assert [e["action"] for e in row.history] == ["executor.dead", "recovery.dispatched", "recovery.succeeded"]
            assert row.history[0]["detail"] == {"epoch": row.epoch}
            assert all(e["detail"].get("recoveryId") == row.id for e in row.history[1:])


def test_a_page_of_recoveries_reads_the_runs_up_to_it_not_every_run_of_the_app(postgres: Postgres) -> None:
    """The console reads recoveries 20 at a time, newest first, again at each change during a mass
    failure. The listing joined and aggregated every run of the app with its attempts, then sorted
    them all, to return 20: its cost grew with every recovery retained (30,000 runs: 30,000 rows of
    each table per page), and no index had the listing's order."""
    asyncio.run(_a_long_history_of_recoveries(postgres.create_database("listing_recoveries")))


AUDIT_ROWS = 60_000
AUDIT_PAGE = 100


async def _an_audit_log_of_many_days(url: str) -> None:
    async with _migrated(url, app=False) as db:
        async with db.transaction() as conn:
            # Mostly recovery entries of three apps and 15,000 executors; a settings change now and then.
            await conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                   SELECT 'acme', (ARRAY['ledger', 'billing', 'search'])[1 + g %% 3],
                          CASE WHEN g %% 2000 = 0 THEN 'settings.updated'
                               ELSE (ARRAY['executor.dead', 'recovery.dispatched', 'recovery.succeeded'])[1 + g %% 3]
                          END,
                          'ex-' || (g %% 15000), 'relay', '{}'::jsonb
                   FROM generate_series(1, %s) AS g""",
                (AUDIT_ROWS,),
            )
            await conn.execute("ANALYZE audit_log")
        async with db.connection() as conn:
            for app in (None, "ledger"):
                params = {
                    "org": "acme",
                    "app": app,
                    "executor": None,
                    "since": None,
                    "action": "settings.updated",
                    "until": None,
                    "limit": AUDIT_PAGE,
                    "offset": 0,
                }
                cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + audit_page(True), params)
                explained = await cur.fetchone()
                assert explained is not None
                plan = next(iter(explained.values()))[0]["Plan"]
                found = int(plan["Actual Rows"])
                assert found == (AUDIT_ROWS // 2000 if app is None else AUDIT_ROWS // 2000 // 3)
                # The entries of that action, not the whole log.
                assert _rows_visited(plan) <= 8 * AUDIT_PAGE, (app, _rows_visited(plan))
        audit = AuditStore(db)
        rows = await audit.list_entries("acme", None, None, None, 5, action="settings.updated", newest_first=True)
        assert [r["action"] for r in rows] == ["settings.updated"] * 5
        assert [r["id"] for r in rows] == sorted((r["id"] for r in rows), reverse=True)


def test_the_audit_log_filtered_by_an_action_reads_that_actions_entries_not_the_whole_log(
    postgres: Postgres,
) -> None:
    """The audit page's Action filter (and ``GET /audit?action=``) on a log of 90 days of a large
    fleet's recoveries: an action that is rare there (``settings.updated``, ``relay.instance_adopted``)
    was found by reading the org's whole log newest first, at every read, and the console reads its
    first page again at each new entry (thousands a second in a mass failure)."""
    asyncio.run(_an_audit_log_of_many_days(postgres.create_database("listing_audit")))


DELETED_RUNS = 10_000
# Executor ids that come back and die again (pods' names): each has DELETED_RUNS / RETURNING runs.
RETURNING = 20
# The runs of the last hour (the newest), of the console's count.
RECENT = 20


async def _runs_that_deleted_their_executor(url: str) -> None:
    async with _migrated(url) as db:
        async with db.transaction() as conn:
            # Each run's entries (its death, its dispatch and success, its executor's record deleted),
            # every odd run's success made while its executor had connected again (the record kept).
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status,
                                           run, created_at, updated_at)
                   SELECT 'rec-' || g, 'acme', 'ledger', 'ex-' || g %% %s, 'v1', g, 'grace_period', 'succeeded', 1,
                          now() - make_interval(days => (g <= %s)::int), now() - make_interval(days => (g <= %s)::int)
                   FROM generate_series(1, %s) AS g""",
                (RETURNING, DELETED_RUNS - RECENT, DELETED_RUNS - RECENT, DELETED_RUNS),
            )
            await conn.execute(
                """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
                   SELECT 'acme', 'ledger', a, 'ex-' || g %% %s, 'relay',
                          CASE WHEN a = 'executor.dead' THEN jsonb_build_object('epoch', g)
                               ELSE jsonb_build_object('recoveryId', 'rec-' || g, 'attempt', 1) END
                   FROM generate_series(1, %s) AS g,
                        unnest(ARRAY['executor.dead', 'recovery.dispatched', 'recovery.succeeded', 'executor.deleted'])
                            WITH ORDINALITY AS u(a, k)
                   WHERE a <> 'executor.deleted' OR g %% 2 = 0
                   ORDER BY g, k""",
                (RETURNING, DELETED_RUNS),
            )
            await conn.execute("ANALYZE recoveries; ANALYZE audit_log")
        hour_ago = datetime.now(UTC) - timedelta(hours=1)
        async with db.connection() as conn:
            for deleted in (True, False):
                # The console's: the runs that succeeded in the last hour and deleted their executor.
                match = ("acme", "ledger", None, None, None, None, "succeeded", "succeeded", hour_ago, hour_ago)
                cur = await conn.execute(
                    f"EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) AS n {_RUNS}", (*match, deleted, deleted)
                )
                explained = await cur.fetchone()
                assert explained is not None
                plan = next(iter(explained.values()))[0]["Plan"]
                # Each run of the hour, and its own executor.deleted entry: not every entry of its
                # executor id, nor every executor.deleted entry of the app (hashed, as PostgreSQL
                # did here without the index: the whole history read for a count of the last hour).
                assert _rows_visited(plan) <= 10 * RECENT, (deleted, _rows_visited(plan))
        store = RecoveryStore(db, ExecutorStore(db))
        counts = [await store.count("acme", "ledger", None, None, None, d) for d in (True, False, None)]
        assert counts == [DELETED_RUNS // 2, DELETED_RUNS // 2, DELETED_RUNS]
        ex_0 = await store.get("acme", "ledger", None, "ex-0", limit=1000, executor_deleted=True)
        assert sorted(r.id for r in ex_0) == sorted(f"rec-{g}" for g in range(RETURNING, DELETED_RUNS + 1, RETURNING))


def test_the_recoveries_that_deleted_their_executor_are_found_by_their_own_entry(postgres: Postgres) -> None:
    """``executorDeleted`` (the console's recently-recovered count, every minute it is open) looked
    for each run's executor.deleted among every entry of its executor id: an id that comes back
    and dies again (a pod's name) has hundreds, read for each of its runs (200,000 runs of 2,000 ids:
    24 s a count, 0.7 s the console's), or every executor.deleted entry of the app, hashed. Found by
    the run's id along an index of those entries (migration 21)."""
    asyncio.run(_runs_that_deleted_their_executor(postgres.create_database("listing_deleted")))
