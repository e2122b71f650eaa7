"""The audit log of an org, oldest first."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from relay.api.common import Caller, Ctx, iso

router = APIRouter(prefix="/v2/orgs/{org}")


@router.get("/audit")
async def get_audit(
    org: str,
    ctx: Ctx,
    _: Caller,
    app: str | None = None,
    executor_id: Annotated[str | None, Query(alias="executorId")] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[dict[str, Any]]:
    rows = await ctx.audit.list_entries(org, app, executor_id, since, limit, offset)
    return [
        {
            "id": r["id"],
            "at": iso(r["at"]),
            "org": r["org"],
            "app": r["app"],
            "action": r["action"],
            "executorId": r["executor_id"],
            "peerExecutorId": r["peer_executor_id"],
            "actor": r["actor"],
            "detail": r["detail"],
        }
        for r in rows
    ]
