"""An app's versions, as its system database records them, and which one is the latest."""

from __future__ import annotations

from fastapi import APIRouter, Response

from relay.api import shapes
from relay.api.common import (
    Admin,
    ApiError,
    Caller,
    ConductorBody,
    Ctx,
    DecodedRoute,
    NonEmptyName,
    actor,
    answered,
    audited,
)
from relay_protocol import (
    ListApplicationVersionsReply,
    ListApplicationVersionsRequest,
    SetLatestApplicationVersionReply,
    SetLatestApplicationVersionRequest,
)

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}/versions", tags=["versions"])


class LatestIn(ConductorBody):
    versionName: NonEmptyName


@router.get("", response_model=list[shapes.ApplicationVersion])
async def list_versions(org: str, app: str, ctx: Ctx, _: Caller) -> list[shapes.ApplicationVersion]:
    reply = answered(await ctx.gateway.ask(org, app, ListApplicationVersionsRequest, ListApplicationVersionsReply))
    return [shapes.version(v) for v in reply.output]


@router.patch("/latest", status_code=204, response_class=Response)
async def set_latest_version(org: str, app: str, body: LatestIn, ctx: Ctx, who: Admin) -> Response:
    def ask() -> SetLatestApplicationVersionRequest:
        return SetLatestApplicationVersionRequest(version_name=body.versionName)

    async with audited(ctx, org, app, "application.set_latest_version", actor(who), {"versionName": body.versionName}):
        # DBOS 3.2 updates no row for a version the app never had and answers success: ask first.
        known = answered(await ctx.gateway.ask(org, app, ListApplicationVersionsRequest, ListApplicationVersionsReply))
        if body.versionName not in {v.version_name for v in known.output}:
            raise ApiError(404, "not_found", f"no version {body.versionName!r} of app {app!r}")
        answered(await ctx.gateway.ask(org, app, ask, SetLatestApplicationVersionReply), success=True)
    return Response(status_code=204)
