"""What changed since a point: new audit entries (by id) and changed executors (by ``change_seq``).

Read by each instance's event poller (:mod:`relay.domain.events`), so changes
made through any instance reach the consoles connected to every instance.
Both reads are index scans: above the last number seen, and the numbers still
awaited (see :mod:`relay.core.tail`).
"""

from __future__ import annotations

from typing import Any

from relay.store.db import Database

Row = dict[str, Any]


class ChangeStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def heads(self) -> tuple[int, int]:
        """The highest audit id and executor change number now."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT (SELECT COALESCE(max(id), 0) FROM audit_log) AS audit,
                          (SELECT COALESCE(max(change_seq), 0) FROM executors) AS executors"""
            )
            row = await cur.fetchone()
        assert row is not None
        return int(row["audit"]), int(row["executors"])

    async def audit_after(self, after: int, gaps: list[int], limit: int) -> list[Row]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """(SELECT id, at, org, app, action, executor_id, peer_executor_id FROM audit_log
                    WHERE id > %s ORDER BY id LIMIT %s)
                   UNION ALL
                   SELECT id, at, org, app, action, executor_id, peer_executor_id FROM audit_log
                   WHERE id = ANY(%s::bigint[])""",
                (after, limit, gaps),
            )
            return list(await cur.fetchall())

    async def executors_after(self, after: int, gaps: list[int], limit: int) -> list[Row]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """(SELECT change_seq, org, app, executor_id, state, blocked_reason, relay_instance FROM executors
                    WHERE change_seq > %s ORDER BY change_seq LIMIT %s)
                   UNION ALL
                   SELECT change_seq, org, app, executor_id, state, blocked_reason, relay_instance FROM executors
                   WHERE change_seq = ANY(%s::bigint[])""",
                (after, limit, gaps),
            )
            return list(await cur.fetchall())
