"""An app's workflows, as DBOS Conductor's API serves them: asked of a healthy executor of the app.

Reads need ``application.read``; changes ``application.write`` and are audited.
Export and import carry a pickled payload that the executor unpickles, so
both need ``application.write``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import logging
import uuid
from collections.abc import Coroutine
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request, Response
from pydantic import AfterValidator, ConfigDict, Field, WithJsonSchema

from relay.api import shapes
from relay.api.common import (
    INT32_MAX,
    MAX_OFFSET,
    MAX_PAGE,
    MAX_SAFE_INTEGER,
    Admin,
    ApiError,
    AppDefinedName,
    Caller,
    ConductorBody,
    Ctx,
    DecodedRoute,
    JsonInteger,
    Name,
    NonEmptyWorkflowId,
    PathId,
    QueueOrScheduleName,
    WorkflowId,
    actor,
    answered,
    audited,
    not_the_apps,
)
from relay.api.shapes import WORKFLOW_STATUSES, UtcTime
from relay.core.ids import owned_by
from relay.core.times import sdk_time
from relay.errors import UnsupportedMessage
from relay_protocol import (
    CancelReply,
    CancelRequest,
    DeleteReply,
    DeleteRequest,
    ExportWorkflowReply,
    ExportWorkflowRequest,
    ForkFromFailureBody,
    ForkFromFailureReply,
    ForkFromFailureRequest,
    ForkWorkflowBody,
    ForkWorkflowReply,
    ForkWorkflowRequest,
    GetStepAggregatesBody,
    GetStepAggregatesReply,
    GetStepAggregatesRequest,
    GetWorkflowAggregatesBody,
    GetWorkflowAggregatesReply,
    GetWorkflowAggregatesRequest,
    GetWorkflowEventsReply,
    GetWorkflowEventsRequest,
    GetWorkflowNotificationsReply,
    GetWorkflowNotificationsRequest,
    GetWorkflowReply,
    GetWorkflowRequest,
    GetWorkflowStreamsReply,
    GetWorkflowStreamsRequest,
    ImportWorkflowReply,
    ImportWorkflowRequest,
    ListApplicationVersionsReply,
    ListApplicationVersionsRequest,
    ListStepsReply,
    ListStepsRequest,
    ListWorkflowsBody,
    ListWorkflowsReply,
    ListWorkflowsRequest,
    Reply,
    ResumeReply,
    ResumeRequest,
)

log = logging.getLogger("relay.http")
R = TypeVar("R", bound=Reply)
router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}", tags=["workflows"])
Names = list[Name] | None
WorkflowIds = list[WorkflowId] | None
QueueOrScheduleNames = list[QueueOrScheduleName] | None
AppDefinedNames = list[AppDefinedName] | None


def _known_status(value: str) -> str:
    if value not in WORKFLOW_STATUSES:
        raise ValueError(f"no workflow status {value}: one of {', '.join(WORKFLOW_STATUSES)}")
    return value


WorkflowStatus = Annotated[
    str, AfterValidator(_known_status), WithJsonSchema({"type": "string", "enum": list(WORKFLOW_STATUSES)})
]
Statuses = list[WorkflowStatus] | None


class WorkflowSearch(ConductorBody):
    """Conductor's WorkflowSearchBody: every filter optional, lists of values where the SDK takes them."""

    workflowIds: WorkflowIds = None
    workflowName: AppDefinedNames = None
    workflowIdPrefix: WorkflowIds = None
    status: Statuses = None
    queueName: QueueOrScheduleNames = None
    scheduleName: QueueOrScheduleNames = None
    user: AppDefinedNames = None
    executorId: Names = None
    appVersion: Names = None
    parentWorkflowId: WorkflowIds = None
    forkedFrom: WorkflowIds = None
    startTime: UtcTime | None = None
    endTime: UtcTime | None = None
    completedAfter: UtcTime | None = None
    completedBefore: UtcTime | None = None
    dequeuedAfter: UtcTime | None = None
    dequeuedBefore: UtcTime | None = None
    hasParent: bool | None = None
    wasForkedFrom: bool | None = None
    queuesOnly: bool = False
    loadInput: bool = False
    loadOutput: bool = False
    sortDesc: bool = False
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE), JsonInteger] | None = None
    offset: Annotated[int, Field(ge=0, le=MAX_OFFSET), JsonInteger] | None = None
    attributes: dict[str, Any] | None = None

    def body(self) -> ListWorkflowsBody:
        def when(value: datetime | None) -> str | None:
            return sdk_time(value) if value is not None else None

        return ListWorkflowsBody(
            workflow_uuids=self.workflowIds,
            workflow_name=self.workflowName,
            workflow_id_prefix=self.workflowIdPrefix,
            status=self.status,
            queue_name=self.queueName,
            schedule_name=self.scheduleName,
            authenticated_user=self.user,
            executor_id=self.executorId,
            application_version=self.appVersion,
            parent_workflow_id=self.parentWorkflowId,
            forked_from=self.forkedFrom,
            start_time=when(self.startTime),
            end_time=when(self.endTime),
            completed_after=when(self.completedAfter),
            completed_before=when(self.completedBefore),
            dequeued_after=when(self.dequeuedAfter),
            dequeued_before=when(self.dequeuedBefore),
            has_parent=self.hasParent,
            was_forked_from=self.wasForkedFrom,
            queues_only=self.queuesOnly,
            # The Python SDK loads inputs and outputs unless told not to: always say which.
            load_input=self.loadInput,
            load_output=self.loadOutput,
            sort_desc=self.sortDesc,
            limit=self.limit if self.limit is not None else MAX_PAGE,
            offset=self.offset,
            attributes=self.attributes,
        )


# What DBOS 3.2 does nothing to, yet answers ``success: true`` for: cancelling or deleting a workflow
# that does not exist, resuming one that has finished. Relay asks first (one list of the ids), so an
# operator or an agent is not told "cancelled" for a typo'd id; a workflow that finishes between the
# look and the action is the SDK's no-op, as before.
FINISHED = ("SUCCESS", "ERROR")


async def _statuses(ctx: Ctx, org: str, app: str, ids: list[str]) -> dict[str, str]:
    """The status of each of ``ids`` that exists, as a healthy executor of the app reads it."""
    search = WorkflowSearch.model_construct(workflowIds=ids, limit=len(ids))  # ids already checked as such
    return {w.workflowId: w.status or "" for w in await _list(ctx, org, app, search)}


async def _must_exist(ctx: Ctx, org: str, app: str, ids: list[str]) -> dict[str, str]:
    """404 naming the ids of ``ids`` that no workflow has; else their statuses."""
    found = await _statuses(ctx, org, app, ids)
    missing = [i for i in dict.fromkeys(ids) if i not in found]
    if missing:
        names = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        what = "workflow" if len(missing) == 1 else "workflows"
        raise ApiError(404, "not_found", f"{what} {names} not found")
    return found


async def _must_be_a_version(ctx: Ctx, org: str, app: str, version: str | None) -> None:
    """404 for a version the app never had: a fork onto it would wait, enqueued, for an executor of
    that version that never comes (the SDK takes it). An SDK that cannot list its versions is not
    asked again (the fork goes ahead, as before)."""
    if version is None:
        return
    try:
        reply = await ctx.gateway.ask(org, app, ListApplicationVersionsRequest, ListApplicationVersionsReply)
    except UnsupportedMessage:
        return
    known = {v.version_name for v in answered(reply).output}
    if version not in known:
        raise ApiError(404, "not_found", f"no version {version!r} of app {app!r}")


async def _must_be_resumable(ctx: Ctx, org: str, app: str, ids: list[str]) -> None:
    """404 for an id no workflow has, 409 for a workflow that has finished: DBOS resumes neither."""
    found = await _must_exist(ctx, org, app, ids)
    done = [f"{i} ({found[i]})" for i in dict.fromkeys(ids) if found[i] in FINISHED]
    if done:
        raise ApiError(
            409,
            "conflict",
            f"workflow {', '.join(done[:10])} has finished and cannot be resumed; fork it to run it again"
            if len(done) == 1
            else f"workflows {', '.join(done[:10])} have finished and cannot be resumed; fork them to run them again",
        )


async def _must_be_the_apps(ctx: Ctx, org: str, app: str, workflow_id: str) -> None:
    """404 unless the workflow exists and is ``app``'s, asked before a change that names one workflow
    (a fork) and with a read that the SDK serves from the whole system database (:func:`_read_of_the_apps`):
    another app's workflow is answered as one that does not exist. It also makes a typo'd id a 404,
    where the SDK answers ``[]`` for a workflow it never heard of."""
    await _must_exist(ctx, org, app, [workflow_id])


async def _read_of_the_apps(ctx: Ctx, org: str, app: str, workflow_id: str, read: Coroutine[Any, Any, R]) -> R:
    """``read``'s reply, asked at the same time as :func:`_must_be_the_apps` (one round trip, not
    two in a row): the steps, events, notifications, streams or export of one workflow change
    nothing, so another app's is read and its answer dropped. The check's answer comes first, as
    when it was asked first: its error (a 404, 429, 502, 503...) is the answer, and the read still
    under way is cancelled; then the read's error, else its reply. The two are two requests in
    flight, each counted against ``maxExecutorRequestsPerApp``."""
    reading = asyncio.create_task(read)
    try:
        await _must_be_the_apps(ctx, org, app, workflow_id)
    except BaseException:
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)  # its error, if it had one, is not the answer
        raise
    return await reading


async def _list(ctx: Ctx, org: str, app: str, search: WorkflowSearch) -> list[shapes.Workflow]:
    body = dataclasses.replace(search.body(), application_name=owned_by(app))
    reply = await ctx.gateway.ask(org, app, lambda: ListWorkflowsRequest(body=body), ListWorkflowsReply)
    return [shapes.workflow(w) for w in answered(reply).output]


# The list's query parameters that take one value: given twice, which one was meant is not known.
SINGLE_VALUED = ("limit", "offset", "sortDesc", "loadInput", "loadOutput")
LIST_PARAMETERS = frozenset({"status", "workflowName", *SINGLE_VALUED})


@router.get("/workflows", response_model=list[shapes.Workflow])
async def list_workflows(
    request: Request,
    org: str,
    app: str,
    ctx: Ctx,
    _: Caller,
    status: Annotated[
        list[Name],
        # "" filters nothing (as before); another status is refused: the document says which there are.
        Query(default_factory=list, json_schema_extra={"items": {"type": "string", "enum": ["", *WORKFLOW_STATUSES]}}),
    ],
    workflowName: Annotated[list[AppDefinedName], Query(default_factory=list)],
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    sortDesc: bool = False,
    loadInput: bool = False,
    loadOutput: bool = False,
) -> list[shapes.Workflow]:
    """``status`` and ``workflowName`` may be repeated (any of the values), as the search's lists;
    the other parameters are refused when repeated."""
    repeated = [name for name in SINGLE_VALUED if len(request.query_params.getlist(name)) > 1]
    if repeated:
        message = f"given more than once: {', '.join(repeated)} (one value each)"
        raise ApiError(422, "invalid_request", message, [f"query.{name}" for name in repeated])
    # What this route does not take was ignored: ?startTime=... listed every workflow, as if it
    # had filtered them. The search (POST .../workflows/search) takes every filter.
    unknown = sorted(set(request.query_params) - LIST_PARAMETERS)
    if unknown:
        raise ApiError(
            422,
            "invalid_request",
            f"not a parameter of this list: {', '.join(unknown)} (it takes {', '.join(sorted(LIST_PARAMETERS))}; "
            "POST .../workflows/search takes every filter)",
            [f"query.{name}" for name in unknown],
        )
    wrong = [v for v in status if v and v not in WORKFLOW_STATUSES]
    if wrong:
        known = ", ".join(WORKFLOW_STATUSES)
        message = f"no workflow status {', '.join(wrong)}: one of {known}"
        raise ApiError(422, "invalid_request", message, ["query.status"])
    search = WorkflowSearch(
        status=[v for v in status if v] or None,  # status= (empty) filters nothing, as before
        workflowName=[v for v in workflowName if v] or None,
        limit=limit,
        offset=offset,
        sortDesc=sortDesc,
        loadInput=loadInput,
        loadOutput=loadOutput,
    )
    return await _list(ctx, org, app, search)


@router.post("/workflows/search", response_model=list[shapes.Workflow])
async def search_workflows(
    org: str, app: str, ctx: Ctx, _: Caller, search: WorkflowSearch | None = None
) -> list[shapes.Workflow]:
    return await _list(ctx, org, app, search or WorkflowSearch())


def at_least_one(*flags: str, number: str | None = None) -> dict[str, Any]:
    """The schema of "one of these booleans true, or ``number`` given" (what the SDK needs to group by)."""
    ways: list[dict[str, Any]] = [{"required": [flag], "properties": {flag: {"const": True}}} for flag in flags]
    if number is not None:
        ways.append({"required": [number], "properties": {number: {"type": "integer"}}})
    return {"anyOf": ways}


WORKFLOW_GROUPS = (
    "groupByStatus",
    "groupByWorkflowName",
    "groupByQueueName",
    "groupByExecutorId",
    "groupByAppVersion",
    "groupByApplicationName",
)


class WorkflowAggregates(ConductorBody):
    """Groups by one or more members (``timeBucketSizeMs`` groups by time); selects the count unless
    told what else."""

    model_config = ConfigDict(json_schema_extra=at_least_one(*WORKFLOW_GROUPS, number="timeBucketSizeMs"))

    groupByStatus: bool = False
    groupByWorkflowName: bool = False
    groupByQueueName: bool = False
    groupByExecutorId: bool = False
    groupByAppVersion: bool = False
    groupByApplicationName: bool = False
    selectCount: bool = False
    selectMinCreatedAt: bool = False
    selectMaxQueueWaitMs: bool = False
    selectMaxTotalLatencyMs: bool = False
    hasParent: bool | None = None
    wasForkedFrom: bool | None = None
    timeBucketSizeMs: Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER), JsonInteger] | None = None
    status: Statuses = None
    workflowName: AppDefinedNames = None
    appVersion: Names = None
    executorId: Names = None
    queueName: QueueOrScheduleNames = None
    workflowIdPrefix: WorkflowIds = None
    workflowIds: WorkflowIds = None
    forkedFrom: WorkflowIds = None
    parentWorkflowId: WorkflowIds = None
    user: AppDefinedNames = None
    scheduleName: QueueOrScheduleNames = None
    startTime: UtcTime | None = None
    endTime: UtcTime | None = None
    completedAfter: UtcTime | None = None
    completedBefore: UtcTime | None = None
    dequeuedAfter: UtcTime | None = None
    dequeuedBefore: UtcTime | None = None
    attributes: dict[str, Any] | None = None

    def groups(self) -> bool:
        return self.timeBucketSizeMs is not None or any(getattr(self, flag) for flag in WORKFLOW_GROUPS)


def _when(value: datetime | None) -> str | None:
    return sdk_time(value) if value is not None else None


def _ungrouped(by: str) -> ApiError:
    """The SDK refuses an aggregate with nothing to group by (a ValueError, which would be a 502)."""
    return ApiError(422, "invalid_request", f"nothing to group by: give timeBucketSizeMs or set one of {by}", ["body"])


@router.post("/workflows/aggregates", response_model=list[shapes.WorkflowAggregate], response_model_exclude_none=True)
async def workflow_aggregates(
    org: str, app: str, q: WorkflowAggregates, ctx: Ctx, _: Caller
) -> list[shapes.WorkflowAggregate]:
    if not q.groups():
        raise _ungrouped(", ".join(WORKFLOW_GROUPS))
    body = GetWorkflowAggregatesBody(
        group_by_status=q.groupByStatus,
        group_by_name=q.groupByWorkflowName,
        group_by_queue_name=q.groupByQueueName,
        group_by_executor_id=q.groupByExecutorId,
        group_by_application_version=q.groupByAppVersion,
        group_by_application_name=q.groupByApplicationName,
        select_count=q.selectCount,
        select_min_created_at=q.selectMinCreatedAt,
        select_max_queue_wait_ms=q.selectMaxQueueWaitMs,
        select_max_total_latency_ms=q.selectMaxTotalLatencyMs,
        time_bucket_size_ms=q.timeBucketSizeMs,
        status=q.status,
        name=q.workflowName,
        app_version=q.appVersion,
        executor_id=q.executorId,
        queue_name=q.queueName,
        workflow_id_prefix=q.workflowIdPrefix,
        workflow_ids=q.workflowIds,
        forked_from=q.forkedFrom,
        parent_workflow_id=q.parentWorkflowId,
        user=q.user,
        schedule_name=q.scheduleName,
        start_time=_when(q.startTime),
        end_time=_when(q.endTime),
        completed_after=_when(q.completedAfter),
        completed_before=_when(q.completedBefore),
        dequeued_after=_when(q.dequeuedAfter),
        dequeued_before=_when(q.dequeuedBefore),
        was_forked_from=q.wasForkedFrom,
        has_parent=q.hasParent,
        attributes=q.attributes,
        application_name=owned_by(app),
    )
    reply = await ctx.gateway.ask(org, app, lambda: GetWorkflowAggregatesRequest(body=body), GetWorkflowAggregatesReply)
    return [shapes.workflow_aggregate(a) for a in answered(reply).output]


class StepAggregates(ConductorBody):
    """Groups by one or both members (``timeBucketSizeMs`` groups by time)."""

    model_config = ConfigDict(
        json_schema_extra=at_least_one("groupByFunctionName", "groupByStatus", number="timeBucketSizeMs")
    )

    groupByFunctionName: bool = False
    groupByStatus: bool = False
    selectCount: bool = False
    selectMaxDurationMs: bool = False
    timeBucketSizeMs: Annotated[int, Field(ge=1, le=MAX_SAFE_INTEGER), JsonInteger] | None = None
    status: Names = None
    stepName: AppDefinedNames = None
    workflowIdPrefix: WorkflowIds = None
    completedAfter: UtcTime | None = None
    completedBefore: UtcTime | None = None

    def groups(self) -> bool:
        return self.timeBucketSizeMs is not None or self.groupByFunctionName or self.groupByStatus


@router.post("/steps/aggregates", response_model=list[shapes.StepAggregate], response_model_exclude_none=True)
async def step_aggregates(org: str, app: str, q: StepAggregates, ctx: Ctx, _: Caller) -> list[shapes.StepAggregate]:
    if not q.groups():
        raise _ungrouped("groupByFunctionName, groupByStatus")
    body = GetStepAggregatesBody(
        group_by_function_name=q.groupByFunctionName,
        group_by_status=q.groupByStatus,
        select_count=q.selectCount,
        select_max_duration_ms=q.selectMaxDurationMs,
        time_bucket_size_ms=q.timeBucketSizeMs,
        status=q.status,
        function_name=q.stepName,
        workflow_id_prefix=q.workflowIdPrefix,
        completed_after=_when(q.completedAfter),
        completed_before=_when(q.completedBefore),
        application_name=owned_by(app),
    )
    reply = await ctx.gateway.ask(org, app, lambda: GetStepAggregatesRequest(body=body), GetStepAggregatesReply)
    return [shapes.step_aggregate(a) for a in answered(reply).output]


# -- one workflow ------------------------------------------------------------------------------


class CancelIn(ConductorBody):
    cancelChildren: bool = False


class ResumeIn(ConductorBody):
    queueName: QueueOrScheduleName | None = None


class ForkIn(ConductorBody):
    # By default from the first step, whichever the SDK: the TypeScript SDK numbers steps from 0,
    # the Python SDK from 1 (to which 0 and 1 are the same: the steps before it are copied).
    startStep: Annotated[int, Field(ge=0, le=INT32_MAX), JsonInteger] = 0
    appVersion: Name | None = None
    newWorkflowId: NonEmptyWorkflowId | None = None
    queueName: QueueOrScheduleName | None = None
    queuePartitionKey: AppDefinedName | None = None


def exported(text: str) -> str:
    """``text``, if it is what an export gives: gzip in base64 (the executor unpickles what that holds)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not base64: {exc}") from None
    if not raw.startswith(GZIP_MAGIC):
        raise ValueError("not an exported workflow: an export is gzip in base64")
    return text


GZIP_MAGIC = b"\x1f\x8b"


class SerializedIn(ConductorBody):
    serializedWorkflow: Annotated[str, AfterValidator(exported)]


@router.post("/workflows/import", status_code=201, response_class=Response)
async def import_workflow(org: str, app: str, body: SerializedIn, ctx: Ctx, who: Admin) -> Response:
    """Import a workflow exported by ``GET .../export``. Never retried: an import is not safe to repeat."""
    request = ImportWorkflowRequest(serialized_workflow=body.serializedWorkflow)
    async with audited(ctx, org, app, "workflow.import", actor(who), {}):
        answered(await ctx.gateway.ask(org, app, lambda: request, ImportWorkflowReply, repeatable=False))
    return Response(status_code=201)


@router.get("/workflows/{workflow_id}", response_model=shapes.Workflow)
async def get_workflow(
    org: str,
    app: str,
    workflow_id: PathId,
    ctx: Ctx,
    _: Caller,
    loadInput: bool = True,
    loadOutput: bool = True,
) -> shapes.Workflow:
    """One workflow with its input, output and error, as Conductor's getWorkflow (which takes no
    parameters) has it; ``loadInput=false``/``loadOutput=false`` leave them out (Relay's own)."""

    def ask() -> GetWorkflowRequest:
        return GetWorkflowRequest(workflow_id=workflow_id, load_input=loadInput, load_output=loadOutput)

    reply = answered(await ctx.gateway.ask(org, app, ask, GetWorkflowReply))
    if reply.output is None or not_the_apps(app, reply.output.application_name):
        raise ApiError(404, "not_found", f"workflow {workflow_id} not found")
    return shapes.workflow(reply.output)


@router.get("/workflows/{workflow_id}/steps", response_model=list[shapes.Step])
async def list_steps(
    org: str,
    app: str,
    workflow_id: PathId,
    ctx: Ctx,
    _: Caller,
    limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE)] = None,
    offset: Annotated[int | None, Query(ge=0, le=MAX_OFFSET)] = None,
    loadOutput: bool = True,
) -> list[shapes.Step]:
    """The workflow's steps with their outputs, as Conductor's listWorkflowSteps (no loadOutput there)."""

    def ask() -> ListStepsRequest:
        return ListStepsRequest(workflow_id=workflow_id, load_output=loadOutput, limit=limit, offset=offset)

    asking = ctx.gateway.ask(org, app, ask, ListStepsReply)
    reply = answered(await _read_of_the_apps(ctx, org, app, workflow_id, asking))
    return [shapes.step(s) for s in reply.output or []]


@router.get("/workflows/{workflow_id}/events", response_model=list[shapes.Event])
async def workflow_events(org: str, app: str, workflow_id: PathId, ctx: Ctx, _: Caller) -> list[shapes.Event]:
    asking = ctx.gateway.ask(
        org, app, lambda: GetWorkflowEventsRequest(workflow_id=workflow_id), GetWorkflowEventsReply
    )
    reply = await _read_of_the_apps(ctx, org, app, workflow_id, asking)
    return [shapes.event(e) for e in answered(reply).events or []]


@router.get("/workflows/{workflow_id}/notifications", response_model=list[shapes.Notification])
async def workflow_notifications(
    org: str, app: str, workflow_id: PathId, ctx: Ctx, _: Caller
) -> list[shapes.Notification]:
    asking = ctx.gateway.ask(
        org, app, lambda: GetWorkflowNotificationsRequest(workflow_id=workflow_id), GetWorkflowNotificationsReply
    )
    reply = await _read_of_the_apps(ctx, org, app, workflow_id, asking)
    return [shapes.notification(n) for n in answered(reply).notifications or []]


@router.get("/workflows/{workflow_id}/streams", response_model=list[shapes.StreamEntry])
async def workflow_streams(org: str, app: str, workflow_id: PathId, ctx: Ctx, _: Caller) -> list[shapes.StreamEntry]:
    asking = ctx.gateway.ask(
        org, app, lambda: GetWorkflowStreamsRequest(workflow_id=workflow_id), GetWorkflowStreamsReply
    )
    reply = await _read_of_the_apps(ctx, org, app, workflow_id, asking)
    return [shapes.stream(s) for s in answered(reply).streams or []]


@router.get("/workflows/{workflow_id}/export", response_model=shapes.SerializedWorkflow)
async def export_workflow(
    org: str,
    app: str,
    workflow_id: PathId,
    ctx: Ctx,
    who: Admin,
    exportChildren: bool = False,
) -> shapes.SerializedWorkflow:
    """The workflow (and its children, if asked) as an opaque blob for ``POST .../workflows/import``."""

    def ask() -> ExportWorkflowRequest:
        return ExportWorkflowRequest(workflow_id=workflow_id, export_children=exportChildren)

    asking = ctx.gateway.ask(org, app, ask, ExportWorkflowReply)
    reply = answered(await _read_of_the_apps(ctx, org, app, workflow_id, asking))
    if reply.serialized_workflow is None:
        raise ApiError(404, "not_found", f"workflow {workflow_id} not found")
    return shapes.SerializedWorkflow(serializedWorkflow=reply.serialized_workflow)


@router.post("/workflows/{workflow_id}/cancel", status_code=204, response_class=Response)
async def cancel_workflow(
    org: str, app: str, workflow_id: PathId, ctx: Ctx, who: Admin, body: CancelIn | None = None
) -> Response:
    children = (body or CancelIn()).cancelChildren

    def ask() -> CancelRequest:
        return CancelRequest(workflow_id=workflow_id, cancel_children=children)

    async with audited(ctx, org, app, "workflow.cancel", actor(who), {"workflowIds": [workflow_id]}):
        await _must_exist(ctx, org, app, [workflow_id])
        answered(await ctx.gateway.ask(org, app, ask, CancelReply), success=True)
    return Response(status_code=204)


@router.post("/workflows/{workflow_id}/resume", status_code=204, response_class=Response)
async def resume_workflow(
    org: str, app: str, workflow_id: PathId, ctx: Ctx, who: Admin, body: ResumeIn | None = None
) -> Response:
    queue = (body or ResumeIn()).queueName

    def ask() -> ResumeRequest:
        return ResumeRequest(workflow_id=workflow_id, queue_name=queue)

    async with audited(ctx, org, app, "workflow.resume", actor(who), {"workflowIds": [workflow_id]}):
        await _must_be_resumable(ctx, org, app, [workflow_id])
        answered(await ctx.gateway.ask(org, app, ask, ResumeReply), success=True)
    return Response(status_code=204)


@router.post("/workflows/{workflow_id}/fork", status_code=201, response_model=shapes.WorkflowIdOut)
async def fork_workflow(
    org: str, app: str, workflow_id: PathId, ctx: Ctx, who: Admin, body: ForkIn | None = None
) -> shapes.WorkflowIdOut:
    """Fork from a step. The new workflow's id is chosen before the first executor is asked (Relay
    draws one if the caller gave none), so asking another executor after a timeout cannot fork twice."""
    fork = body or ForkIn()
    new_id = fork.newWorkflowId or str(uuid.uuid4())
    spec = ForkWorkflowBody(
        workflow_id=workflow_id,
        start_step=fork.startStep,
        application_version=fork.appVersion,
        new_workflow_id=new_id,
        queue_name=fork.queueName,
        queue_partition_key=fork.queuePartitionKey,
    )
    detail = {"workflowIds": [workflow_id], "newWorkflowId": new_id, "startStep": fork.startStep}
    async with audited(ctx, org, app, "workflow.fork", actor(who), detail):
        await _must_be_the_apps(ctx, org, app, workflow_id)
        await _must_be_a_version(ctx, org, app, fork.appVersion)
        reply = await ctx.gateway.ask(org, app, lambda: ForkWorkflowRequest(body=spec), ForkWorkflowReply)
        try:
            answered(reply)
        except ApiError as exc:
            # The id is taken: the executor's words are PostgreSQL's ("Key (workflow_uuid)=(...)
            # already exists" from Python, "duplicate key value violates ..." from TypeScript).
            if exc.status != 409:
                raise
            if not fork.newWorkflowId:
                # Relay drew the id for this request: only this fork can hold it. An executor asked
                # before made it and answered after the per-executor timeout; the next one found it.
                log.info("fork of %r: %s was made by an executor that answered late", workflow_id, new_id)
                return shapes.WorkflowIdOut(workflowId=new_id)
            raise ApiError(409, "conflict", f"a workflow with id {new_id} already exists") from exc
    return shapes.WorkflowIdOut(workflowId=reply.new_workflow_id or new_id)


@router.delete("/workflows/{workflow_id}", status_code=204, response_class=Response)
async def delete_workflow(
    org: str,
    app: str,
    workflow_id: PathId,
    ctx: Ctx,
    who: Admin,
    deleteChildren: bool = False,
) -> Response:
    def ask() -> DeleteRequest:
        return DeleteRequest(workflow_id=workflow_id, delete_children=deleteChildren)

    async with audited(ctx, org, app, "workflow.delete", actor(who), {"workflowIds": [workflow_id]}):
        await _must_exist(ctx, org, app, [workflow_id])
        answered(await ctx.gateway.ask(org, app, ask, DeleteReply), success=True)
    return Response(status_code=204)


# -- several workflows ---------------------------------------------------------------------------

Ids = Annotated[list[NonEmptyWorkflowId], Field(min_length=1, max_length=MAX_PAGE)]


class BulkCancel(ConductorBody):
    workflowIds: Ids
    cancelChildren: bool = False


class BulkResume(ConductorBody):
    workflowIds: Ids
    queueName: QueueOrScheduleName | None = None


class BulkDelete(ConductorBody):
    workflowIds: Ids
    deleteChildren: bool = False


class BulkForkFromFailure(ConductorBody):
    """Each workflow forked from exactly one of: its last failure, its last step, a step number, a step name."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["fromLastFailure"], "properties": {"fromLastFailure": {"const": True}}},
                {"required": ["fromLastStep"], "properties": {"fromLastStep": {"const": True}}},
                {"required": ["fromStep"], "properties": {"fromStep": {"type": "integer"}}},
                {"required": ["fromStepName"], "properties": {"fromStepName": {"type": "string"}}},
            ]
        }
    )

    workflowIds: Ids
    appVersion: Name | None = None
    queueName: QueueOrScheduleName | None = None
    queuePartitionKey: AppDefinedName | None = None
    fromLastFailure: bool = False
    fromLastStep: bool = False
    fromStep: Annotated[int, Field(ge=0, le=INT32_MAX), JsonInteger] | None = None
    fromStepName: AppDefinedName | None = None


@router.post("/workflows/bulk-cancel", status_code=204, response_class=Response)
async def bulk_cancel(org: str, app: str, body: BulkCancel, ctx: Ctx, who: Admin) -> Response:
    ids = body.workflowIds

    def ask() -> CancelRequest:
        return CancelRequest(workflow_id=ids[0], workflow_ids=ids, cancel_children=body.cancelChildren)

    async with audited(ctx, org, app, "workflow.bulk_cancel", actor(who), {"workflowIds": ids}):
        await _must_exist(ctx, org, app, ids)
        answered(await ctx.gateway.ask(org, app, ask, CancelReply), success=True)
    return Response(status_code=204)


@router.post("/workflows/bulk-resume", status_code=204, response_class=Response)
async def bulk_resume(org: str, app: str, body: BulkResume, ctx: Ctx, who: Admin) -> Response:
    ids = body.workflowIds

    def ask() -> ResumeRequest:
        return ResumeRequest(workflow_id=ids[0], workflow_ids=ids, queue_name=body.queueName)

    async with audited(ctx, org, app, "workflow.bulk_resume", actor(who), {"workflowIds": ids}):
        await _must_be_resumable(ctx, org, app, ids)
        answered(await ctx.gateway.ask(org, app, ask, ResumeReply), success=True)
    return Response(status_code=204)


@router.post("/workflows/bulk-delete", status_code=204, response_class=Response)
async def bulk_delete(org: str, app: str, body: BulkDelete, ctx: Ctx, who: Admin) -> Response:
    ids = body.workflowIds

    def ask() -> DeleteRequest:
        return DeleteRequest(workflow_id=ids[0], workflow_ids=ids, delete_children=body.deleteChildren)

    async with audited(ctx, org, app, "workflow.bulk_delete", actor(who), {"workflowIds": ids}):
        await _must_exist(ctx, org, app, ids)
        answered(await ctx.gateway.ask(org, app, ask, DeleteReply), success=True)
    return Response(status_code=204)


@router.post("/workflows/bulk-fork-from-failure", response_model=shapes.WorkflowIdsOut)
async def bulk_fork_from_failure(
    org: str, app: str, body: BulkForkFromFailure, ctx: Ctx, who: Admin
) -> shapes.WorkflowIdsOut:
    """Fork each workflow from its failure (or the step named). Never retried: each fork draws new ids."""
    chosen = [body.fromLastFailure, body.fromLastStep, body.fromStep is not None, body.fromStepName is not None]
    if sum(chosen) != 1:
        raise ApiError(
            422,
            "invalid_request",
            "give exactly one of fromLastFailure, fromLastStep, fromStep, fromStepName",
            ["body"],
        )
    spec = ForkFromFailureBody(
        workflow_ids=body.workflowIds,
        application_version=body.appVersion,
        queue_name=body.queueName,
        queue_partition_key=body.queuePartitionKey,
        from_last_failure=body.fromLastFailure,
        from_last_step=body.fromLastStep,
        from_step=body.fromStep,
        from_step_name=body.fromStepName,
    )
    request = ForkFromFailureRequest(body=spec)
    detail: dict[str, Any] = {"workflowIds": body.workflowIds}
    async with audited(ctx, org, app, "workflow.bulk_fork_from_failure", actor(who), detail):
        await _must_exist(ctx, org, app, body.workflowIds)  # the app's, as every action's
        await _must_be_a_version(ctx, org, app, body.appVersion)
        reply = answered(await ctx.gateway.ask(org, app, lambda: request, ForkFromFailureReply, repeatable=False))
        detail["forkedWorkflowIds"] = reply.forked_workflow_ids or []
    return shapes.WorkflowIdsOut(workflowIds=reply.forked_workflow_ids or [])
