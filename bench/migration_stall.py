"""What migrations 16 and 17 cost the writes of instances still running during a rolling upgrade.

On a database at schema 15 whose audit log holds ``--rows`` entries (spread over ``--apps`` apps
and ``--executors`` executors), a writer inserts audit entries one transaction at a time, as an
instance of an earlier release does (0.2.0's ``INSERT ... ON CONFLICT (dedupe_key) DO NOTHING``),
while this code migrates to its newest schema. Run twice, on two databases: with 16 and 17 as they
are (indexes built ``CONCURRENTLY``, outside the migrations' transaction), and with the same
indexes built by plain ``CREATE INDEX`` inside the transaction (how 16 was first written). Printed:
the migration's seconds, the writes made meanwhile and the longest one.

Then the plan of the audit filter by executor without an app (``GET /audit?executorId=``,
:func:`relay.store.audit.audit_page`), with ``EXPLAIN ANALYZE``, with and without migration 17's
index, and the server's version.

Usage, from the project root::

    python -m bench.migration_stall [--rows 300000]

PostgreSQL is embedded. Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any
from unittest import mock

import psycopg
from psycopg.types.json import Jsonb

from bench.common import print_machine
from harness.postgres import Postgres
from relay.store import db as db_module
from relay.store.audit import audit_page
from relay.store.db import Database
from relay.store.migrations import MIGRATIONS, Migration

OLD_AUDIT_INSERT = """INSERT INTO audit_log (org, app, action, executor_id, peer_executor_id, actor, detail, dedupe_key)
                      VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (dedupe_key) DO NOTHING"""


# 0.2.0's relay/registry.py, Registry.connected (its other columns left to their defaults).
OLD_CONNECTED = """INSERT INTO executors AS e (org, app, executor_id, state, application_version, connected_at,
                        relay_instance)
                   VALUES ('acme', 'app-0', %s, 'HEALTHY', 'v1', now(), 'relay-old')
                   ON CONFLICT (org, app, executor_id) DO UPDATE SET state = 'HEALTHY', epoch = e.epoch + 1,
                        connected_at = now(), relay_instance = EXCLUDED.relay_instance"""


def as_one_transaction(migrations: list[Migration]) -> list[Migration]:
    """``migrations`` with each migration of indexes written as plain SQL, run in the transaction."""
    return [
        Migration(m.version, "".join(f"CREATE INDEX IF NOT EXISTS {i.name} ON {i.on};" for i in m.indexes))
        if m.indexes
        else m
        for m in migrations
    ]


async def migrate(url: str, migrations: list[Migration]) -> list[int]:
    """Migrate ``url`` as a release with ``migrations`` would."""
    with mock.patch.object(db_module, "MIGRATIONS", migrations):
        db = Database(url, min_size=1, max_size=1)
        await db.open()
        try:
            return await db.migrate()
        finally:
            await db.close()


def seed(url: str, rows: int, apps: int, executors: int) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            """INSERT INTO audit_log (org, app, action, executor_id, actor, detail)
               SELECT 'acme', 'app-' || (i %% %s), (ARRAY['executor.connected', 'executor.disconnected',
                      'executor.dead', 'recovery.dispatched', 'recovery.succeeded'])[1 + i %% 5],
                      'ex-' || (i %% %s), 'relay', '{}'::jsonb
               FROM generate_series(1, %s) AS i""",
            (apps, executors, rows),
        )
        conn.execute(
            """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
               SELECT 'r-' || i, 'acme', 'app-' || (i %% %s), 'ex-' || i, 'v1', i, 'grace_period', 'succeeded'
               FROM generate_series(1, %s) AS i""",
            (apps, rows // 10),
        )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE audit_log")
        conn.execute("VACUUM ANALYZE recoveries")


def old_release_writes(url: str, stop: threading.Event, latencies: list[tuple[float, float]]) -> None:
    """0.2.0's writes as an executor connects: its record (upserted), then an audit entry."""
    with psycopg.connect(url, autocommit=True) as conn:
        n = 0
        while not stop.is_set():
            n += 1
            began = time.perf_counter()
            conn.execute(OLD_CONNECTED, (f"old-{n % 50}",))
            conn.execute(
                OLD_AUDIT_INSERT,
                ("acme", "app-0", "executor.connected", f"old-{n}", None, "relay", Jsonb({}), f"old:{n}"),
            )
            latencies.append((began, time.perf_counter() - began))
            time.sleep(0.002)


def stall(pg: Postgres, mode: str, rows: int, apps: int, executors: int, base: int) -> str:
    url = pg.create_database(f"stall_{mode}")
    asyncio.run(migrate(url, [m for m in MIGRATIONS if m.version <= base]))
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO orgs (name) VALUES ('acme')")
        conn.execute("INSERT INTO apps (org, name, executor_timeout_secs) VALUES ('acme', 'app-0', 30)")
    seed(url, rows, apps, executors)
    latencies: list[tuple[float, float]] = []
    stop = threading.Event()
    writer = threading.Thread(target=old_release_writes, args=(url, stop, latencies))
    writer.start()
    time.sleep(0.5)
    began = time.perf_counter()
    applied = asyncio.run(migrate(url, MIGRATIONS if mode == "concurrently" else as_one_transaction(MIGRATIONS)))
    took = time.perf_counter() - began
    time.sleep(0.3)
    stop.set()
    writer.join()
    # Every write begun while the migration ran, however long after it the write ended.
    during = [latency for start, latency in latencies if began <= start <= began + took]
    assert applied == [m.version for m in MIGRATIONS if m.version > base], applied
    return (
        f"{mode:>13}: migrated {base + 1} to {applied[-1]} in {took:.2f} s; {len(during)} writes meanwhile, "
        f"the longest {max(during) * 1000:.0f} ms (median {sorted(during)[len(during) // 2] * 1000:.1f} ms)"
    )


def plans(url: str, executors: int) -> None:
    params: dict[str, Any] = {
        "org": "acme",
        "app": None,
        "executor": f"ex-{executors // 2}",
        "since": None,
        "action": None,
        "until": None,
        "limit": 100,
        "offset": 0,
    }
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT version()").fetchone()
        print(f"server: {row[0] if row else '?'}")
        for with_17 in (True, False):
            label = (
                "with audit_by_executor_id (17)" if with_17 else "without it (16; PostgreSQL 18 skips over the apps)"
            )
            for newest_first in (False, True):
                # Twice: the second run reads a warm cache.
                for _ in range(2):
                    rows = conn.execute(
                        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + audit_page(newest_first), params
                    ).fetchall()
                order = "DESC" if newest_first else "ASC"
                print(f"--- executor without app, id {order}, {label}")
                for (line,) in rows:
                    print(f"    {line}")
            if with_17:
                conn.execute("DROP INDEX audit_by_executor_id")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--apps", type=int, default=50)
    parser.add_argument("--executors", type=int, default=2_000)
    parser.add_argument("--base", type=int, default=15, help="the schema migrated from (2: Relay 0.2.0's)")
    args = parser.parse_args()
    print_machine()
    pg = Postgres()
    try:
        for mode in ("transaction", "concurrently"):
            print(stall(pg, mode, args.rows, args.apps, args.executors, args.base), flush=True)
        url = pg.create_database("plans")
        asyncio.run(migrate(url, MIGRATIONS[:15]))
        seed(url, args.rows, args.apps, args.executors)
        asyncio.run(migrate(url, MIGRATIONS))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("ANALYZE audit_log")
        plans(url, args.executors)
    finally:
        pg.close()


if __name__ == "__main__":
    main()
