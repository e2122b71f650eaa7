"""An app's schedules (DBOS's cron-like scheduled workflows), through its executors."""

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
    PathId,
    QueryAppDefinedName,
    QueryName,
    QueryQueueOrScheduleName,
    actor,
    answered,
    audited,
    not_the_apps,
)
from relay.api.shapes import UtcTime
from relay.core.ids import owned_by
from relay.core.times import sdk_time
from relay.errors import UnsupportedMessage
from relay_protocol import (
    BackfillScheduleReply,
    BackfillScheduleRequest,
    GetScheduleReply,
    GetScheduleRequest,
    ListSchedulesBody,
    ListSchedulesReply,
    ListSchedulesRequest,
    PauseScheduleReply,
    PauseScheduleRequest,
    ResumeScheduleReply,
    ResumeScheduleRequest,
    TriggerScheduleReply,
    TriggerScheduleRequest,
)

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}/schedules", tags=["schedules"])


class BackfillIn(ConductorBody):
    startTime: UtcTime
    endTime: UtcTime


@router.get("", response_model=list[shapes.Schedule])
async def list_schedules(
    org: str,
    app: str,
    ctx: Ctx,
    _: Caller,
    status: QueryName | None = None,
    workflowName: QueryAppDefinedName | None = None,
    scheduleNamePrefix: QueryQueueOrScheduleName | None = None,
    loadContext: bool = True,
) -> list[shapes.Schedule]:
    """The app's schedules with their contexts, as Conductor serves them to an app not in private
    mode (Relay has none; its clients send no parameter); ``loadContext=false`` leaves them out."""
    body = ListSchedulesBody(
        status=status,
        workflow_name=workflowName,
        schedule_name_prefix=scheduleNamePrefix,
        load_context=loadContext,
        application_name=owned_by(app),
    )
    reply = answered(await ctx.gateway.ask(org, app, lambda: ListSchedulesRequest(body=body), ListSchedulesReply))
    return [shapes.schedule(s) for s in reply.output]


@router.get("/{schedule_name}", response_model=shapes.Schedule)
async def get_schedule(
    org: str,
    app: str,
    schedule_name: PathId,
    ctx: Ctx,
    _: Caller,
    loadContext: bool = True,
) -> shapes.Schedule:
    """One schedule with its context (``loadContext=false`` leaves it out), as :func:`list_schedules`."""

    def ask() -> GetScheduleRequest:
        return GetScheduleRequest(schedule_name=schedule_name, load_context=loadContext)

    reply = answered(await ctx.gateway.ask(org, app, ask, GetScheduleReply))
    if reply.output is None or not_the_apps(app, reply.output.application_name):
        raise ApiError(404, "not_found", f"no schedule {schedule_name!r} in app {app!r}")
    return shapes.schedule(reply.output)


async def _must_exist(ctx: Ctx, org: str, app: str, schedule_name: str) -> None:
    """404 for a schedule the app does not have: DBOS 3.2 pauses or resumes an unknown name by
    updating no row, and answers ``success: true``, so a misspelt name read as paused. Another app's
    schedule (apps may share a system database, which the SDK reads whole) is one the app does not have."""

    def ask() -> GetScheduleRequest:
        return GetScheduleRequest(schedule_name=schedule_name, load_context=False)

    found = answered(await ctx.gateway.ask(org, app, ask, GetScheduleReply)).output
    if found is None or not_the_apps(app, found.application_name):
        raise ApiError(404, "not_found", f"no schedule {schedule_name!r} in app {app!r}")


async def _must_be_the_apps(ctx: Ctx, org: str, app: str, schedule_name: str) -> None:
    """404 for a schedule the app does not have, asked before a trigger or a backfill: another app's
    (apps may share a system database, which the SDK reads whole) and one no app has get the same
    answer, so that a key limited to this app cannot tell the other apps' schedule names from names
    nothing has (the SDK's own 404 for the latter was worded otherwise). An SDK that cannot say is
    left to its own answer, as before."""
    try:
        await _must_exist(ctx, org, app, schedule_name)
    except UnsupportedMessage:
        return


@router.post("/{schedule_name}/pause", status_code=204, response_class=Response)
async def pause_schedule(org: str, app: str, schedule_name: PathId, ctx: Ctx, who: Admin) -> Response:
    def ask() -> PauseScheduleRequest:
        return PauseScheduleRequest(schedule_name=schedule_name)

    async with audited(ctx, org, app, "schedule.pause", actor(who), {"scheduleName": schedule_name}):
        await _must_exist(ctx, org, app, schedule_name)
        answered(await ctx.gateway.ask(org, app, ask, PauseScheduleReply), success=True)
    return Response(status_code=204)


@router.post("/{schedule_name}/resume", status_code=204, response_class=Response)
async def resume_schedule(org: str, app: str, schedule_name: PathId, ctx: Ctx, who: Admin) -> Response:
    def ask() -> ResumeScheduleRequest:
        return ResumeScheduleRequest(schedule_name=schedule_name)

    async with audited(ctx, org, app, "schedule.resume", actor(who), {"scheduleName": schedule_name}):
        await _must_exist(ctx, org, app, schedule_name)
        answered(await ctx.gateway.ask(org, app, ask, ResumeScheduleReply), success=True)
    return Response(status_code=204)


@router.post("/{schedule_name}/trigger", status_code=201, response_model=shapes.WorkflowIdOut)
async def trigger_schedule(org: str, app: str, schedule_name: PathId, ctx: Ctx, who: Admin) -> shapes.WorkflowIdOut:
    """Run the scheduled workflow now. Never retried: each trigger starts a new workflow."""
    request = TriggerScheduleRequest(schedule_name=schedule_name)
    detail = {"scheduleName": schedule_name}
    async with audited(ctx, org, app, "schedule.trigger", actor(who), detail):
        await _must_be_the_apps(ctx, org, app, schedule_name)
        reply = answered(await ctx.gateway.ask(org, app, lambda: request, TriggerScheduleReply, repeatable=False))
        if reply.workflow_id is None:
            raise ApiError(502, "executor_error", "the executor started no workflow")
    return shapes.WorkflowIdOut(workflowId=reply.workflow_id)


@router.post("/{schedule_name}/backfill", response_model=shapes.WorkflowIdsOut)
async def backfill_schedule(
    org: str, app: str, schedule_name: PathId, body: BackfillIn, ctx: Ctx, who: Admin
) -> shapes.WorkflowIdsOut:
    """Enqueue the runs the schedule would have made between the two times (ids per time: safe to repeat)."""
    start, end = sdk_time(body.startTime), sdk_time(body.endTime)

    def ask() -> BackfillScheduleRequest:
        return BackfillScheduleRequest(schedule_name=schedule_name, start=start, end=end)

    detail = {"scheduleName": schedule_name, "startTime": start, "endTime": end}
    async with audited(ctx, org, app, "schedule.backfill", actor(who), detail):
        await _must_be_the_apps(ctx, org, app, schedule_name)
        reply = answered(await ctx.gateway.ask(org, app, ask, BackfillScheduleReply))
    return shapes.WorkflowIdsOut(workflowIds=reply.workflow_ids)
