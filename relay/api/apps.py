"""Apps: their settings and their executors counted by state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from relay.api.common import Admin, ApiError, Caller, Ctx, Page, actor, iso
from relay.core.lifecycle import ExecutorState
from relay.net.hub import valid_app_name
from relay.store.apps import AppRecord

router = APIRouter(prefix="/v2/orgs/{org}")
# Thresholds stay within what every JSON client reads exactly (2^53 ms is 285,000 years).
MAX_MS = 2**53


class AppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=to_camel)

    executor_timeout_secs: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    recover_to_latest_version: bool | None = None
    # Retention of the app's workflows (Conductor's settings); null turns one off.
    gc_time_threshold_ms: int | None = Field(default=None, gt=0, le=MAX_MS)
    gc_rows_threshold: int | None = Field(default=None, gt=0, le=MAX_MS)
    global_timeout_ms: int | None = Field(default=None, gt=0, le=MAX_MS)

    def changes(self) -> dict[str, Any]:
        """The settings given (snake_case): the retention ones also when null (off); the others
        only when not null, since they cannot be off."""
        given = self.model_dump(exclude_unset=True)
        for name in ("executor_timeout_secs", "recover_to_latest_version"):
            if name in given and given[name] is None:
                raise ApiError(422, "invalid_request", f"{to_camel(name)} cannot be null")
        return given


def app_json(app: AppRecord) -> dict[str, Any]:
    """Conductor's Application (``id``, ``name``, ``orgId``, ``status``, ``language``, settings...),
    with Relay's own members beside it (``org``, ``executors`` by state, ``recoverToLatestVersion``)."""
    return {
        "id": app.name,
        "name": app.name,
        "orgId": app.org,
        "status": "AVAILABLE" if app.counts[ExecutorState.HEALTHY] else "UNAVAILABLE",
        "language": min(app.languages) if app.languages else None,
        "privateMode": False,
        "dbosCloud": False,
        "org": app.org,
        **app.settings(),
        "executors": {state.value: n for state, n in app.counts.items()},
        "createdAt": iso(app.created_at),
    }


async def app_or_404(ctx: Ctx, org: str, app: str) -> AppRecord:
    record = await ctx.apps.get(org, app)
    if record is None:
        raise ApiError(404, "not_found", f"no app {app!r} in org {org!r}")
    return record


@router.get("/apps")
async def get_apps(org: str, ctx: Ctx, who: Caller, page: Page) -> list[dict[str, Any]]:
    """The org's apps, or those a key scoped to apps may see."""
    apps = await ctx.apps.list_apps(org, limit=page.limit, offset=page.offset, among=who.apps)
    return [app_json(a) for a in apps]


@router.get("/apps/{app}")
async def get_app(org: str, app: str, ctx: Ctx, _: Caller) -> dict[str, Any]:
    return app_json(await app_or_404(ctx, org, app))


class RegisterApp(BaseModel):
    model_config = ConfigDict(extra="forbid")

    privateMode: bool = False  # Relay never stores application data: accepted, and nothing to change
    # Relay's addition to Conductor's body: the retention settings, set as PATCH sets them.
    gcTimeThresholdMs: int | None = Field(default=None, gt=0, le=MAX_MS)
    gcRowsThreshold: int | None = Field(default=None, gt=0, le=MAX_MS)
    globalTimeoutMs: int | None = Field(default=None, gt=0, le=MAX_MS)


@router.put("/apps/{app}", status_code=204, response_class=Response)
async def register_app(org: str, app: str, ctx: Ctx, who: Admin, body: RegisterApp | None = None) -> Response:
    """Register an app before its executors connect (with ``autoRegisterApps: false``, the way to admit one)."""
    if not valid_app_name(app):
        raise ApiError(422, "invalid_request", "an app name is 1 to 256 printable characters")
    await ctx.operator.register_app(org, app, actor(who))
    if body is not None:
        given = body.model_dump(exclude_unset=True, exclude={"privateMode"})
        if given:
            changes = AppSettings.model_validate(given).changes()
            await ctx.operator.update_settings(org, app, changes, actor(who))
    return Response(status_code=204)


@router.delete("/apps/{app}", status_code=204, response_class=Response)
async def delete_app(org: str, app: str, ctx: Ctx, who: Admin) -> Response:
    """Forget an app; 409 while the registry holds any of its executors."""
    await ctx.operator.delete_app(org, app, actor(who))
    return Response(status_code=204)


@router.patch("/apps/{app}")
async def patch_app(org: str, app: str, settings: AppSettings, ctx: Ctx, who: Admin) -> dict[str, Any]:
    """Change an app's settings; a grace period already running keeps the value it started with."""
    changes = settings.changes()
    if not changes:
        raise ApiError(
            422,
            "invalid_request",
            "nothing to change: give executorTimeoutSecs, recoverToLatestVersion, gcTimeThresholdMs, "
            "gcRowsThreshold or globalTimeoutMs",
        )
    return app_json(await ctx.operator.update_settings(org, app, changes, actor(who)))
