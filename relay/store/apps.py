"""Orgs, keys and apps: what relay.yaml and the API configure.

The executors table has its own store (:mod:`relay.store.executors`); this one
only reads it, to count an app's executors by state.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from relay.config import DEFAULT_EXECUTOR_TIMEOUT_SECS, RelayConfig
from relay.core.lifecycle import ExecutorState
from relay.store.audit import AuditEntry, write_audit
from relay.store.db import Database

Conn = psycopg.AsyncConnection[dict[str, Any]]

log = logging.getLogger("relay.apps")
# The advisory lock of :meth:`AppStore.sync_config` (relay.store.keys and relay.store.alerts have their own).
# A start takes it first, and holds it while it syncs the rules and keys too (relay.store.configsync).
APPS_LOCK_KEY = 7_215_420_113_004
# The apps to register of those a transaction found missing (:meth:`AppStore.hold`), each with its
# audit entry: called with the missing apps in key order, on the transaction's connection.
Registrar = Callable[[Conn, list[tuple[str, str]]], Awaitable[Mapping[tuple[str, str], AuditEntry]]]
# The settings relay.yaml gives an app, in sync_config's order, as the file names them.
SETTING_NAMES = (
    "executorTimeoutSecs",
    "recoverToLatestVersion",
    "gcTimeThresholdMs",
    "gcRowsThreshold",
    "globalTimeoutMs",
)


@dataclass(frozen=True)
class AppRecord:
    org: str
    name: str
    executor_timeout_secs: float
    recover_to_latest_version: bool
    counts: dict[ExecutorState, int]
    created_at: datetime | None = None
    languages: set[str] = field(default_factory=set)
    # Executors by application version and state, and those blocked by reason (the console's overview).
    versions: dict[str, dict[str, int]] = field(default_factory=dict)
    blocked: dict[str, int] = field(default_factory=dict)
    retention: AppRetention = field(default_factory=lambda: AppRetention(None, None, None))

    def settings(self) -> dict[str, Any]:
        timeout = self.executor_timeout_secs
        return {
            # Conductor's clients read an integer (an int64 in its schema); Relay allows fractions.
            "executorTimeoutSecs": int(timeout) if timeout.is_integer() else timeout,
            "recoverToLatestVersion": self.recover_to_latest_version,
            "gcTimeThresholdMs": self.retention.gc_time_threshold_ms,
            "gcRowsThreshold": self.retention.gc_rows_threshold,
            "globalTimeoutMs": self.retention.global_timeout_ms,
        }


@dataclass(frozen=True)
class AppRetention:
    """An app's retention settings, as DBOS Conductor's (None: off)."""

    gc_time_threshold_ms: int | None
    gc_rows_threshold: int | None
    global_timeout_ms: int | None

    @property
    def on(self) -> bool:
        return any(v is not None for v in (self.gc_time_threshold_ms, self.gc_rows_threshold, self.global_timeout_ms))


RETENTION_COLUMNS = ("gc_time_threshold_ms", "gc_rows_threshold", "global_timeout_ms")


@dataclass(frozen=True)
class AppSettings:
    """An app's settings alone: what grace periods, recoveries and retention read (one row, no counts)."""

    executor_timeout_secs: float
    recover_to_latest_version: bool
    retention: AppRetention


class AppStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    @asynccontextmanager
    async def _connection(self, conn: Conn | None) -> AsyncIterator[Conn]:
        if conn is not None:
            yield conn
            return
        async with self.db.connection() as own:
            yield own

    async def sync_config(self, config: RelayConfig, conn: Conn | None = None) -> None:
        """Make orgs and configured apps in the database match relay.yaml (in ``conn``'s transaction,
        if given: a start's, which syncs the rules and keys too, :func:`relay.store.configsync.sync_config`).

        App settings from the file are written only when the app is first seen:
        later changes come through the API (PATCH) and must survive a restart. ``from_config``
        says which apps the file lists (an app the file lists cannot be deleted through the API:
        its executors would bring it back with default settings and without the file's rules);
        an app taken out of the file loses it, as a key taken out of the file is removed.
        """
        async with self.db.transaction(conn) as conn:
            # One instance's sync at a time: two whose files list the apps in another order (or not the
            # same apps: a file being rolled out) each locked an app the other waited for, and one
            # failed to start.
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (APPS_LOCK_KEY,))
            # Apps in key order (org, then name), as a batch of handshakes registers those it finds
            # missing (AppStore.hold): in the file's order, each inserted an app the other then inserted
            # too, and PostgreSQL failed one of them (this start, or the batch).
            for org in sorted(config.orgs, key=lambda o: o.name):
                await conn.execute("INSERT INTO orgs (name) VALUES (%s) ON CONFLICT DO NOTHING", (org.name,))
                for app in sorted(org.apps, key=lambda a: a.name):
                    wanted = (app.executor_timeout_secs, app.recover_to_latest_version, app.gc_time_threshold_ms,
                              app.gc_rows_threshold, app.global_timeout_ms)  # fmt: skip
                    cur = await conn.execute(
                        """INSERT INTO apps (org, name, executor_timeout_secs, recover_to_latest_version,
                                             gc_time_threshold_ms, gc_rows_threshold, global_timeout_ms,
                                             from_config)
                           VALUES (%s, %s, %s, %s, %s, %s, %s, true)
                           ON CONFLICT (org, name) DO UPDATE SET from_config = true
                           RETURNING executor_timeout_secs, recover_to_latest_version, gc_time_threshold_ms,
                                     gc_rows_threshold, global_timeout_ms""",
                        (org.name, app.name, *wanted),
                    )  # fmt: skip
                    row = await cur.fetchone()
                    held = tuple(row.values()) if row else wanted
                    if held != wanted:
                        # The database's settings stand (a PATCH must survive a restart); say so, or
                        # the file would read as in force.
                        log.warning(
                            "relay.yaml's settings of app %s/%s differ from those in force (%s), which were "
                            "set through the API or when the app was first registered; those stand: "
                            "PATCH /v2/orgs/%s/apps/%s to change them",
                            org.name,
                            app.name,
                            ", ".join(
                                f"{name} {h!r}, not {w!r}"
                                for name, h, w in zip(SETTING_NAMES, held, wanted, strict=True)
                                if h != w
                            ),
                            org.name,
                            app.name,
                        )
                await conn.execute(
                    "UPDATE apps SET from_config = false WHERE org = %s AND from_config AND NOT (name = ANY(%s))",
                    (org.name, [app.name for app in org.apps]),
                )
            # And the apps of an org taken out of the file (orgs: [] takes out all): they kept it, and
            # the API refused to delete them for a file that no longer lists them.
            await conn.execute(
                "UPDATE apps SET from_config = false WHERE from_config AND NOT (org = ANY(%s))",
                ([org.name for org in config.orgs],),
            )

    async def exists(self, org: str, app: str) -> bool:
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT 1 FROM apps WHERE org = %s AND name = %s", (org, app))
            return await cur.fetchone() is not None

    @staticmethod
    async def hold(conn: Conn, apps: list[tuple[str, str]], register: Registrar | None = None) -> set[tuple[str, str]]:
        """Lock ``apps`` (org, name) against deletion for the caller's transaction (``FOR KEY SHARE``,
        which writing an executor's row takes anyway), registering with default settings those that
        are missing and ``register`` (asked, in this transaction, only if some are) gives an entry,
        each audited with its entry (``application.create``) in this transaction (an app another
        transaction registered first is not audited here); returns those that exist, locked.

        The executor's row is written in the same transaction: an app's deletion either commits
        first (the app is then registered again here, or missing) or waits for that commit and finds
        the executor (409). Locked, and registered, in the order of their keys (org, name), as every path
        that locks or inserts several (relay.yaml's sync: :meth:`sync_config`).
        """
        wanted = sorted(set(apps))
        orgs, names = [o for o, _ in wanted], [n for _, n in wanted]
        held: set[tuple[str, str]] = set()
        for _ in range(3):  # an app registered here may be deleted again before it is locked: rare
            cur = await conn.execute(
                """SELECT a.org, a.name FROM apps a JOIN unnest(%s::text[], %s::text[]) AS w(org, name)
                   ON a.org = w.org AND a.name = w.name
                   ORDER BY a.org COLLATE "C", a.name COLLATE "C" FOR KEY SHARE OF a""",
                (orgs, names),
            )
            held = {(str(r["org"]), str(r["name"])) for r in await cur.fetchall()}
            missing = sorted(set(wanted) - held)
            entries = await register(conn, missing) if missing and register is not None else {}
            missing = sorted(entries)
            if not missing:
                break
            cur = await conn.execute(
                """INSERT INTO apps (org, name, executor_timeout_secs)
                   SELECT org, name, %s FROM unnest(%s::text[], %s::text[]) AS m(org, name)
                   ON CONFLICT DO NOTHING RETURNING org, name""",
                (DEFAULT_EXECUTOR_TIMEOUT_SECS, [o for o, _ in missing], [n for _, n in missing]),
            )
            for row in sorted((str(r["org"]), str(r["name"])) for r in await cur.fetchall()):
                await write_audit(conn, row[0], row[1], entries[row])
        return held

    async def list_apps(
        self,
        org: str,
        app: str | None = None,
        conn: Conn | None = None,
        limit: int = 1,
        offset: int = 0,
        among: frozenset[str] | None = None,
        blocked_first: bool = False,
    ) -> list[AppRecord]:
        """One app, or a page of them (by name; ``among`` those apps if given; with
        ``blocked_first``, apps with a blocked recovery before the others, each part by name), with
        their executors counted by state."""
        names = sorted(among) if among is not None else None
        async with self._connection(conn) as c:
            cur = await c.execute(
                """WITH page AS (
                       SELECT p.*, %s AND EXISTS (SELECT 1 FROM executors x WHERE x.org = p.org
                                 AND x.app = p.name AND x.blocked_reason IS NOT NULL) AS first
                       FROM apps p WHERE org = %s AND (%s::text IS NULL OR name = %s)
                         AND (%s::text[] IS NULL OR name = ANY(%s))
                       ORDER BY first DESC, name LIMIT %s OFFSET %s)
                   SELECT a.name, a.executor_timeout_secs, a.recover_to_latest_version, a.created_at,
                          a.gc_time_threshold_ms, a.gc_rows_threshold, a.global_timeout_ms,
                          e.state, count(e.executor_id) AS n
                   FROM page a LEFT JOIN executors e ON e.org = a.org AND e.app = a.name
                   GROUP BY a.first, a.name, a.executor_timeout_secs, a.recover_to_latest_version, a.created_at,
                            a.gc_time_threshold_ms, a.gc_rows_threshold, a.global_timeout_ms, e.state
                   ORDER BY a.first DESC, a.name""",
                (blocked_first, org, app, app, names, names, limit, offset),
            )
            rows = await cur.fetchall()
            names_on_page = sorted({row["name"] for row in rows})
            cur = await c.execute(
                """SELECT app, application_version, state, blocked_reason, language, count(*) AS n FROM executors
                   WHERE org = %s AND app = ANY(%s::text[])
                   GROUP BY app, application_version, state, blocked_reason, language""",
                (org, names_on_page),
            )
            detail = await cur.fetchall()
        apps: dict[str, AppRecord] = {}
        for row in rows:
            record = apps.get(row["name"])
            if record is None:
                record = AppRecord(
                    org=org,
                    name=row["name"],
                    executor_timeout_secs=row["executor_timeout_secs"],
                    recover_to_latest_version=row["recover_to_latest_version"],
                    counts={s: 0 for s in ExecutorState},
                    created_at=row["created_at"],
                    retention=AppRetention(*(row[c] for c in RETENTION_COLUMNS)),
                )
                apps[row["name"]] = record
            if row["state"] is not None:
                record.counts[ExecutorState(row["state"])] = int(row["n"])
        for row in detail:
            record = apps[row["app"]]
            by_state = record.versions.setdefault(row["application_version"], {})
            by_state[row["state"]] = by_state.get(row["state"], 0) + int(row["n"])
            if row["language"]:
                record.languages.add(row["language"])
            if row["blocked_reason"] is not None:
                reason = row["blocked_reason"]
                record.blocked[reason] = record.blocked.get(reason, 0) + int(row["n"])
        return list(apps.values())

    async def with_retention(self) -> list[tuple[str, str]]:
        """(org, app) of every app with a retention setting on."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, name FROM apps WHERE gc_time_threshold_ms IS NOT NULL
                   OR gc_rows_threshold IS NOT NULL OR global_timeout_ms IS NOT NULL ORDER BY org, name"""
            )
            return [(str(r["org"]), str(r["name"])) for r in await cur.fetchall()]

    async def settings_of(self, org: str, app: str) -> AppSettings | None:
        """The app's settings, without counting its executors (``get`` counts them by state and
        version: a group failure of a big app would count every executor once per death)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"""SELECT executor_timeout_secs, recover_to_latest_version, {", ".join(RETENTION_COLUMNS)}
                    FROM apps WHERE org = %s AND name = %s""",
                (org, app),
            )
            row = await cur.fetchone()
        if row is None:
            return None
        return AppSettings(
            executor_timeout_secs=row["executor_timeout_secs"],
            recover_to_latest_version=row["recover_to_latest_version"],
            retention=AppRetention(*(row[c] for c in RETENTION_COLUMNS)),
        )

    async def get(self, org: str, app: str, conn: Conn | None = None) -> AppRecord | None:
        apps = await self.list_apps(org, app, conn)
        return apps[0] if apps else None

    async def register(self, conn: Conn, org: str, app: str) -> bool:
        """An app registered ahead of its executors (``PUT``); False if it was there already."""
        cur = await conn.execute(
            """INSERT INTO apps (org, name, executor_timeout_secs) VALUES (%s, %s, %s)
               ON CONFLICT DO NOTHING""",
            (org, app, DEFAULT_EXECUTOR_TIMEOUT_SECS),
        )
        return cur.rowcount == 1

    @staticmethod
    async def lock_listed(conn: Conn, org: str, app: str) -> bool | None:
        """Lock the app's row for the caller's transaction (which deletes it, or changes the settings
        of one it found there); whether relay.yaml lists it, None if there is no such app. Locked, a
        sync of relay.yaml cannot list it meanwhile: the sync waits, and registers it again once it is
        deleted."""
        cur = await conn.execute("SELECT from_config FROM apps WHERE org = %s AND name = %s FOR UPDATE", (org, app))
        row = await cur.fetchone()
        return None if row is None else bool(row["from_config"])

    @staticmethod
    async def delete(conn: Conn, org: str, app: str) -> bool:
        """Forget an app that has no executor in the registry; False if it has one (or does not exist)."""
        cur = await conn.execute(
            """DELETE FROM apps a WHERE org = %s AND name = %s
               AND NOT EXISTS (SELECT 1 FROM executors e WHERE e.org = a.org AND e.app = a.name)""",
            (org, app),
        )
        return cur.rowcount == 1

    @staticmethod
    async def update(conn: Conn, org: str, app: str, changes: dict[str, Any]) -> bool:
        """Change settings in the caller's transaction (which writes the audit entry too)."""
        columns = {"executor_timeout_secs", "recover_to_latest_version", *RETENTION_COLUMNS}
        assert set(changes) <= columns
        sets = ", ".join(f"{name} = %({name})s" for name in changes)
        cur = await conn.execute(
            f"UPDATE apps SET {sets}, updated_at = now() WHERE org = %(org)s AND name = %(app)s",
            {**changes, "org": org, "app": app},
        )
        return cur.rowcount == 1
