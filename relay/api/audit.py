"""The audit log of an org, oldest first."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from relay.api.common import MAX_OFFSET, ApiError, Ctx, DecodedRoute, QueryName, iso, permitted
from relay.api.shapes import Rfc3339, Shape
from relay.auth import KeyGrant, Permission

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}")


async def _reader(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.ORGANIZATION_READ)


Reader = Annotated[KeyGrant, Depends(_reader)]


class AuditEntry(Shape):
    id: int
    at: str | None
    org: str
    app: str | None
    action: str
    executorId: str | None
    peerExecutorId: str | None
    actor: str
    detail: dict[str, Any]


@router.get("/audit")
async def get_audit(
    org: str,
    ctx: Ctx,
    who: Reader,
    app: QueryName | None = None,
    executor_id: Annotated[QueryName | None, Query(alias="executorId")] = None,
    since: Rfc3339 | None = None,
    action: QueryName | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    sortDesc: bool = False,
) -> list[AuditEntry]:
    """Oldest first (newest first with ``sortDesc=true``), filtered by app, executor, action and time."""
    if who.apps is not None and (app is None or app not in who.apps):
        # A key scoped to apps reads the entries of one of its apps, never the org's whole log.
        raise ApiError(403, "forbidden", "a key scoped to apps must name one of its apps: ?app=...")
    rows = await ctx.audit.list_entries(org, app, executor_id, since, limit, offset, action, sortDesc)
    return [
        AuditEntry(
            id=r["id"],
            at=iso(r["at"]),
            org=r["org"],
            app=r["app"],
            action=r["action"],
            executorId=r["executor_id"],
            peerExecutorId=r["peer_executor_id"],
            actor=r["actor"],
            detail=r["detail"],
        )
        for r in rows
    ]
