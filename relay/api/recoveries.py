"""Recoveries of dead executors, with their attempts.

One row per run of a recovery workflow: a death whose first run ended without
finishing has a second run (id ``...:{epoch}:2``), and so on. A list shows
every run, oldest first; any run, of this release or an earlier one, can be
read by its id.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import Field

from relay.api.apps import app_or_404
from relay.api.common import ApiError, Caller, Ctx, DecodedRoute, Page, PathId, QueryName
from relay.api.shapes import Rfc3339, Shape, one_of, text_iso
from relay.core.times import us_iso
from relay.store.recoveries import RecoveryRow

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}/recoveries")


class RecoveryAttempt(Shape):
    attempt: int
    peerExecutorId: str
    mode: str
    outcome: str = one_of("dispatched", "succeeded", "failed")
    error: str | None
    at: str | None
    dispatchedAt: str | None
    endedAt: str | None
    verifiedBy: str | None
    deletedAt: str | None


class TimelineEntry(Shape):
    at: str | None
    action: str
    peerExecutorId: str | None
    attempt: int | None
    detail: dict[str, Any]


RunStatus = Literal["dispatching", "waiting_for_peer", "awaiting_operator", "succeeded", "failed"]


class Recovery(Shape):
    recoveryId: str
    executorId: str
    run: int
    applicationVersion: str
    language: str | None = Field(
        description="The dead executor's language, as its handshake gave it (python, typescript): a recovery"
        " waits for a peer of that language. Kept with the run as it opens. Null when not known: its handshake"
        " gave none, or the run was opened by a release before migration 25 and the record of that death is"
        " gone (deleted by the run that succeeded, or replaced as the executor reconnected)."
    )
    trigger: str = one_of("grace_period", "operator", "repair", "reconcile")
    status: str = one_of("dispatching", "waiting_for_peer", "awaiting_operator", "succeeded", "failed")
    error: str | None
    createdAt: str | None
    updatedAt: str | None
    deadAt: str | None
    deletedAt: str | None
    attempts: list[RecoveryAttempt]
    timeline: list[TimelineEntry]


def recovery(row: RecoveryRow) -> Recovery:
    """The run, its attempts and its timeline: the times come from the audit entries of the run
    (``executor.dead`` of its death, then per attempt ``recovery.dispatched``, ``recovery.failed``
    or ``recovery.succeeded`` with the executor that verified, and ``executor.deleted``)."""
    history = row.history

    def first(action: str, attempt: int | None = None) -> dict[str, Any] | None:
        for entry in history:
            if entry["action"] == action and (attempt is None or entry["detail"].get("attempt") == attempt):
                return entry
        return None

    def at(entry: dict[str, Any] | None) -> str | None:
        return us_iso(entry["at"]) if entry is not None else None

    attempts = []
    for a in row.attempts:
        n = a["attempt"]
        dispatched, succeeded = first("recovery.dispatched", n), first("recovery.succeeded", n)
        ended = succeeded or first("recovery.failed", n)
        attempts.append(
            RecoveryAttempt(
                attempt=n,
                peerExecutorId=a["peerExecutorId"],
                mode=a["mode"],
                outcome=a["outcome"],
                error=a["error"],
                at=text_iso(a["at"]),
                dispatchedAt=at(dispatched),
                endedAt=at(ended),
                verifiedBy=succeeded["detail"].get("verifiedBy") if succeeded is not None else None,
                deletedAt=at(first("executor.deleted", n)),
            )
        )
    return Recovery(
        recoveryId=row.id,
        executorId=row.executor_id,
        run=row.run,
        applicationVersion=row.application_version,
        language=row.language,
        trigger=row.trigger,
        status=row.status,
        error=row.error,
        createdAt=us_iso(row.created_at),
        updatedAt=us_iso(row.updated_at),
        deadAt=at(first("executor.dead")),
        deletedAt=at(first("executor.deleted")),
        attempts=attempts,
        timeline=[
            TimelineEntry(
                at=us_iso(e["at"]),
                action=e["action"],
                peerExecutorId=e["peer_executor_id"],
                attempt=e["detail"].get("attempt"),
                detail=e["detail"],
            )
            for e in history
        ],
    )


TOTAL = {"X-Total-Count": {"description": "with `total=true`: the runs the filters match, on every page",
                            "schema": {"type": "integer", "minimum": 0}}}  # fmt: skip


@router.get("", responses={200: {"headers": TOTAL}})
async def get_recoveries(
    org: str,
    app: str,
    ctx: Ctx,
    _: Caller,
    page: Page,
    response: Response,
    executor_id: Annotated[QueryName | None, Query(alias="executorId")] = None,
    sortDesc: bool = False,
    status: RunStatus | None = None,
    updatedSince: Rfc3339 | None = None,
    executorDeleted: bool | None = None,
    total: bool = False,
) -> list[Recovery]:
    """Oldest first (newest first with ``sortDesc=true``); each filter given narrows the runs: in
    ``status``, whose last change (``updatedAt``: a finished run's end) is at or after
    ``updatedSince``, and (``executorDeleted``) that deleted their executor's record, or did not (a
    run that succeeded while its executor had connected again keeps it: ``recordKept``). With
    ``total=true``, the ``X-Total-Count`` header counts the runs the filters match (the console's
    executors recovered and removed in the last hour:
    ``status=succeeded&updatedSince=...&executorDeleted=true``)."""
    await app_or_404(ctx, org, app)
    rows = await ctx.recoveries.get(
        org,
        app,
        executor_id=executor_id,
        limit=page.limit,
        offset=page.offset,
        newest_first=sortDesc,
        status=status,
        updated_since=updatedSince,
        executor_deleted=executorDeleted,
    )
    if total:
        count = await ctx.recoveries.count(org, app, executor_id, status, updatedSince, executorDeleted)
        response.headers["X-Total-Count"] = str(count)
    return [recovery(r) for r in rows]


@router.get("/{recovery_id}")
async def get_recovery(org: str, app: str, recovery_id: PathId, ctx: Ctx, _: Caller) -> Recovery:
    rows = await ctx.recoveries.get(org, app, rid=recovery_id)
    if not rows:
        raise ApiError(404, "not_found", f"no recovery {recovery_id!r} in {org}/{app}")
    return recovery(rows[0])
