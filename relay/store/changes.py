"""What changed since a point: new audit entries (by id) and changed executors (by ``change_seq``).

Read by each instance's event poller (:mod:`relay.domain.events`), so changes
made through any instance reach the consoles connected to every instance.
Both reads are index scans: above the last number seen, and the numbers still
awaited (see :mod:`relay.core.tail`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay.store.db import Database

Row = dict[str, Any]


@dataclass(frozen=True)
class Heads:
    audit: int  # the highest audit id now
    executors: int  # the highest executor change number now
    # The last numbers drawn from the two sequences: never below a number read from them, unless
    # the database went back in time (a restore, a failover to a replica that lagged), which takes
    # its sequences back with it and reissues the numbers drawn since.
    audit_drawn: int
    executors_drawn: int
    at: datetime  # the database's time
    # When the database server answering started (pg_postmaster_start_time(), which any role may
    # call): a restore or a failover is another server start, whatever numbers were drawn since.
    server_started: datetime


class ChangeStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def heads(self) -> Heads:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT (SELECT COALESCE(max(id), 0) FROM audit_log) AS audit,
                          (SELECT COALESCE(max(change_seq), 0) FROM executors) AS executors,
                          (SELECT last_value FROM audit_log_id_seq) AS audit_drawn,
                          (SELECT last_value FROM executor_changes) AS executors_drawn,
                          now() AS at, pg_postmaster_start_time() AS server_started"""
            )
            row = await cur.fetchone()
        assert row is not None
        return Heads(
            int(row["audit"]),
            int(row["executors"]),
            int(row["audit_drawn"]),
            int(row["executors_drawn"]),
            row["at"],
            row["server_started"],
        )

    async def audit_dated(self, at: datetime) -> int:
        """The highest id of an audit entry dated ``at`` or earlier (0 if none): from the newest
        entries back, which after a restore are the few written since."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT id FROM audit_log WHERE at <= %s ORDER BY id DESC LIMIT 1", (at,))
            row = await cur.fetchone()
        return int(row["id"]) if row else 0

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
