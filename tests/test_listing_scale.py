"""The registry's listing on real PostgreSQL stays linear in the fleet, even before PostgreSQL has
analyzed its tables (a new database whose fleet has just connected)."""

from __future__ import annotations

import asyncio
from typing import Any

from harness.ports import free_port
from harness.postgres import Postgres
from harness.relay import relay_yaml
from relay.config import RelayConfig
from relay.core.ids import ExecutorKey
from relay.store.apps import AppStore
from relay.store.db import Database
from relay.store.executors import LIST_PAGE, ExecutorStore, Handshake
from relay.store.lease import Lease
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


async def _a_fresh_fleets_listing(url: str) -> None:
    db = Database(url)
    await db.open()
    try:
        await db.migrate()
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
    finally:
        await db.close()


def test_the_listing_of_a_fleet_just_connected_visits_each_executor_a_few_times(postgres: Postgres) -> None:
    asyncio.run(_a_fresh_fleets_listing(postgres.create_database("listing_fresh")))
