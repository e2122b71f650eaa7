"""Recovery records, their attempts and the audit log.

Each method is one fenced transaction (:meth:`relay.db.Database.fenced`:
refused unless this instance holds its lease) that makes a state change of the executor
(a guarded UPDATE on state and epoch) together with the recovery row and the
audit entries that describe it. The recovery workflow calls them from its
steps; a step re-run after a crash finds the change already made (and the
audit entries already there, by their dedupe key) and reports the same result.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from relay.db import Database
from relay.registry import ExecutorKey


@dataclass(frozen=True)
class AuditEntry:
    action: str
    actor: str
    executor_id: str | None = None
    peer_executor_id: str | None = None
    detail: dict[str, Any] | None = None
    dedupe_key: str | None = None


async def write_audit(conn: psycopg.AsyncConnection[Any], org: str, app: str | None, entry: AuditEntry) -> None:
    await conn.execute(
        """INSERT INTO audit_log (org, app, action, executor_id, peer_executor_id, actor, detail, dedupe_key)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (dedupe_key) DO NOTHING""",
        (
            org,
            app,
            entry.action,
            entry.executor_id,
            entry.peer_executor_id,
            entry.actor,
            Jsonb(entry.detail or {}),
            entry.dedupe_key,
        ),
    )


async def audit_executor(
    conn: psycopg.AsyncConnection[Any],
    key: ExecutorKey,
    action: str,
    dedupe: str,
    *,
    peer: str | None = None,
    detail: dict[str, Any] | None = None,
    actor: str = "relay",
) -> None:
    """An audit entry about one executor, written in the caller's transaction."""
    await write_audit(conn, key.org, key.app, AuditEntry(action, actor, key.executor_id, peer, detail, dedupe))


def recovery_id(key: ExecutorKey, epoch: int) -> str:
    """The recovery workflow's id: one recovery per death of an executor connection."""
    return f"recovery:{key.org}:{key.app}:{key.executor_id}:{epoch}"


def grace_id(key: ExecutorKey, epoch: int) -> str:
    """The grace-period workflow's id: one per disconnection."""
    return f"grace:{key.org}:{key.app}:{key.executor_id}:{epoch}"


@dataclass(frozen=True)
class RecoveryRow:
    id: str
    org: str
    app: str
    executor_id: str
    application_version: str
    epoch: int
    trigger: str
    status: str
    error: str | None
    created_at: datetime
    updated_at: datetime
    attempts: list[dict[str, Any]]


class RecoveryStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def audit(self, org: str, app: str | None, entry: AuditEntry) -> None:
        async with self.db.fenced() as conn:
            await write_audit(conn, org, app, entry)

    async def declare_dead(self, key: ExecutorKey, epoch: int, actor: str, dedupe: str) -> bool:
        """DISCONNECTED -> DEAD for this epoch. True if it is DEAD (or beyond) at this epoch now."""
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """UPDATE executors SET state = 'DEAD', dead_at = now()
                   WHERE org = %s AND app = %s AND executor_id = %s AND state = 'DISCONNECTED' AND epoch = %s
                   RETURNING application_version""",
                (key.org, key.app, key.executor_id, epoch),
            )
            row = await cur.fetchone()
            if row is None:
                return await self._at_epoch(conn, key, epoch, ("DEAD", "RECOVERING"))
            await audit_executor(conn, key, "executor.dead", dedupe, detail={"epoch": epoch}, actor=actor)
            return True

    async def open(self, rid: str, key: ExecutorKey, epoch: int, trigger: str) -> str | None:
        """Create the recovery row (once); returns the dead executor's version, None if it is gone."""
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                "SELECT application_version FROM executors WHERE org = %s AND app = %s AND executor_id = %s",
                (key.org, key.app, key.executor_id),
            )
            row = await cur.fetchone()
            if row is None:
                cur = await conn.execute("SELECT application_version FROM recoveries WHERE id = %s", (rid,))
                row = await cur.fetchone()
                return None if row is None else str(row["application_version"])
            await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, trigger, status)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, 'dispatching') ON CONFLICT (id) DO NOTHING""",
                (rid, key.org, key.app, key.executor_id, row["application_version"], epoch, trigger),
            )
            return str(row["application_version"])

    async def still_dead(self, key: ExecutorKey, epoch: int) -> bool:
        async with self.db.connection() as conn:
            return await self._at_epoch(conn, key, epoch, ("DEAD", "RECOVERING"))

    async def set_blocked(self, rid: str, key: ExecutorKey, epoch: int, reason: str, status: str, dedupe: str) -> None:
        action = f"recovery.{status}"
        async with self.db.fenced() as conn:
            await conn.execute(
                """UPDATE executors SET blocked_reason = %s
                   WHERE org = %s AND app = %s AND executor_id = %s AND epoch = %s AND state = 'DEAD'""",
                (reason, key.org, key.app, key.executor_id, epoch),
            )
            await self._status(conn, rid, status, None)
            await audit_executor(conn, key, action, dedupe, detail={"reason": reason})

    async def dispatch(
        self,
        rid: str,
        key: ExecutorKey,
        epoch: int,
        attempt: int,
        peer: str,
        mode: str,
        failover_from: str | None,
        backoff_secs: float,
        dedupe: str,
    ) -> bool:
        """DEAD -> RECOVERING and the attempt recorded; False if the executor is no longer dead."""
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """UPDATE executors SET state = 'RECOVERING', blocked_reason = NULL
                   WHERE org = %s AND app = %s AND executor_id = %s AND state = 'DEAD' AND epoch = %s""",
                (key.org, key.app, key.executor_id, epoch),
            )
            if cur.rowcount == 0 and not await self._at_epoch(conn, key, epoch, ("RECOVERING",)):
                return False
            await conn.execute(
                """INSERT INTO recovery_attempts (recovery_id, attempt, peer_executor_id, mode, outcome)
                   VALUES (%s, %s, %s, %s, 'dispatched') ON CONFLICT DO NOTHING""",
                (rid, attempt, peer, mode),
            )
            await self._status(conn, rid, "dispatching", None)
            detail = {"attempt": attempt, "mode": mode, "recoveryId": rid}
            if failover_from is not None:
                await audit_executor(
                    conn,
                    key,
                    "recovery.failover",
                    f"{dedupe}:failover",
                    peer=peer,
                    detail={**detail, "fromPeer": failover_from, "backoffSecs": backoff_secs},
                )
            await audit_executor(conn, key, "recovery.dispatched", f"{dedupe}:dispatched", peer=peer, detail=detail)
            return True

    async def fail_attempt(
        self, rid: str, key: ExecutorKey, epoch: int, attempt: int, peer: str, error: str, dedupe: str
    ) -> None:
        """RECOVERING -> DEAD, the attempt marked failed."""
        async with self.db.fenced() as conn:
            await conn.execute(
                """UPDATE executors SET state = 'DEAD'
                   WHERE org = %s AND app = %s AND executor_id = %s AND state = 'RECOVERING' AND epoch = %s""",
                (key.org, key.app, key.executor_id, epoch),
            )
            await conn.execute(
                """UPDATE recovery_attempts SET outcome = 'failed', error = %s, at = now()
                   WHERE recovery_id = %s AND attempt = %s""",
                (error, rid, attempt),
            )
            await audit_executor(
                conn,
                key,
                "recovery.failed",
                dedupe,
                peer=peer,
                detail={"attempt": attempt, "error": error, "recoveryId": rid},
            )

    async def succeed(self, rid: str, key: ExecutorKey, epoch: int, attempt: int, peer: str, dedupe: str) -> bool:
        """The attempt succeeded: delete the executor's record (if still this epoch's). Returns whether deleted."""
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """DELETE FROM executors
                   WHERE org = %s AND app = %s AND executor_id = %s AND state = 'RECOVERING' AND epoch = %s""",
                (key.org, key.app, key.executor_id, epoch),
            )
            deleted = cur.rowcount == 1
            await conn.execute(
                """UPDATE recovery_attempts SET outcome = 'succeeded', at = now()
                   WHERE recovery_id = %s AND attempt = %s""",
                (rid, attempt),
            )
            await self._status(conn, rid, "succeeded", None)
            detail = {"attempt": attempt, "recoveryId": rid}
            await audit_executor(conn, key, "recovery.succeeded", f"{dedupe}:succeeded", peer=peer, detail=detail)
            if deleted:
                await audit_executor(conn, key, "executor.deleted", f"{dedupe}:deleted", peer=peer, detail=detail)
            return deleted

    async def abandon(self, rid: str, key: ExecutorKey, reason: str, dedupe: str) -> None:
        """The executor came back (or vanished): this recovery ends without deleting anything."""
        async with self.db.fenced() as conn:
            await self._status(conn, rid, "failed", reason)
            await audit_executor(
                conn, key, "recovery.failed", dedupe, detail={"error": reason, "recoveryId": rid, "final": True}
            )

    async def get(
        self, org: str, app: str, rid: str | None = None, executor_id: str | None = None
    ) -> list[RecoveryRow]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT r.*, COALESCE(json_agg(json_build_object(
                          'attempt', a.attempt, 'peerExecutorId', a.peer_executor_id, 'mode', a.mode,
                          'outcome', a.outcome, 'error', a.error, 'at', a.at) ORDER BY a.attempt)
                          FILTER (WHERE a.attempt IS NOT NULL), '[]') AS attempts
                   FROM recoveries r LEFT JOIN recovery_attempts a ON a.recovery_id = r.id
                   WHERE r.org = %s AND r.app = %s AND (%s::text IS NULL OR r.id = %s)
                     AND (%s::text IS NULL OR r.executor_id = %s)
                   GROUP BY r.id ORDER BY r.created_at, r.id""",
                (org, app, rid, rid, executor_id, executor_id),
            )
            rows = await cur.fetchall()
        return [RecoveryRow(**row) for row in rows]

    async def blocked_in_app(self, org: str, app: str) -> list[str]:
        """Ids of this app's recoveries that wait for a peer or an operator."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT id FROM recoveries WHERE org = %s AND app = %s
                   AND status IN ('waiting_for_peer', 'awaiting_operator')""",
                (org, app),
            )
            return [str(r["id"]) for r in await cur.fetchall()]

    async def apps_with_blocked(self) -> list[tuple[str, str]]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT DISTINCT org, app FROM recoveries WHERE status IN ('waiting_for_peer', 'awaiting_operator')"
            )
            return [(str(r["org"]), str(r["app"])) for r in await cur.fetchall()]

    async def list_audit(
        self, org: str, app: str | None, executor_id: str | None, since: datetime | None, limit: int
    ) -> list[dict[str, Any]]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT id, at, org, app, action, executor_id, peer_executor_id, actor, detail
                   FROM audit_log WHERE org = %s AND (%s::text IS NULL OR app = %s)
                   AND (%s::text IS NULL OR executor_id = %s) AND (%s::timestamptz IS NULL OR at >= %s)
                   ORDER BY id LIMIT %s""",
                (org, app, app, executor_id, executor_id, since, since, limit),
            )
            return list(await cur.fetchall())

    @staticmethod
    async def _status(conn: psycopg.AsyncConnection[Any], rid: str, status: str, error: str | None) -> None:
        await conn.execute(
            """UPDATE recoveries SET status = %s, error = %s, updated_at = now()
               WHERE id = %s AND status NOT IN ('succeeded', 'failed')""",
            (status, error, rid),
        )

    @staticmethod
    async def _at_epoch(
        conn: psycopg.AsyncConnection[Any], key: ExecutorKey, epoch: int, states: tuple[str, ...]
    ) -> bool:
        cur = await conn.execute(
            "SELECT state, epoch FROM executors WHERE org = %s AND app = %s AND executor_id = %s",
            (key.org, key.app, key.executor_id),
        )
        row = await cur.fetchone()
        return row is not None and row["epoch"] == epoch and row["state"] in states
