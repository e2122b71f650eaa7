"""Apps: their settings and their executors counted by state."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from relay.api.common import Admin, ApiError, Caller, Ctx, Page, actor
from relay.store.apps import AppRecord

router = APIRouter(prefix="/v2/orgs/{org}")


class AppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=to_camel)

    executor_timeout_secs: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    recover_to_latest_version: bool | None = None


def app_json(app: AppRecord) -> dict[str, Any]:
    return {
        "org": app.org,
        "name": app.name,
        **app.settings(),
        "executors": {state.value: n for state, n in app.counts.items()},
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


@router.patch("/apps/{app}")
async def patch_app(org: str, app: str, settings: AppSettings, ctx: Ctx, who: Admin) -> dict[str, Any]:
    """Change an app's settings; a grace period already running keeps the value it started with."""
    changes = settings.model_dump(exclude_none=True)
    if not changes:
        raise ApiError(422, "invalid_request", "nothing to change: give executorTimeoutSecs or recoverToLatestVersion")
    return app_json(await ctx.operator.update_settings(org, app, changes, actor(who)))
