"""Recovery records and their attempts.

Each write is one fenced transaction (:meth:`relay.store.db.Database.fenced`:
refused unless this instance holds its lease) that makes a state change of the executor
(an event of the lifecycle table, through the executor store) together with the recovery row and the
audit entries that describe it. The recovery workflow calls them from its
steps; a step re-run after a crash finds the change already made (and the
audit entries already there, by their dedupe key) and reports the same result.

The recovery pipeline's figures (:mod:`relay.store.pipeline`) are observed
here, where each stage is first recorded, after the commit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg

from relay.core.failover import Dispatch
from relay.core.ids import ExecutorKey, RecoveryRef, printable
from relay.core.lifecycle import ExecutorEvent, ExecutorState
from relay.logs import about
from relay.store.audit import AuditAction, audit_executor
from relay.store.db import Database
from relay.store.executors import ExecutorStore
from relay.store.pipeline import RecoveryPipeline, observe

E = ExecutorEvent
# The statuses a recovery waits in, each audited as its own action.
BlockedStatus = Literal["waiting_for_peer", "awaiting_operator"]
Conn = psycopg.AsyncConnection[dict[str, Any]]
# What an operator follows in the log besides the audit log: a death and how its recovery goes, one
# line each (the connection's own lines say connected, DISCONNECTED; relay.net.connection).
log = logging.getLogger("relay.recovery")


def _about(ref: RecoveryRef) -> dict[str, Any]:
    return about(ref.key, recoveryId=ref.rid)


# One executor's row at one epoch (for the pipeline's timestamps), and an attempt's time to its reply.
_ROW = "WHERE org = %(org)s AND app = %(app)s AND executor_id = %(id)s AND epoch = %(epoch)s"
_TO_REPLY = "extract(epoch FROM replied_at - dispatched_at) AS to_reply"
# The NOTIFY channel every instance listens on for recoveries that begin to wait (payload: org, app).
BLOCKED_CHANNEL = "relay_blocked"
# Why a recovery ends without recovering (abandon): its executor is back, or its record was deleted
# by another run of the same death that finished. Said apart: one message for both read as a
# failure, where an executor back needs nothing more.
EXECUTOR_BACK = "the executor reconnected: it is back, so there is nothing to recover for it"
EXECUTOR_GONE = "the executor's record is gone: another recovery run of this death finished and deleted it"


def _row_params(key: ExecutorKey, epoch: int) -> dict[str, Any]:
    return {"org": key.org, "app": key.app, "id": key.executor_id, "epoch": epoch}


@dataclass(frozen=True)
class RecoveryRow:
    id: str
    org: str
    app: str
    executor_id: str
    application_version: str
    epoch: int
    run: int
    trigger: str
    status: str
    error: str | None
    created_at: datetime
    updated_at: datetime
    attempts: list[dict[str, Any]]
    # The dead executor's language, as its handshake gave it (None: it gave none; or the run was opened
    # by a release before migration 25 and the record of that death is gone).
    language: str | None
    # The audit entries of this run, oldest first, and the executor.dead of its death: its timeline.
    history: list[dict[str, Any]] = field(default_factory=list)


# The runs of an app a listing filters (parameters: org, app, a run's id or None twice, an executor
# id or None twice, a status or None twice, a time their last change is not before or None twice).
_RUNS = """FROM recoveries WHERE org = %s AND app = %s AND (%s::text IS NULL OR id = %s)
             AND (%s::text IS NULL OR executor_id = %s) AND (%s::text IS NULL OR status = %s)
             AND (%s::timestamptz IS NULL OR updated_at >= %s)
             AND (%s::boolean IS NULL OR %s = EXISTS (
                 SELECT 1 FROM audit_log d
                 WHERE d.org = recoveries.org AND d.app = recoveries.app AND d.executor_id = recoveries.executor_id
                   AND d.action = 'executor.deleted' AND d.detail->>'recoveryId' = recoveries.id))"""
# (The last filter: whether the run deleted its executor's record, as its ``executor.deleted`` entry
# says. A run that succeeded while its executor had connected again kept the record: ``recordKept``.)


def recovery_page(newest_first: bool) -> str:
    """A page of an app's runs with their attempts (parameters: those of ``_RUNS``, limit, offset).
    The page is cut first, along the index of the listing's order (``recoveries_by_created``), and
    only its runs' attempts and languages are read (a run's language kept as it opened, migration 25,
    or, for a run an earlier release opened, its executor's record's while that is there): a page
    costs the runs up to it, not every run the app has had."""
    order = "DESC" if newest_first else "ASC"
    return f"""WITH page AS (
                   SELECT * {_RUNS}
                   ORDER BY created_at {order}, run {order}, id {order} LIMIT %s OFFSET %s)
               SELECT r.*, COALESCE((
                   SELECT json_agg(json_build_object(
                       'attempt', a.attempt, 'peerExecutorId', a.peer_executor_id, 'mode', a.mode,
                       'outcome', a.outcome, 'error', a.error, 'at', a.at) ORDER BY a.attempt)
                   FROM recovery_attempts a WHERE a.recovery_id = r.id), '[]') AS attempts,
                   coalesce((SELECT l.language FROM recovery_languages l WHERE l.recovery_id = r.id),
                            (SELECT nullif(e.language, '') FROM executors e
                             WHERE e.org = r.org AND e.app = r.app AND e.executor_id = r.executor_id
                               AND e.epoch = r.epoch)) AS language
               FROM page r ORDER BY r.created_at {order}, r.run {order}, r.id {order}"""


class RecoveryStore:
    def __init__(self, db: Database, executors: ExecutorStore, pipeline: RecoveryPipeline | None = None) -> None:
        self.db = db
        self.executors = executors
        self.pipeline = pipeline or RecoveryPipeline()

    async def declare_dead(
        self, key: ExecutorKey, epoch: int, event: ExecutorEvent, actor: str, dedupe: str | None
    ) -> bool:
        """DISCONNECTED -> DEAD for this epoch (the grace period ran out, or an operator said so).

        True if it is DEAD (or beyond) at this epoch now: a step re-run after a
        crash finds its own change made.
        """
        dead, _ = await self._declare_dead(key, epoch, event, actor, dedupe)
        return dead

    async def declare_dead_now(
        self, key: ExecutorKey, epoch: int, event: ExecutorEvent, actor: str, dedupe: str | None
    ) -> bool:
        """:meth:`declare_dead`, True only if this call declared it: the row was DISCONNECTED at
        ``epoch`` until now. (Not if the executor was DEAD at that epoch already: the repair sweep's
        rows may be older than the grace period's declaration.)"""
        _, declared = await self._declare_dead(key, epoch, event, actor, dedupe)
        return declared

    async def _declare_dead(
        self, key: ExecutorKey, epoch: int, event: ExecutorEvent, actor: str, dedupe: str | None
    ) -> tuple[bool, bool]:
        """(DEAD or beyond at this epoch now, declared by this call)."""

        async def write(conn: Conn) -> tuple[bool, bool, object]:
            if not await self.executors.apply(key, event, epoch=epoch, conn=conn):
                states = (ExecutorState.DEAD, ExecutorState.RECOVERING)
                return await self.executors.at_epoch(conn, key, epoch, states), False, None
            await audit_executor(conn, key, "executor.dead", dedupe, detail={"epoch": epoch}, actor=actor)
            cur = await conn.execute(
                f"SELECT extract(epoch FROM dead_at - disconnected_at) AS secs FROM executors {_ROW}",
                _row_params(key, epoch),
            )
            row = await cur.fetchone()
            return True, True, (row["secs"] if row else None)

        dead, declared, secs = await self.executors.combined(write, key)
        if secs is not None:
            observe(self.pipeline.disconnect_to_dead, secs)
        if declared:
            log.info("executor %s is DEAD (epoch %d): no connection for its grace period", key, epoch, extra=about(key))
        return dead, declared

    async def open(self, ref: RecoveryRef, trigger: str, dedupe: str | None = None) -> str | None:
        """Create the recovery row (once); returns the dead executor's version, None if it is gone.

        A later run (``ref.run`` > 1) takes over from the runs before it, whose
        workflows ended without finishing: their rows are marked ``failed``
        (they would otherwise say ``dispatching`` or ``waiting_for_peer``
        forever), and ``recovery.restarted`` is audited.
        """

        async def write(conn: Conn) -> str | None:
            version = await self.executors.version_of(conn, ref.key)
            if version is None:
                cur = await conn.execute("SELECT application_version FROM recoveries WHERE id = %s", (ref.rid,))
                row = await cur.fetchone()
                return None if row is None else str(row["application_version"])
            key = ref.key
            whose = (key.org, key.app, key.executor_id)
            cur = await conn.execute(
                """INSERT INTO recoveries (id, org, app, executor_id, application_version, epoch, run, trigger, status)
                   VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'dispatching') ON CONFLICT (id) DO NOTHING""",
                (ref.rid, *whose, version, ref.epoch, ref.run, trigger),
            )
            if cur.rowcount == 1:
                # Its executor's language, kept for the run: the record goes when the run succeeds.
                await conn.execute(
                    """INSERT INTO recovery_languages (recovery_id, language)
                       SELECT %s, language FROM executors
                       WHERE org = %s AND app = %s AND executor_id = %s AND epoch = %s AND language <> ''""",
                    (ref.rid, *whose, ref.epoch),
                )
            if cur.rowcount == 1 and ref.run > 1:
                await self._take_over(conn, ref, trigger, dedupe)
            return version

        return await self.executors.combined(write, ref.key)

    async def _take_over(self, conn: Conn, ref: RecoveryRef, trigger: str, dedupe: str | None) -> None:
        key = ref.key
        cur = await conn.execute(
            """UPDATE recoveries SET status = 'failed', error = %s, updated_at = now()
               WHERE org = %s AND app = %s AND executor_id = %s AND epoch = %s AND run < %s
                 AND status NOT IN ('succeeded', 'failed')
               RETURNING id""",
            (f"its workflow ended without finishing; run {ref.run} took over",
             key.org, key.app, key.executor_id, ref.epoch, ref.run),
        )  # fmt: skip
        ended = sorted(str(r["id"]) for r in await cur.fetchall())
        detail = {"recoveryId": ref.rid, "run": ref.run, "trigger": trigger, "endedRuns": ended}
        await audit_executor(conn, key, "recovery.restarted", dedupe, detail=detail)

    async def recorded(self, rid: str) -> bool:
        """Whether the run's record exists yet (its workflow's first step writes it)."""
        async with self.db.connection() as conn:
            cur = await conn.execute("SELECT 1 FROM recoveries WHERE id = %s", (rid,))
            return await cur.fetchone() is not None

    async def first_step(self, rid: str) -> str | None:
        """The name of the first step DBOS recorded for this recovery workflow (None: none yet),
        which tells the shape of steps the run was started with (workflows/recovery.py)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT function_name FROM dbos.operation_outputs WHERE workflow_uuid = %s
                   ORDER BY function_id LIMIT 1""",
                (rid,),
            )
            row = await cur.fetchone()
        return None if row is None else str(row["function_name"])

    async def latest_runs(self, deaths: list[tuple[ExecutorKey, int]]) -> dict[tuple[ExecutorKey, int], int]:
        """The highest run recorded for each of these deaths (a run's row is written by its first step)."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT r.org, r.app, r.executor_id, r.epoch, max(r.run) AS run
                   FROM recoveries r
                   JOIN unnest(%s::text[], %s::text[], %s::text[], %s::bigint[]) AS d(org, app, executor_id, epoch)
                     ON r.org = d.org AND r.app = d.app AND r.executor_id = d.executor_id AND r.epoch = d.epoch
                   GROUP BY r.org, r.app, r.executor_id, r.epoch""",
                (
                    [k.org for k, _ in deaths],
                    [k.app for k, _ in deaths],
                    [k.executor_id for k, _ in deaths],
                    [e for _, e in deaths],
                ),
            )
            rows = await cur.fetchall()
        return {(ExecutorKey(r["org"], r["app"], r["executor_id"]), int(r["epoch"])): int(r["run"]) for r in rows}

    async def set_blocked(
        self, ref: RecoveryRef, reason: str, status: BlockedStatus, dedupe: str, error: str | None = None
    ) -> None:
        """The recovery waits for ``reason``; ``error``: why, in words, when the reason alone would
        mislead (the app has healthy peers, only none this recovery may use), kept as the
        recovery's error and in the audit entry."""

        async def write(conn: Conn) -> bool:
            await self.executors.apply(ref.key, E.BLOCKED, epoch=ref.epoch, reason=reason, conn=conn)
            await self._status(conn, ref.rid, status, error)
            detail = {"reason": reason, "recoveryId": ref.rid}
            if error is not None:
                detail["error"] = error
            # Every instance hears of it when it commits: a peer connecting there wakes the recovery.
            note = json.dumps({"org": ref.key.org, "app": ref.key.app})
            await conn.execute("SELECT pg_notify(%s, %s)", (BLOCKED_CHANNEL, note))
            action: AuditAction = (
                "recovery.waiting_for_peer" if status == "waiting_for_peer" else "recovery.awaiting_operator"
            )
            return await audit_executor(conn, ref.key, action, dedupe, detail=detail)

        if await self.executors.combined(write, ref.key):
            self.pipeline.blocked.labels(ref.key.org, ref.key.app, reason).inc()
            log.info(
                "recovery %s of executor %s: %s (%s)", ref.rid, ref.key, status, error or reason, extra=_about(ref)
            )

    async def renote_blocked(self, ref: RecoveryRef, error: str | None) -> None:
        """A blocked recovery's ``error`` (why it waits, in words) brought up to date when the peers
        changed but its reason did not (no new audit entry, no step: idempotent, it may run again)."""

        async def write(conn: Conn) -> None:
            await conn.execute(
                """UPDATE recoveries SET error = %s, updated_at = now()
                   WHERE id = %s AND status IN ('waiting_for_peer', 'awaiting_operator')
                     AND error IS DISTINCT FROM %s""",
                (error, ref.rid, error),
            )

        await self.executors.combined(write, ref.key)

    async def dispatch(self, ref: RecoveryRef, plan: Dispatch, dedupe: str) -> bool:
        """DEAD -> RECOVERING and the attempt recorded; False if the executor is no longer dead."""

        async def write(conn: Conn) -> tuple[bool, bool, object]:
            if not await self.executors.apply(ref.key, E.RECOVERY_SENT, epoch=ref.epoch, conn=conn):
                if not await self.executors.at_epoch(conn, ref.key, ref.epoch, (ExecutorState.RECOVERING,)):
                    return False, False, None
            peer = plan.peer.executor_id
            cur = await conn.execute(
                """INSERT INTO recovery_attempts (recovery_id, attempt, peer_executor_id, mode, outcome)
                   VALUES (%s, %s, %s, %s, 'dispatched') ON CONFLICT DO NOTHING""",
                (ref.rid, plan.attempt, peer, plan.mode.value),
            )
            first = cur.rowcount == 1
            since_dead = await self._first_dispatch_since_dead(conn, ref, plan.attempt) if first else None
            await self._status(conn, ref.rid, "dispatching", None)
            detail = {"attempt": plan.attempt, "mode": plan.mode.value, "recoveryId": ref.rid}
            if plan.failover_from is not None:
                await audit_executor(
                    conn,
                    ref.key,
                    "recovery.failover",
                    f"{dedupe}:failover",
                    peer=peer,
                    detail={**detail, "fromPeer": plan.failover_from, "backoffSecs": plan.backoff_secs},
                )
            await audit_executor(conn, ref.key, "recovery.dispatched", f"{dedupe}:dispatched", peer=peer, detail=detail)
            return True, first, since_dead

        dispatched, first, since_dead = await self.executors.combined(write, ref.key)
        if not dispatched:
            return False
        if first:
            log.info(
                "recovery %s of executor %s: attempt %d sent to peer %s (%s)",
                ref.rid, ref.key, plan.attempt, printable(plan.peer.executor_id), plan.mode.value, extra=_about(ref),
            )  # fmt: skip
            observe(self.pipeline.dead_to_dispatched, since_dead)
            if plan.failover_from is not None:
                self.pipeline.failovers.labels(ref.key.org, ref.key.app).inc()
        return True

    async def _first_dispatch_since_dead(self, conn: Conn, ref: RecoveryRef, attempt: int) -> object:
        """Seconds since the executor was declared DEAD, if this attempt is the death's first
        dispatch (over all its runs); else None."""
        key = ref.key
        cur = await conn.execute(
            f"""SELECT extract(epoch FROM now() - dead_at) AS secs FROM executors {_ROW}
                AND NOT EXISTS (
                    SELECT 1 FROM recovery_attempts a JOIN recoveries r ON r.id = a.recovery_id
                    WHERE r.org = %(org)s AND r.app = %(app)s AND r.executor_id = %(id)s AND r.epoch = %(epoch)s
                      AND NOT (a.recovery_id = %(rid)s AND a.attempt = %(attempt)s))""",
            {**_row_params(key, ref.epoch), "rid": ref.rid, "attempt": attempt},
        )
        row = await cur.fetchone()
        return row["secs"] if row else None

    async def mark_replied(self, ref: RecoveryRef) -> None:
        """The peer of the attempt in flight has replied (the first time counts)."""

        async def write(conn: Conn) -> None:
            await conn.execute(
                """UPDATE recovery_attempts SET replied_at = now()
                   WHERE recovery_id = %s AND outcome = 'dispatched' AND replied_at IS NULL""",
                (ref.rid,),
            )

        await self.executors.combined(write, ref.key)

    async def mark_verified(self, ref: RecoveryRef) -> None:
        """The attempt in flight passed verification (the first time counts)."""

        async def write(conn: Conn) -> None:
            await conn.execute(
                """UPDATE recovery_attempts SET verified_at = now()
                   WHERE recovery_id = %s AND outcome = 'dispatched' AND verified_at IS NULL""",
                (ref.rid,),
            )

        await self.executors.combined(write, ref.key)

    async def fail_attempt(self, ref: RecoveryRef, attempt: int, peer: str, error: str, dedupe: str) -> None:
        """RECOVERING -> DEAD, the attempt marked failed."""

        async def write(conn: Conn) -> dict[str, Any] | None:
            await self.executors.apply(ref.key, E.RECOVERY_FAILED, epoch=ref.epoch, conn=conn)
            cur = await conn.execute(
                f"""UPDATE recovery_attempts SET outcome = 'failed', error = %s, at = now()
                    WHERE recovery_id = %s AND attempt = %s AND outcome = 'dispatched' RETURNING {_TO_REPLY}""",
                (error, ref.rid, attempt),
            )
            timings = await cur.fetchone()
            detail = {"attempt": attempt, "error": error, "recoveryId": ref.rid}
            await audit_executor(conn, ref.key, "recovery.failed", dedupe, peer=peer, detail=detail)
            return timings

        timings = await self.executors.combined(write, ref.key)
        if timings is None:
            return  # the attempt was marked failed already (this step run again after a crash): logged then
        observe(self.pipeline.dispatched_to_reply, timings["to_reply"])
        log.info(
            "recovery %s of executor %s: attempt %d on peer %s failed: %s",
            ref.rid,
            ref.key,
            attempt,
            printable(peer),
            printable(error),  # the peer's own words, of any length (a frame may be 64 MiB)
            extra=_about(ref),
        )

    async def succeed(
        self,
        ref: RecoveryRef,
        attempt: int,
        peer: str,
        dedupe: str,
        verified_by: str | None = None,
        *,
        verified_now: bool = False,
    ) -> bool:
        """The attempt succeeded: delete the executor's record (if still this epoch's). Returns whether deleted.

        ``verified_by``: the executor whose answer showed nothing left PENDING. ``verified_now``: the
        verification passed just now and was not recorded (:meth:`mark_verified`): it is, here.
        """

        async def write(conn: Conn) -> tuple[dict[str, Any] | None, bool, dict[str, Any] | None]:
            cur = await conn.execute(
                f"SELECT extract(epoch FROM now() - dead_at) AS secs FROM executors {_ROW}",
                _row_params(ref.key, ref.epoch),
            )
            dead = await cur.fetchone()
            deleted = await self.executors.apply(ref.key, E.RECOVERED, epoch=ref.epoch, conn=conn)
            cur = await conn.execute(
                f"""UPDATE recovery_attempts SET outcome = 'succeeded', at = now(),
                           verified_at = CASE WHEN %s THEN coalesce(verified_at, now()) ELSE verified_at END
                    WHERE recovery_id = %s AND attempt = %s AND outcome = 'dispatched'
                    RETURNING {_TO_REPLY}, extract(epoch FROM verified_at - replied_at) AS to_verified""",
                (verified_now, ref.rid, attempt),
            )
            timings = await cur.fetchone()
            await self._status(conn, ref.rid, "succeeded", None)
            detail: dict[str, object] = {"attempt": attempt, "recoveryId": ref.rid}
            if verified_by is not None:
                detail["verifiedBy"] = verified_by
            if not deleted:
                # The executor connected again between the verification and this write: its workflows
                # were recovered, its record (a live connection's) is kept. This entry ends the death
                # (relay.core.alerts.death_over): no executor.deleted comes, nor a final recovery.failed.
                detail["recordKept"] = True
            await audit_executor(conn, ref.key, "recovery.succeeded", f"{dedupe}:succeeded", peer=peer, detail=detail)
            if deleted:
                await audit_executor(conn, ref.key, "executor.deleted", f"{dedupe}:deleted", peer=peer, detail=detail)
            return dead, deleted, timings

        dead, deleted, timings = await self.executors.combined(write, ref.key)
        if timings is not None:
            observe(self.pipeline.dispatched_to_reply, timings["to_reply"])
            observe(self.pipeline.reply_to_verified, timings["to_verified"])
        if deleted and dead is not None:
            observe(self.pipeline.dead_to_deleted, dead["secs"])
        if timings is None and not deleted:
            # The attempt was marked succeeded already (this step run again after a crash, the record
            # deleted by the first run): logged then, and "kept" would be false.
            return deleted
        kept = "deleted" if deleted else "kept (it connected again)"
        log.info(
            "recovery %s of executor %s succeeded: recovered by peer %s, its record %s",
            ref.rid,
            ref.key,
            printable(peer),
            kept,
            extra=_about(ref),
        )
        return deleted

    async def succeed_idle(self, ref: RecoveryRef, verified_by: str, dedupe: str) -> bool:
        """Nothing to recover: ``verified_by`` found no PENDING workflow of the dead executor, so its
        record is deleted with no recovery frame sent (a DEAD executor, still this epoch's). Audited as
        a verified recovery is (``recovery.succeeded``, ``executor.deleted``), the detail saying that
        nothing was pending. Returns whether deleted (False: it is no longer dead)."""

        async def write(conn: Conn) -> tuple[dict[str, Any] | None, bool]:
            cur = await conn.execute(
                f"SELECT extract(epoch FROM now() - dead_at) AS secs FROM executors {_ROW}",
                _row_params(ref.key, ref.epoch),
            )
            dead = await cur.fetchone()
            if not await self.executors.apply(ref.key, E.NOTHING_PENDING, epoch=ref.epoch, conn=conn):
                return None, False
            await self._status(conn, ref.rid, "succeeded", None)
            detail: dict[str, object] = {
                "recoveryId": ref.rid,
                "verifiedBy": verified_by,
                "nothingPending": True,
                "note": "no PENDING workflow of the dead executor: nothing to recover",
            }
            peer = verified_by
            await audit_executor(conn, ref.key, "recovery.succeeded", f"{dedupe}:succeeded", peer=peer, detail=detail)
            await audit_executor(conn, ref.key, "executor.deleted", f"{dedupe}:deleted", peer=peer, detail=detail)
            return dead, True

        dead, deleted = await self.executors.combined(write, ref.key)
        if deleted and dead is not None:
            observe(self.pipeline.dead_to_deleted, dead["secs"])
        if deleted:
            log.info(
                "recovery %s of executor %s succeeded: nothing was PENDING, its record deleted",
                ref.rid,
                ref.key,
                extra=_about(ref),
            )
        return deleted

    async def abandon(self, ref: RecoveryRef, dedupe: str) -> str:
        """The executor came back (or its record is gone): this recovery ends without deleting
        anything. Which of the two, read with the record locked, is its error (returned), and an
        executor back has ``executorBack: true`` in the entry, which the console shows as such."""

        async def write(conn: Conn) -> str:
            back = await self.executors.version_of(conn, ref.key) is not None
            reason = EXECUTOR_BACK if back else EXECUTOR_GONE
            await self._status(conn, ref.rid, "failed", reason)
            detail: dict[str, Any] = {"error": reason, "recoveryId": ref.rid, "final": True}
            if back:
                detail["executorBack"] = True
            await audit_executor(conn, ref.key, "recovery.failed", dedupe, detail=detail)
            return reason

        return await self.executors.combined(write, ref.key)

    async def end_unfinished(self, key: ExecutorKey, epoch: int, reason: str, up_to_run: int) -> list[str]:
        """The records of this death's runs up to ``up_to_run`` that still say they are at work, when the
        executor is back and none of them is live: ``failed`` with ``reason``, and ``recovery.failed``
        audited, as a run that found the executor back writes (:meth:`abandon`). A later run (started
        by the sweep or an operator after the runs were looked at) is live, and ends itself. Returns
        their ids."""

        async def write(conn: Conn) -> list[str]:
            cur = await conn.execute(
                """UPDATE recoveries SET status = 'failed', error = %s, updated_at = now()
                   WHERE org = %s AND app = %s AND executor_id = %s AND epoch = %s AND run <= %s
                     AND status NOT IN ('succeeded', 'failed')
                   RETURNING id""",
                (reason, key.org, key.app, key.executor_id, epoch, up_to_run),
            )
            ended = sorted(str(r["id"]) for r in await cur.fetchall())
            for rid in ended:
                detail = {"error": reason, "recoveryId": rid, "final": True, "executorBack": True}
                await audit_executor(conn, key, "recovery.failed", f"back:{rid}", detail=detail)
            return ended

        return await self.executors.combined(write, key)

    async def get(
        self,
        org: str,
        app: str,
        rid: str | None = None,
        executor_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
        newest_first: bool = False,
        status: str | None = None,
        updated_since: datetime | None = None,
        executor_deleted: bool | None = None,
    ) -> list[RecoveryRow]:
        match = (org, app, rid, rid, executor_id, executor_id, status, status, updated_since, updated_since,
                 executor_deleted, executor_deleted)  # fmt: skip
        async with self.db.connection() as conn:
            cur = await conn.execute(recovery_page(newest_first), (*match, limit, offset))
            rows = await cur.fetchall()
            history = await self._history(conn, org, app, rows)
        return [RecoveryRow(**row, history=history.get(row["id"], [])) for row in rows]

    async def count(
        self,
        org: str,
        app: str,
        executor_id: str | None,
        status: str | None,
        updated_since: datetime | None,
        executor_deleted: bool | None = None,
    ) -> int:
        """How many runs :meth:`get` lists with these filters, on every page."""
        match = (org, app, None, None, executor_id, executor_id, status, status, updated_since, updated_since,
                 executor_deleted, executor_deleted)  # fmt: skip
        async with self.db.connection() as conn:
            cur = await conn.execute(f"SELECT count(*) AS n {_RUNS}", match)
            row = await cur.fetchone()
        return int(row["n"]) if row else 0

    @staticmethod
    async def _history(conn: Conn, org: str, app: str, rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """Each run's audit entries (those naming its ``recoveryId``) and the ``executor.dead`` of its
        death (by epoch), oldest first: the times of its timeline. An index scan per executor."""
        if not rows:
            return {}
        cur = await conn.execute(
            """SELECT id, at, action, peer_executor_id, detail FROM audit_log
               WHERE org = %s AND app = %s AND executor_id = ANY(%s::text[])
                 AND (detail->>'recoveryId' = ANY(%s::text[])
                      OR (action = 'executor.dead' AND detail->>'epoch' = ANY(%s::text[])))
               ORDER BY id""",
            (org, app, sorted({r["executor_id"] for r in rows}), [r["id"] for r in rows],
             sorted({str(r["epoch"]) for r in rows})),
        )  # fmt: skip
        entries = await cur.fetchall()
        # Each entry looked at once (a page of 1,000 runs has thousands of entries: matching every
        # entry against every run held the event loop for most of a second).
        by_run: dict[str, list[dict[str, Any]]] = {}
        deaths: dict[str, list[dict[str, Any]]] = {}
        for e in entries:
            run = e["detail"].get("recoveryId")
            if isinstance(run, str):
                by_run.setdefault(run, []).append(e)
            if e["action"] == "executor.dead":
                deaths.setdefault(str(e["detail"].get("epoch")), []).append(e)
        history: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            mine = {id(e): e for e in [*by_run.get(row["id"], []), *deaths.get(str(row["epoch"]), [])]}
            history[row["id"]] = sorted(mine.values(), key=lambda e: int(e["id"]))
        return history

    async def blocked_in_app(self, org: str, app: str, peers: list[str] | None = None) -> list[str]:
        """Ids of this app's recoveries that wait for a peer or an operator; with ``peers`` (executors
        of the app that connected, or that an instance serves as it learns of the app's blocked
        recoveries), only those one of them may unblock: those that wait for a peer
        (``waiting_for_peer``), except that one waiting for a peer of its executor's language
        (``no_peer_of_its_language``) only if one of them runs that language's SDK (or its language
        is not known), and those that wait for an operator (``version_upgrade_not_allowed``) only if
        one of them runs the dead executor's version (or its version is not known). Each wake-up
        costs a blocked recovery a few checkpoints and a read of the app's peers: a deploy's new
        executors, on a version none of them may use, wake none, nor do a Python app's executors
        connecting wake a TypeScript executor's recovery."""
        async with self.db.connection() as conn:
            cur = await conn.execute(
                """SELECT r.id FROM recoveries r
                   LEFT JOIN executors d ON d.org = r.org AND d.app = r.app AND d.executor_id = r.executor_id
                                        AND d.epoch = r.epoch
                   WHERE r.org = %(org)s AND r.app = %(app)s
                     AND r.status IN ('waiting_for_peer', 'awaiting_operator')
                     AND (%(peers)s::text[] IS NULL OR EXISTS (
                          SELECT 1 FROM unnest(%(peers)s::text[]) AS q(id)
                          LEFT JOIN executors p ON p.org = r.org AND p.app = r.app AND p.executor_id = q.id
                          WHERE CASE WHEN r.status = 'waiting_for_peer'
                                THEN d.blocked_reason IS DISTINCT FROM 'no_peer_of_its_language'
                                     OR coalesce(d.language, '') = '' OR coalesce(p.language, '') IN ('', d.language)
                                ELSE p.application_version IS NULL
                                     OR p.application_version = r.application_version END))""",
                {"org": org, "app": app, "peers": peers},
            )
            return [str(r["id"]) for r in await cur.fetchall()]

    async def apps_with_blocked(self) -> list[tuple[str, str]]:
        async with self.db.connection() as conn:
            cur = await conn.execute(
                "SELECT DISTINCT org, app FROM recoveries WHERE status IN ('waiting_for_peer', 'awaiting_operator')"
            )
            return [(str(r["org"]), str(r["app"])) for r in await cur.fetchall()]

    @staticmethod
    async def _status(conn: Conn, rid: str, status: str, error: str | None) -> None:
        await conn.execute(
            """UPDATE recoveries SET status = %s, error = %s, updated_at = now()
               WHERE id = %s AND status NOT IN ('succeeded', 'failed')""",
            (status, error, rid),
        )
