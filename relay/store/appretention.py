"""Retention rounds of the applications' data: what each round sent, to whom, and what was left.

A round sends ``retention`` to one healthy executor of the app. The SDK runs
it in a thread of its own and answers at once (and skips a round while the
previous one still runs), so its ``success`` only says the request arrived:
the round is recorded ``dispatched``, and the next round looks at what is left
of the workflows it targeted (:meth:`AppRetentionStore.record_check`). Each
write goes with its audit entry (``retention.sent``, ``retention.skipped``,
``retention.checked``) in one fenced transaction; a step run again after a
crash finds both written.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from relay.config import MAX_SECS
from relay.core.times import us_iso
from relay.store.audit import AuditEntry, Conn, audited_detail, write_audit
from relay.store.db import Database

# The first key of the advisory lock an app's skips take (:meth:`AppRetentionStore.skipped`), the
# second being a hash of the app's org and name.
SKIPS_LOCK_CLASS = 7_310_001


@dataclass(frozen=True)
class RetentionRound:
    id: str
    org: str
    app: str
    executor_id: str | None
    status: str
    error: str | None
    gc_cutoff_epoch_ms: int | None
    gc_rows_threshold: int | None
    gc_batch_size: int | None
    timeout_cutoff_epoch_ms: int | None
    sent_at: datetime
    checked_at: datetime | None
    remaining: dict[str, Any] | None

    def parameters(self) -> dict[str, Any]:
        return {
            "gcCutoffEpochMs": self.gc_cutoff_epoch_ms,
            "gcRowsThreshold": self.gc_rows_threshold,
            "gcBatchSize": self.gc_batch_size,
            "timeoutCutoffEpochMs": self.timeout_cutoff_epoch_ms,
        }


class AppRetentionStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def dispatched(
        self, round_id: str, org: str, app: str, executor_id: str, body: dict[str, int | None], dedupe: str
    ) -> None:
        """The round's request reached ``executor_id`` (``body``: the SDK's RetentionBody)."""
        async with self.db.fenced() as conn:
            await conn.execute(
                """INSERT INTO app_retention_rounds (id, org, app, executor_id, status, gc_cutoff_epoch_ms,
                       gc_rows_threshold, gc_batch_size, timeout_cutoff_epoch_ms)
                   VALUES (%s, %s, %s, %s, 'dispatched', %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING""",
                (round_id, org, app, executor_id, body["gc_cutoff_epoch_ms"], body["gc_rows_threshold"],
                 body["gc_batch_size"], body["timeout_cutoff_epoch_ms"]),
            )  # fmt: skip
            detail = {
                "roundId": round_id,
                "result": "dispatched",
                "gcCutoffEpochMs": body["gc_cutoff_epoch_ms"],
                "gcRowsThreshold": body["gc_rows_threshold"],
                "gcBatchSize": body["gc_batch_size"],
                "timeoutCutoffEpochMs": body["timeout_cutoff_epoch_ms"],
            }
            entry = AuditEntry("retention.sent", "relay", None, executor_id, detail, dedupe)
            await write_audit(conn, org, app, entry)

    async def skipped(
        self, round_id: str, org: str, app: str, error: str, dedupe: str, again_after_secs: float
    ) -> bool:
        """No executor of the app took the round's request. Audited when the app's previous round was
        not skipped for the same reason, and again while the skips go on once the app's latest
        ``retention.skipped`` is ``again_after_secs`` old (or gone: retention prunes the audit log),
        with how long and how many rounds (``repeated``, ``skippedSince``, ``skippedRounds``). At
        every interval it was 144 entries a day at the default; once per reason, the entry was
        pruned after auditDays and nothing said the app was still skipped. Whether audited."""
        async with self.db.fenced() as conn:
            # An app's skips take their turn: rounds outlast their interval on a loaded machine, and two
            # that ended together each read the other's round as not written yet, saw the older reason,
            # and both audited the new one. (Two int keys: a space apart from the one-key locks'.)
            await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (SKIPS_LOCK_CLASS, f"{org}/{app}"))
            cur = await conn.execute(
                """SELECT status, error FROM app_retention_rounds WHERE org = %s AND app = %s AND id <> %s
                   ORDER BY sent_at DESC LIMIT 1""",
                (org, app, round_id),
            )
            previous = await cur.fetchone()
            await conn.execute(
                """INSERT INTO app_retention_rounds (id, org, app, status, error)
                   VALUES (%s, %s, %s, 'skipped', %s) ON CONFLICT (id) DO NOTHING""",
                (round_id, org, app, error),
            )
            detail: dict[str, Any] = {"roundId": round_id, "error": error}
            if previous is not None and previous["status"] == "skipped" and previous["error"] == error:
                # (read along audit_by_action: a skipping app writes one entry a day or so)
                cur = await conn.execute(
                    """SELECT detail->>'error' AS error, at > now() - make_interval(secs => %s) AS recent
                       FROM audit_log WHERE org = %s AND action = 'retention.skipped' AND app = %s
                         AND dedupe_key IS DISTINCT FROM %s
                       ORDER BY id DESC LIMIT 1""",
                    (min(again_after_secs, MAX_SECS), org, app, dedupe),
                )
                latest = await cur.fetchone()
                if latest is not None and latest["error"] == error and latest["recent"]:
                    return False
                detail.update(await _skipping(conn, org, app, error))
            entry = AuditEntry("retention.skipped", "relay", None, None, detail, dedupe)
            await write_audit(conn, org, app, entry)
            return True

    async def unchecked(self, org: str, app: str, before: str) -> RetentionRound | None:
        """The app's latest dispatched round other than ``before`` whose effect is not recorded yet."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT * FROM app_retention_rounds WHERE org = %s AND app = %s AND id <> %s
                   AND status = 'dispatched' AND checked_at IS NULL ORDER BY sent_at DESC LIMIT 1""",
                (org, app, before),
            )
            row = await cur.fetchone()
        return RetentionRound(**row) if row else None

    async def checked_under(self, dedupe: str) -> dict[str, Any] | None:
        """The detail of the check recorded under ``dedupe`` (a step's key), or None."""
        async with self.db.connection() as conn:
            return await audited_detail(conn, dedupe)

    async def record_check(self, checked: RetentionRound, remaining: dict[str, int | None], dedupe: str) -> bool:
        """What was left, seen by a later round, of the workflows ``checked`` targeted; nothing if the
        round was checked already (rounds that overlap read it unchecked alike: the first to record
        its check is the one, in its row and in the audit log). Whether this call recorded it."""
        async with self.db.fenced() as conn:
            cur = await conn.execute(
                """UPDATE app_retention_rounds SET checked_at = now(), remaining = %s
                   WHERE id = %s AND checked_at IS NULL""",
                (Jsonb(remaining), checked.id),
            )
            if cur.rowcount == 0:
                return False
            detail = {"roundId": checked.id, **checked.parameters(), "remaining": remaining}
            entry = AuditEntry("retention.checked", "relay", None, checked.executor_id, detail, dedupe)
            await write_audit(conn, checked.org, checked.app, entry)
            return True

    async def rounds(self, org: str, app: str, limit: int = 100) -> list[RetentionRound]:
        """The app's latest rounds, newest first."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT * FROM app_retention_rounds WHERE org = %s AND app = %s ORDER BY sent_at DESC LIMIT %s",
                (org, app, limit),
            )
            return [RetentionRound(**row) for row in await cur.fetchall()]


async def _skipping(conn: Conn, org: str, app: str, error: str) -> dict[str, Any]:
    """The run of the app's latest rounds skipped for ``error``: since its first (of the rounds
    still kept, auditDays) and how many."""
    cur = await conn.execute(
        """SELECT min(sent_at) AS since, count(*) AS rounds FROM app_retention_rounds
           WHERE org = %(org)s AND app = %(app)s AND sent_at > coalesce(
               (SELECT max(sent_at) FROM app_retention_rounds WHERE org = %(org)s AND app = %(app)s
                  AND (status <> 'skipped' OR error IS DISTINCT FROM %(error)s)), '-infinity')""",
        {"org": org, "app": app, "error": error},
    )
    row = await cur.fetchone()
    since = row["since"] if row else None
    return {
        "repeated": True,
        "skippedSince": us_iso(since),
        "skippedRounds": int(row["rounds"]) if row else 0,
    }
