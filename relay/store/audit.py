"""The audit log: one row per action Relay or an operator took (contract rule 6).

Entries are written in the transaction of the change they describe. A
workflow step that runs again after a crash writes its entries again with
the same dedupe key, and the second insert does nothing.

An entry an API key made (its actor ``api:<name>``) records the address the request came from
(:func:`requested_from`, set for each request by the API); the entries of Relay itself and of
executors' connections have none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TypeAlias, get_args

import psycopg
from psycopg.types.json import Jsonb

from relay.core.ids import ExecutorKey
from relay.store.db import Database

Conn = psycopg.AsyncConnection[dict[str, Any]]

# The client address of the HTTP request being served, if any: the writes made while serving it
# (and the tasks it starts, which copy the context) record it on its key's entries.
_source_ip: ContextVar[str | None] = ContextVar("relay_audit_source_ip", default=None)


@contextmanager
def requested_from(address: str | None) -> Iterator[None]:
    """Entries an API key makes in this block record ``address`` as where the request came from."""
    token = _source_ip.set(address)
    try:
        yield
    finally:
        _source_ip.reset(token)


# Every action Relay audits, the one list of them: ``GET /audit?action=`` refuses any other (a typo
# read as "nothing happened") and the OpenAPI document gives it as the parameter's values. The
# console's Action filter has its own copy (relay/static/console-pages.js), which a test compares
# with this one. An entry's action has this type, so mypy (in ./test.sh) refuses a writer whose
# action is not listed, naming it, or is a string it cannot tell (an f-string, a plain ``str``):
# one forgotten here would be written and then not found by the filter. write_audit does not refuse
# at run time: an entry of a change already made (or a recovery's step) is not to fail for a list.
AuditAction: TypeAlias = Literal[
    "executor.dead", "recovery.dispatched", "recovery.failed", "recovery.failover", "recovery.waiting_for_peer",
    "recovery.awaiting_operator", "recovery.workflow_moved", "recovery.succeeded", "recovery.restarted",
    "recovery.manual_requested", "executor.deleted", "reconcile.found", "reconcile.recovered",
    "workflow.cancel", "workflow.resume", "workflow.fork", "workflow.delete", "workflow.import",
    "workflow.bulk_cancel", "workflow.bulk_resume", "workflow.bulk_delete", "workflow.bulk_fork_from_failure",
    "schedule.pause", "schedule.resume", "schedule.trigger", "schedule.backfill",
    "application.create", "application.delete", "application.set_latest_version", "settings.updated",
    "retention.sent", "retention.skipped", "retention.checked",
    "alert.sent", "alert.failed", "alert.resolved", "alerting_rule.create", "alerting_rule.delete",
    "token.created", "token.renamed", "token.deleted", "relay.instance_adopted",
]  # fmt: skip
ACTIONS: tuple[AuditAction, ...] = get_args(AuditAction)


@dataclass(frozen=True)
class AuditEntry:
    action: AuditAction
    actor: str
    executor_id: str | None = None
    peer_executor_id: str | None = None
    detail: dict[str, Any] | None = None
    dedupe_key: str | None = None


async def write_audit(conn: Conn, org: str, app: str | None, entry: AuditEntry) -> bool:
    """Write an entry in the caller's transaction; False if its dedupe key was written before."""
    # Only a key's entries: a request may also start work of Relay's own (a recovery) whose entries
    # are Relay's, wherever it was started from.
    source_ip = _source_ip.get() if entry.actor.startswith("api:") else None
    cur = await conn.execute(
        """INSERT INTO audit_log (org, app, action, executor_id, peer_executor_id, actor, detail, dedupe_key,
                                  source_ip)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (dedupe_key) DO NOTHING""",
        (
            org,
            app,
            entry.action,
            entry.executor_id,
            entry.peer_executor_id,
            entry.actor,
            Jsonb(entry.detail or {}),
            entry.dedupe_key,
            source_ip,
        ),
    )
    return cur.rowcount == 1


async def audited_detail(conn: Conn, dedupe: str) -> dict[str, Any] | None:
    """The detail of the entry written under ``dedupe``, or None if there is none (a step that runs
    again after a crash finds what it did)."""
    cur = await conn.execute("SELECT detail FROM audit_log WHERE dedupe_key = %s", (dedupe,))
    row = await cur.fetchone()
    return None if row is None else dict(row["detail"])


async def audit_executor(
    conn: Conn,
    key: ExecutorKey,
    action: AuditAction,
    dedupe: str | None,
    *,
    peer: str | None = None,
    detail: dict[str, Any] | None = None,
    actor: str = "relay",
) -> bool:
    """An audit entry about one executor, written in the caller's transaction; False if written before."""
    return await write_audit(conn, key.org, key.app, AuditEntry(action, actor, key.executor_id, peer, detail, dedupe))


def audit_page(newest_first: bool) -> str:
    """A page of an org's entries, filtered (parameters by name: org, app, executor, since, action,
    until, limit, offset; None for a filter not given)."""
    order = "DESC" if newest_first else "ASC"
    return f"""SELECT id, at, org, app, action, executor_id, peer_executor_id, actor, detail
               FROM audit_log WHERE org = %(org)s AND (%(app)s::text IS NULL OR app = %(app)s)
               AND (%(executor)s::text IS NULL OR executor_id = %(executor)s)
               AND (%(since)s::timestamptz IS NULL OR at >= %(since)s)
               AND (%(action)s::text IS NULL OR action = %(action)s)
               AND (%(until)s::bigint IS NULL OR id <= %(until)s)
               ORDER BY id {order} LIMIT %(limit)s OFFSET %(offset)s"""


class AuditStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def write(self, org: str, app: str | None, entry: AuditEntry) -> None:
        """An entry on its own, for an API action (bound to no instance's ownership)."""
        async with self.db.transaction() as conn:
            await write_audit(conn, org, app, entry)

    async def record(self, org: str, app: str | None, entry: AuditEntry) -> None:
        """An entry on its own, fenced: written by a workflow step of this instance."""
        await self.db.writes.run(lambda conn: write_audit(conn, org, app, entry))

    async def list_entries(
        self,
        org: str,
        app: str | None,
        executor_id: str | None,
        since: datetime | None,
        limit: int,
        offset: int = 0,
        action: str | None = None,
        newest_first: bool = False,
        until_id: int | None = None,
    ) -> list[dict[str, Any]]:
        """One page of entries; ``until_id`` (the first page's newest id) keeps later pages of a
        newest-first listing where they were when it was read: entries written since do not shift
        them by their number."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                audit_page(newest_first),
                {
                    "org": org,
                    "app": app,
                    "executor": executor_id,
                    "since": since,
                    "action": action,
                    "until": until_id,
                    "limit": limit,
                    "offset": offset,
                },
            )
            return list(await cur.fetchall())

    async def find(self, org: str, match: AuditMatch, limit: int, offset: int) -> list[dict[str, Any]]:
        """Entries newest first, as Conductor's audit-log listing filters them (``GET .../audit-logs``)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT id, at, org, app, action, executor_id, peer_executor_id, actor, detail, source_ip
                   FROM audit_log WHERE org = %(org)s
                   AND (%(start)s::timestamptz IS NULL OR at >= %(start)s)
                   AND (%(end)s::timestamptz IS NULL OR at < %(end)s)
                   AND (%(actions)s::text[] IS NULL OR action = ANY(%(actions)s))
                   AND (%(subject)s::text IS NULL OR actor = %(subject)s OR actor = 'api:' || %(subject)s)
                   AND (%(target)s::text IS NULL OR executor_id = %(target)s OR app = %(target)s
                        OR detail -> 'workflowIds' ? %(target)s OR detail ->> 'newWorkflowId' = %(target)s
                        OR detail ->> 'scheduleName' = %(target)s OR detail ->> 'ruleId' = %(target)s
                        OR detail ->> 'tokenName' = %(target)s OR detail ->> 'versionName' = %(target)s)
                   AND (%(apps)s::text[] IS NULL OR app = ANY(%(apps)s))
                   ORDER BY id DESC LIMIT %(limit)s OFFSET %(offset)s""",
                {
                    "org": org,
                    "start": match.start,
                    "end": match.end,
                    "actions": match.actions,
                    "subject": match.subject,
                    "target": match.target,
                    "apps": match.apps,
                    "limit": limit,
                    "offset": offset,
                },
            )
            return list(await cur.fetchall())


@dataclass(frozen=True)
class AuditMatch:
    """What Conductor's audit-log listing filters on; None: any. ``apps`` bounds a key scoped to apps."""

    start: datetime | None = None
    end: datetime | None = None
    actions: list[str] | None = None
    subject: str | None = None
    target: str | None = None
    apps: list[str] | None = None
