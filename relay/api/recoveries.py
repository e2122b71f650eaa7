"""Recoveries of dead executors, with their attempts.

One row per run of a recovery workflow: a death whose first run ended without
finishing has a second run (id ``...:{epoch}:2``), and so on. A list shows
every run, oldest first; any run, of this release or an earlier one, can be
read by its id.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from relay.api.apps import app_or_404
from relay.api.common import ApiError, Caller, Ctx, Page, PathId, QueryName, iso, iso_text
from relay.api.shapes import Shape, one_of
from relay.store.recoveries import RecoveryRow

router = APIRouter(prefix="/v2/orgs/{org}/apps/{app}/recoveries")


class RecoveryAttempt(Shape):
    attempt: int
    peerExecutorId: str
    mode: str
    outcome: str = one_of("dispatched", "succeeded", "failed")
    error: str | None
    at: str | None


class Recovery(Shape):
    recoveryId: str
    executorId: str
    run: int
    applicationVersion: str
    trigger: str = one_of("grace_period", "operator", "repair", "reconcile")
    status: str = one_of("dispatching", "waiting_for_peer", "awaiting_operator", "succeeded", "failed")
    error: str | None
    createdAt: str | None
    updatedAt: str | None
    attempts: list[RecoveryAttempt]


def recovery(row: RecoveryRow) -> Recovery:
    return Recovery(
        recoveryId=row.id,
        executorId=row.executor_id,
        run=row.run,
        applicationVersion=row.application_version,
        trigger=row.trigger,
        status=row.status,
        error=row.error,
        createdAt=iso(row.created_at),
        updatedAt=iso(row.updated_at),
        attempts=[
            RecoveryAttempt(
                attempt=a["attempt"],
                peerExecutorId=a["peerExecutorId"],
                mode=a["mode"],
                outcome=a["outcome"],
                error=a["error"],
                at=iso_text(a["at"]),
            )
            for a in row.attempts
        ],
    )


@router.get("")
async def get_recoveries(
    org: str,
    app: str,
    ctx: Ctx,
    _: Caller,
    page: Page,
    executor_id: Annotated[QueryName | None, Query(alias="executorId")] = None,
) -> list[Recovery]:
    await app_or_404(ctx, org, app)
    rows = await ctx.recoveries.get(org, app, executor_id=executor_id, limit=page.limit, offset=page.offset)
    return [recovery(r) for r in rows]


@router.get("/{recovery_id}")
async def get_recovery(org: str, app: str, recovery_id: PathId, ctx: Ctx, _: Caller) -> Recovery:
    rows = await ctx.recoveries.get(org, app, rid=recovery_id)
    if not rows:
        raise ApiError(404, "not_found", f"no recovery {recovery_id!r} in {org}/{app}")
    return recovery(rows[0])
