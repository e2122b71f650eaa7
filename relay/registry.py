"""The registry: orgs, keys, apps and executors as rows in PostgreSQL.

Every change of an executor's state goes through :meth:`Registry.transition`
or :meth:`Registry.connected`: a guarded UPDATE whose WHERE names the states
the lifecycle allows (and the epoch where the caller knows it), with
timestamps taken from the database. A row count of zero means somebody else
moved first, and the caller is told so instead of overwriting. Writes bound to
what this instance owns are fenced by its lease (:meth:`Database.fenced`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from relay.config import DEFAULT_EXECUTOR_TIMEOUT_SECS, RelayConfig
from relay.db import Database
from relay.lifecycle import ExecutorEvent, ExecutorState, check_transition, states_allowing
from relay.protocol import ExecutorInfo


@dataclass(frozen=True)
class ExecutorKey:
    org: str
    app: str
    executor_id: str

    def __str__(self) -> str:
        return f"{self.org}/{self.app}/{self.executor_id}"


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
        )


@dataclass(frozen=True)
class AppRecord:
    org: str
    name: str
    executor_timeout_secs: float
    recover_to_latest_version: bool
    counts: dict[ExecutorState, int]


CONNECT_BATCH = 500
# (org, app, executor_info, relay instance) and the future awaiting its epoch.
_PendingConnect = tuple[tuple[str, str, ExecutorInfo, str], "asyncio.Future[tuple[int, int | None]]"]


class Registry:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._connect_queue: list[_PendingConnect] = []
        self._connect_writer: asyncio.Task[None] | None = None

    async def sync_config(self, config: RelayConfig) -> None:
        """Make orgs, keys and configured apps in the database match relay.yaml.

        Keys not in the file are removed, so that revoking a key is editing the
        file and restarting. App settings from the file are written only when
        the app is first seen: later changes come through the API (PATCH) and
        must survive a restart.
        """
        async with self.db.connection() as conn, conn.transaction():
            for org in config.orgs:
                await conn.execute("INSERT INTO orgs (name) VALUES (%s) ON CONFLICT DO NOTHING", (org.name,))
                for app in org.apps:
                    await conn.execute(
                        """INSERT INTO apps (org, name, executor_timeout_secs,
                                             recover_to_latest_version, from_config)
                           VALUES (%s, %s, %s, %s, true) ON CONFLICT DO NOTHING""",
                        (org.name, app.name, app.executor_timeout_secs, app.recover_to_latest_version),
                    )
            wanted = [
                (key.sha256, org.name, kind, key.name, getattr(key, "role", None))
                for org in config.orgs
                for kind, keys in (("conductor", org.conductor_keys), ("api", org.api_keys))
                for key in keys
            ]
            await conn.execute("DELETE FROM keys WHERE NOT (sha256 = ANY(%s))", ([w[0] for w in wanted],))
            for row in wanted:
                await conn.execute(
                    """INSERT INTO keys (sha256, org, kind, name, role) VALUES (%s, %s, %s, %s, %s)
                       ON CONFLICT (sha256) DO UPDATE SET org = EXCLUDED.org, kind = EXCLUDED.kind,
                           name = EXCLUDED.name, role = EXCLUDED.role, updated_at = now()""",
                    row,
                )

    async def ensure_app(self, org: str, app: str) -> None:
        """Register an app not listed in relay.yaml, with default settings."""
        async with self.db.connection() as conn:
            await conn.execute(
                """INSERT INTO apps (org, name, executor_timeout_secs) VALUES (%s, %s, %s)
                   ON CONFLICT DO NOTHING""",
                (org, app, DEFAULT_EXECUTOR_TIMEOUT_SECS),
            )

    async def connected(self, org: str, app: str, info: ExecutorInfo, instance: str) -> tuple[int, int | None]:
        """Record a completed handshake; returns the connection's epoch and the one before it.

        A new executor id gets a new record; a known one returns to HEALTHY in
        the same record with a new epoch (from a sequence: epochs never repeat),
        so that the old connection's late close (same id, older epoch) cannot
        mark it DISCONNECTED.

        Handshakes that arrive while a write is in flight are written together
        in one statement: a thousand executors reconnecting at once cost a few
        round trips, not a thousand.
        """
        future: asyncio.Future[tuple[int, int | None]] = asyncio.get_running_loop().create_future()
        self._connect_queue.append(((org, app, info, instance), future))
        if self._connect_writer is None or self._connect_writer.done():
            self._connect_writer = asyncio.create_task(self._write_connects())
        return await future

    async def _write_connects(self) -> None:
        while self._connect_queue:
            batch: list[_PendingConnect] = []
            later: list[_PendingConnect] = []
            seen: set[tuple[str, str, str]] = set()
            for item in self._connect_queue[:CONNECT_BATCH]:
                key = (item[0][0], item[0][1], item[0][2].executor_id)
                # One statement may not touch a row twice: the same id twice waits a round.
                (later if key in seen else batch).append(item)
                seen.add(key)
            self._connect_queue = later + self._connect_queue[CONNECT_BATCH:]
            try:
                epochs = await self._upsert_connected([item[0] for item in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (org, app, info, _), future in batch:
                epoch = epochs.get((org, app, info.executor_id))
                if future.done():
                    continue
                if epoch is None:  # every state allows CONNECTED today; kept as the guard's contract
                    future.set_exception(RuntimeError(f"executor {org}/{app}/{info.executor_id} refused"))
                else:
                    future.set_result(epoch)

    async def _upsert_connected(
        self, rows: list[tuple[str, str, ExecutorInfo, str]]
    ) -> dict[tuple[str, str, str], tuple[int, int | None]]:
        allowed = [s.value for s in states_allowing(ExecutorEvent.CONNECTED)]
        columns: list[list[Any]] = [[] for _ in range(9)]
        for org, app, info, instance in rows:
            values = (
                org,
                app,
                info.executor_id,
                info.application_version,
                info.hostname,
                info.language,
                info.dbos_version,
                Jsonb(info.metadata) if info.metadata is not None else None,
                instance,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """INSERT INTO executors AS e (org, app, executor_id, state, application_version,
                        hostname, language, dbos_version, metadata, connected_at, relay_instance)
                   SELECT org, app, id, 'HEALTHY', version, hostname, language, dbos_version, metadata,
                        now(), instance
                   FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[],
                               %s::text[], %s::jsonb[], %s::text[])
                        AS t(org, app, id, version, hostname, language, dbos_version, metadata, instance)
                   ON CONFLICT (org, app, executor_id) DO UPDATE SET
                        state = 'HEALTHY', epoch = EXCLUDED.epoch, previous_epoch = e.epoch,
                        application_version = EXCLUDED.application_version,
                        hostname = EXCLUDED.hostname, language = EXCLUDED.language,
                        dbos_version = EXCLUDED.dbos_version, metadata = EXCLUDED.metadata,
                        connected_at = now(), dead_at = NULL, blocked_reason = NULL,
                        relay_instance = EXCLUDED.relay_instance
                   WHERE e.state = ANY(%s)
                   RETURNING org, app, executor_id, epoch, previous_epoch""",
                (*columns, allowed),
            )
            return {
                (r["org"], r["app"], r["executor_id"]): (int(r["epoch"]), r["previous_epoch"])
                for r in await cur.fetchall()
            }

    async def transition(
        self, key: ExecutorKey, event: ExecutorEvent, *, epoch: int | None = None, instance: str | None = None
    ) -> bool:
        """Apply ``event`` if the row is still in a state that allows it.

        ``epoch`` and ``instance``, when given, must match too. Returns whether
        the row changed.
        """
        allowed = states_allowing(event)
        target = check_transition(allowed[0], event)
        stamp = {
            ExecutorState.DISCONNECTED: ", disconnected_at = now()",
            ExecutorState.DEAD: ", dead_at = now()",
        }.get(target, "")
        query = (
            f"UPDATE executors SET state = %(target)s{stamp} "
            "WHERE org = %(org)s AND app = %(app)s AND executor_id = %(id)s "
            "AND state = ANY(%(allowed)s) "
            "AND (%(epoch)s::bigint IS NULL OR epoch = %(epoch)s) "
            "AND (%(instance)s::text IS NULL OR relay_instance = %(instance)s)"
        )
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                query,
                {
                    "target": target.value,
                    "org": key.org,
                    "app": key.app,
                    "id": key.executor_id,
                    "allowed": [s.value for s in allowed],
                    "epoch": epoch,
                    "instance": instance,
                },
            )
            return cur.rowcount == 1

    async def disconnect_instance(self, instance: str) -> int:
        """Mark every executor this instance held as DISCONNECTED (start-up, shutdown).

        After a crash the sockets are gone but their rows still say HEALTHY.
        """
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """UPDATE executors SET state = 'DISCONNECTED', disconnected_at = now()
                   WHERE relay_instance = %s AND state = 'HEALTHY'""",
                (instance,),
            )
            return cur.rowcount

    async def get_executor(self, key: ExecutorKey) -> ExecutorRecord | None:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT * FROM executors WHERE org = %s AND app = %s AND executor_id = %s",
                (key.org, key.app, key.executor_id),
            )
            row = await cur.fetchone()
        return ExecutorRecord.from_row(row) if row else None

    async def list_executors(self, org: str, app: str, state: ExecutorState | None = None) -> list[ExecutorRecord]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT * FROM executors WHERE org = %s AND app = %s
                   AND (%s::text IS NULL OR state = %s) ORDER BY connected_at, executor_id""",
                (org, app, state.value if state else None, state.value if state else None),
            )
            rows = await cur.fetchall()
        return [ExecutorRecord.from_row(row) for row in rows]

    async def list_apps(self, org: str, app: str | None = None) -> list[AppRecord]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT a.name, a.executor_timeout_secs, a.recover_to_latest_version,
                          e.state, count(e.executor_id) AS n
                   FROM apps a LEFT JOIN executors e ON e.org = a.org AND e.app = a.name
                   WHERE a.org = %s AND (%s::text IS NULL OR a.name = %s)
                   GROUP BY a.name, a.executor_timeout_secs, a.recover_to_latest_version, e.state
                   ORDER BY a.name""",
                (org, app, app),
            )
            rows = await cur.fetchall()
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
                )
                apps[row["name"]] = record
            if row["state"] is not None:
                record.counts[ExecutorState(row["state"])] = int(row["n"])
        return list(apps.values())

    async def healthy_peers(self, org: str, app: str) -> list[tuple[str, str]]:
        """(executor id, application version) of the app's HEALTHY executors, leaving out those
        whose instance's lease ran out: their sockets died with it."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT e.executor_id, e.application_version FROM executors e
                   JOIN relay_instances i ON i.instance_id = e.relay_instance AND i.lease_expires_at > now()
                   WHERE e.org = %s AND e.app = %s AND e.state = 'HEALTHY' ORDER BY e.executor_id""",
                (org, app),
            )
            return [(r["executor_id"], r["application_version"]) for r in await cur.fetchall()]

    async def disconnected_of_instance(self, instance: str) -> list[tuple[ExecutorKey, int]]:
        """DISCONNECTED executors this instance owns: each needs a grace period running."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT org, app, executor_id, epoch FROM executors
                   WHERE relay_instance = %s AND state = 'DISCONNECTED'""",
                (instance,),
            )
            return [(ExecutorKey(r["org"], r["app"], r["executor_id"]), int(r["epoch"])) for r in await cur.fetchall()]

    async def update_app(self, org: str, app: str, changes: dict[str, Any]) -> bool:
        columns = {"executor_timeout_secs", "recover_to_latest_version"}
        assert set(changes) <= columns
        sets = ", ".join(f"{name} = %({name})s" for name in changes)
        async with self.db.connection() as conn:
            cur = await conn.execute(
                f"UPDATE apps SET {sets}, updated_at = now() WHERE org = %(org)s AND name = %(app)s",
                {**changes, "org": org, "app": app},
            )
            return cur.rowcount == 1

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
