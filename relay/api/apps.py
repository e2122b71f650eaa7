"""Apps: their settings and their executors counted by state."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Response
from pydantic import AfterValidator, ConfigDict, WithJsonSchema
from pydantic.alias_generators import to_camel

from relay.api.common import (
    Admin,
    ApiError,
    Caller,
    ConductorBody,
    Ctx,
    DecodedRoute,
    Given,
    JsonInteger,
    WholePage,
    actor,
    given,
    optional,
)
from relay.api.shapes import Shape
from relay.config import Duration, RetentionThreshold
from relay.core.ids import APP_NAME_PATTERN, APP_NAME_RULE, valid_app_name
from relay.core.lifecycle import ExecutorState
from relay.core.times import us_iso
from relay.store.apps import AppRecord

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}")
# A retention setting: a positive integer, or null (off).
Threshold = Annotated[RetentionThreshold, JsonInteger] | None


def _not_private(value: bool) -> bool:
    if value:
        raise ValueError("Relay has no private mode: it keeps no application data to hide; give false or leave it out")
    return value


# Conductor's privateMode, in its bodies: Relay serves an app's data only from its executors, and
# never stores it, so that false is the only value it has (and the document says so).
PrivateMode = Annotated[
    bool,
    AfterValidator(_not_private),
    WithJsonSchema({"type": "boolean", "const": False, "description": "Relay has no private mode: false only"}),
]


SETTING_MEMBERS = (
    "executorTimeoutSecs",
    "recoverToLatestVersion",
    "gcTimeThresholdMs",
    "gcRowsThreshold",
    "globalTimeoutMs",
    "privateMode",
)


class AppSettings(ConductorBody):
    """Any of the settings; what is left out stays as it is. ``privateMode`` is taken (Conductor's
    PATCH carries it, ``dbosctl app update --private-mode`` sends it), and only as false."""

    # At least one setting, or privateMode: $schema alone changes nothing.
    model_config = ConfigDict(
        populate_by_name=True,
        alias_generator=to_camel,
        json_schema_extra={"anyOf": [{"required": [name]} for name in SETTING_MEMBERS]},
    )

    executor_timeout_secs: Annotated[Duration | None, Given] = given()
    recover_to_latest_version: Annotated[bool | None, Given] = given()
    # Retention of the app's workflows (Conductor's settings); null turns one off.
    gc_time_threshold_ms: Threshold = optional()
    gc_rows_threshold: Threshold = optional()
    global_timeout_ms: Threshold = optional()
    private_mode: Annotated[PrivateMode, Given] = optional()  # never read: None when left out

    def changes(self) -> dict[str, Any]:
        """The settings given (snake_case): the retention ones also when null (off); not
        ``privateMode``, which changes nothing."""
        return self.model_dump(exclude_unset=True, exclude={"private_mode", "json_schema_url"})


class Application(Shape):
    """Conductor's Application (``id``, ``name``, ``orgId``, ``status``, ``language``, settings...),
    with Relay's own members beside it (``org``, ``executors`` by state and by version, ``blocked`` by reason,
    ``languages`` of its executors' SDKs, ``recoverToLatestVersion``, ``gracePeriodSecs``).
    The retention settings are null when off."""

    id: str
    name: str
    orgId: str
    status: Literal["AVAILABLE", "UNAVAILABLE"]
    language: str | None
    gcTimeThresholdMs: int | None
    gcRowsThreshold: int | None
    globalTimeoutMs: int | None
    privateMode: bool
    dbosCloud: bool
    org: str
    # Conductor's int64, which its clients decode as one: dbosctl failed on 2.5, so that no app of the
    # org was listed. The grace period rounded up to a whole second (a sub-second one is not 0, "none").
    executorTimeoutSecs: int
    # The grace period as set, a fraction of a second included (Relay allows one): what Relay's
    # console and CLI show.
    gracePeriodSecs: int | float
    recoverToLatestVersion: bool
    executors: dict[ExecutorState, int]
    executorsByVersion: dict[str, dict[str, int]]
    blocked: dict[str, int]
    # Every language its executors' SDKs said (sorted): more than one is an app that loses work
    # (README, "Executors on the TypeScript SDK").
    languages: list[str]
    createdAt: str | None


def application(app: AppRecord) -> Application:
    settings = app.settings()
    grace = settings.pop("executorTimeoutSecs")
    return Application(
        id=app.name,
        name=app.name,
        orgId=app.org,
        status="AVAILABLE" if app.counts[ExecutorState.HEALTHY] else "UNAVAILABLE",
        language=min(app.languages) if app.languages else None,
        privateMode=False,
        dbosCloud=False,
        org=app.org,
        **settings,
        executorTimeoutSecs=math.ceil(grace),
        gracePeriodSecs=grace,
        executors=dict(app.counts),
        executorsByVersion=app.versions,
        blocked=app.blocked,
        languages=sorted(app.languages),
        createdAt=us_iso(app.created_at),
    )


async def app_or_404(ctx: Ctx, org: str, app: str) -> AppRecord:
    record = await ctx.apps.get(org, app)
    if record is None:
        raise ApiError(404, "not_found", f"no app {app!r} in org {org!r}")
    return record


@router.get("/apps")
async def get_apps(
    org: str,
    ctx: Ctx,
    who: Caller,
    page: WholePage,
    blocked_first: Annotated[
        bool, Query(alias="blockedFirst", description="Apps with a blocked recovery first (the console's order).")
    ] = False,
) -> list[Application]:
    """The org's apps by name, or those a key scoped to apps may see."""
    apps = await ctx.apps.list_apps(
        org, limit=page.limit, offset=page.offset, among=who.apps, blocked_first=blocked_first
    )
    return [application(a) for a in apps]


@router.get("/apps/{app}")
async def get_app(org: str, app: str, ctx: Ctx, _: Caller) -> Application:
    return application(await app_or_404(ctx, org, app))


class RegisterApp(ConductorBody):
    privateMode: PrivateMode = False  # accepted as false, and nothing to change
    # Relay's addition to Conductor's body: the retention settings, set as PATCH sets them.
    gcTimeThresholdMs: Threshold = optional()
    gcRowsThreshold: Threshold = optional()
    globalTimeoutMs: Threshold = optional()


# The rule in the document only: the handler checks it (valid_app_name also refuses characters no
# pattern can list), and answers with the rule in words rather than the pattern.
NewAppName = Annotated[str, Path(description=APP_NAME_RULE, json_schema_extra={"pattern": APP_NAME_PATTERN})]


@router.put("/apps/{app}", status_code=204, response_class=Response)
async def register_app(org: str, app: NewAppName, ctx: Ctx, who: Admin, body: RegisterApp | None = None) -> Response:
    """Register an app before its executors connect (with ``autoRegisterApps: false``, the way to admit one).
    The app and the settings given are written in one transaction: all of them, or nothing."""
    if not valid_app_name(app):
        raise ApiError(422, "invalid_request", APP_NAME_RULE, ["path.app"])
    changes: dict[str, Any] = {}
    if body is not None:
        given = body.model_dump(exclude_unset=True, exclude={"privateMode", "json_schema_url"})
        if given:
            changes = AppSettings.model_validate(given).changes()
    await ctx.operator.register_app(org, app, actor(who), changes)
    return Response(status_code=204)


@router.delete("/apps/{app}", status_code=204, response_class=Response)
async def delete_app(org: str, app: str, ctx: Ctx, who: Admin) -> Response:
    """Forget an app; 409 while the registry holds any of its executors, or when relay.yaml lists it."""
    await ctx.operator.delete_app(org, app, actor(who))
    return Response(status_code=204)


@router.patch("/apps/{app}")
async def patch_app(org: str, app: str, settings: AppSettings, ctx: Ctx, who: Admin) -> Application:
    """Change an app's settings; a grace period already running keeps the value it started with."""
    changes = settings.changes()
    if not changes and "private_mode" in settings.model_fields_set:
        return application(await app_or_404(ctx, org, app))  # privateMode: false, as it is
    if not changes:
        raise ApiError(
            422,
            "invalid_request",
            "nothing to change: give executorTimeoutSecs, recoverToLatestVersion, gcTimeThresholdMs, "
            "gcRowsThreshold or globalTimeoutMs",
            ["body"],
        )
    return application(await ctx.operator.update_settings(org, app, changes, actor(who)))
