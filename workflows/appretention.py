"""Retention of an application's data: one durable round per app and interval.

Every instance's engine starts, once per ``retention.appsIntervalSecs``, the
round of each app that has a retention setting on, under the id
``relay-app-retention:{org}:{app}:{interval number}`` (org and app escaped by
:func:`relay.core.ids.app_part`); DBOS runs an id once, so each app gets one
round per interval whichever instances are up, and a round interrupted by a
crash resumes on an instance that adopts it.

A round first looks at what the app's previous round left (the SDK runs a
round in the background and answers ``success: true`` at once, also when it
skips the round because the previous one still runs, so an answer is not an
effect): how many finished workflows completed before that round's cutoff
remain, how many finished ones there are against the rows threshold, and how
many unfinished ones created before its timeout cutoff. Then it sends
``retention`` with the cutoffs of now (now - threshold) to one healthy
executor of the app, and records it ``dispatched`` (or ``skipped``, with the
reason, when no executor took it). Both are in the audit log, a skip when its
reason is not the app's previous round's (an idle app with a retention setting
would write one every interval) and again while it goes on, once a day (twice
within ``retention.auditDays`` if that is shorter): the audit log always holds
a current entry. ``relay_app_retention_rounds_total`` counts every round.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dbos import DBOS

from relay.core.ids import app_part
from relay.core.times import sdk_ms_time
from relay.errors import ExecutorRequestError
from relay.store.appretention import RetentionRound
from relay_protocol import (
    GetWorkflowAggregatesBody,
    GetWorkflowAggregatesReply,
    GetWorkflowAggregatesRequest,
    RetentionBody,
    RetentionReply,
    RetentionRequest,
    clean_text,
)
from workflows.services import MAX_RECOVERY_ATTEMPTS, ask_app, dedupe_key, relay_step, services

log = logging.getLogger("relay.retention")

FINISHED = ["SUCCESS", "ERROR", "CANCELLED", "MAX_RECOVERY_ATTEMPTS_EXCEEDED"]
UNFINISHED = ["PENDING", "ENQUEUED", "DELAYED"]


def round_id(org: str, app: str, interval_secs: float, now: float | None = None) -> str:
    """The id of this interval's round of an app: the same on every instance."""
    bucket = int((time.time() if now is None else now) // interval_secs)
    return f"relay-app-retention:{app_part(org, app)}:{bucket}"


async def _count(org: str, app: str, rid: str, body: GetWorkflowAggregatesBody) -> int:
    _, reply = await ask_app(
        org, app, lambda: GetWorkflowAggregatesRequest(body=body), GetWorkflowAggregatesReply, spread=rid
    )
    return sum(row.count or 0 for row in reply.output)


async def _remaining(org: str, app: str, rid: str, checked: RetentionRound) -> dict[str, int | None]:
    """What the app's system database still holds of what ``checked`` targeted."""
    found: dict[str, int | None] = {"finishedBeforeCutoff": None, "finished": None, "unfinishedBeforeTimeout": None}
    if checked.gc_cutoff_epoch_ms is not None:
        # The SDK deletes finished workflows that completed before the cutoff.
        body = GetWorkflowAggregatesBody(
            group_by_status=True,
            select_count=True,
            status=FINISHED,
            # (max: a round recorded before the cutoffs were held at 1970 may have one before it)
            completed_before=sdk_ms_time(max(0, checked.gc_cutoff_epoch_ms) - 1),
        )
        found["finishedBeforeCutoff"] = await _count(org, app, rid, body)
    if checked.gc_rows_threshold is not None:
        body = GetWorkflowAggregatesBody(group_by_status=True, select_count=True, status=FINISHED)
        found["finished"] = await _count(org, app, rid, body)
    if checked.timeout_cutoff_epoch_ms is not None:
        # The SDK cancels unfinished workflows created at or before the timeout cutoff.
        cutoff = sdk_ms_time(max(0, checked.timeout_cutoff_epoch_ms))
        body = GetWorkflowAggregatesBody(group_by_status=True, select_count=True, status=UNFINISHED, end_time=cutoff)
        found["unfinishedBeforeTimeout"] = await _count(org, app, rid, body)
    return found


def skip_audit_secs(audit_days: float) -> float:
    """How old the app's latest ``retention.skipped`` is when a skip for the same reason is audited
    again: a day, or half of ``auditDays`` if shorter, so that the entry is written again before
    retention prunes it (rounds come every ``appsIntervalSecs``, ten minutes by default)."""
    return min(86400.0, audit_days * 86400 / 2)


def _cutoff(now_ms: int, threshold_ms: int | None) -> int | None:
    """``now - threshold``, not before 1970: a threshold may be up to 2^53 ms, and a cutoff before the
    year 1 is a time the SDK cannot read (nothing is older than 1970 either way)."""
    return None if threshold_ms is None else max(0, now_ms - threshold_ms)


def _failed(exc: Exception) -> dict[str, Any]:
    """A step's unexpected failure (not the database's): the round goes on, the next one retries."""
    return {"error": clean_text(f"{type(exc).__name__}: {exc}", 500)}


@relay_step("relay.app_retention.check", on_error=_failed)
async def check_previous(org: str, app: str) -> dict[str, Any]:
    """Record what the app's previous dispatched round left behind (nothing to do without one)."""
    svc = services()
    rid = DBOS.workflow_id or ""
    dedupe = dedupe_key()
    # Run again after a crash that followed its commit, the step finds its own check rather than
    # taking an older unchecked round, whose entry its key (already used) would have lost.
    done = await svc.app_retention.checked_under(dedupe)
    if done is not None:
        return {"checked": done["roundId"], "remaining": done["remaining"], "recorded": True}
    checked = await svc.app_retention.unchecked(org, app, before=rid)
    if checked is None:
        return {"checked": None}
    try:
        remaining = await _remaining(org, app, rid, checked)
    except ExecutorRequestError as exc:  # looked at by the next round, then
        return {"checked": None, "error": clean_text(str(exc), 500)}
    recorded = await svc.app_retention.record_check(checked, remaining, dedupe)
    return {"checked": checked.id, "remaining": remaining, "recorded": recorded}


@relay_step("relay.app_retention.send", on_error=_failed)
async def send(org: str, app: str) -> dict[str, Any]:
    """Send this round's cutoffs to one healthy executor of the app, and record it."""
    svc = services()
    rid = DBOS.workflow_id or ""
    record = await svc.apps.settings_of(org, app)
    if record is None or not record.retention.on:
        return {"sent": False, "reason": "no retention setting"}
    settings = record.retention
    now_ms = int(time.time() * 1000)
    body: dict[str, int | None] = {
        "gc_cutoff_epoch_ms": _cutoff(now_ms, settings.gc_time_threshold_ms),
        "gc_rows_threshold": settings.gc_rows_threshold,
        "gc_batch_size": None,  # the SDK's default (50,000 rows a transaction)
        "timeout_cutoff_epoch_ms": _cutoff(now_ms, settings.global_timeout_ms),
    }
    try:
        executor_id, _ = await ask_app(
            org, app, lambda: RetentionRequest(body=RetentionBody(**body)), RetentionReply, spread=rid
        )
    except ExecutorRequestError as exc:
        error = clean_text(str(exc), 500)
        log.info("app %s/%s: retention round %s skipped: %s", org, app, rid, error)
        again = skip_audit_secs(svc.retention_settings.audit_days)
        audited = await svc.app_retention.skipped(rid, org, app, error, dedupe_key(), again)
        svc.retention_rounds[(org, app, "skipped")] += 1
        return {"sent": False, "reason": error, "audited": audited}
    await svc.app_retention.dispatched(rid, org, app, executor_id, body, dedupe_key())
    svc.retention_rounds[(org, app, "dispatched")] += 1
    return {"sent": True, "executorId": executor_id, **body}


@DBOS.workflow(name="relay.app_retention", max_recovery_attempts=MAX_RECOVERY_ATTEMPTS)
async def app_retention(org: str, app: str) -> dict[str, Any]:
    checked = await check_previous(org, app)
    sent = await send(org, app)
    return {"checked": checked, "sent": sent}
