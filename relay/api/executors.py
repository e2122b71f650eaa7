"""Executors: the registry's records, an operator's recovery, and an executor's own workflows."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from relay.api.apps import app_or_404
from relay.api.common import (
    DEFAULT_PAGE,
    MAX_PAGE,
    Admin,
    ApiError,
    Body,
    Caller,
    Ctx,
    DecodedRoute,
    PathId,
    WholePage,
    actor,
)
from relay.api.shapes import WORKFLOW_STATUSES, Shape, one_of
from relay.core.ids import ExecutorKey, owned_by
from relay.core.lifecycle import ExecutorState
from relay.core.times import ms_iso, us_iso
from relay.errors import (
    ExecutorBadReply,
    ExecutorNotConnected,
    ExecutorRefused,
    ExecutorRequestError,
    ExecutorTimeout,
    RequestNotServed,
)
from relay.store.executors import ExecutorRecord
from relay_protocol import ListWorkflowsBody, ListWorkflowsReply, ListWorkflowsRequest, clean_text

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}/executors")


class RecoverRequest(Body):
    model_config = ConfigDict(populate_by_name=True, alias_generator=to_camel)

    to_latest_version: bool = False


class Executor(Shape):
    """Conductor's Executor (``appId``, ``appVersion``, ``status``, ``createdAt``, ``updatedAt``...), with
    Relay's own members beside it (``state``, ``relayInstance``, ``blockedReason``...). Conductor's
    ``status`` has no RECOVERING: a recovering executor is DEAD there."""

    executorId: str
    appId: str
    appVersion: str
    status: str = one_of("HEALTHY", "DISCONNECTED", "DEAD")
    hostId: str | None
    executorMetadata: dict[str, Any] | None
    createdAt: str | None
    updatedAt: str | None
    org: str
    app: str
    state: ExecutorState
    applicationVersion: str
    hostname: str | None
    language: str | None
    dbosVersion: str | None
    metadata: dict[str, Any] | None
    connectedAt: str | None
    disconnectedAt: str | None
    deadAt: str | None
    relayInstance: str
    blockedReason: str | None
    graceEndsAt: str | None = Field(
        description="While DISCONNECTED: when its grace period ends, and it is declared DEAD unless it"
        " reconnects (the deadline its grace period workflow waits for); null otherwise."
    )


def executor(rec: ExecutorRecord, grace_ends: dict[ExecutorKey, datetime] | None = None) -> Executor:
    changed = [t for t in (rec.connected_at, rec.disconnected_at, rec.dead_at) if t is not None]
    return Executor(
        executorId=rec.key.executor_id,
        appId=rec.key.app,
        appVersion=rec.application_version,
        status="DEAD" if rec.state is ExecutorState.RECOVERING else rec.state.value,
        hostId=None,
        executorMetadata=rec.metadata,
        createdAt=us_iso(rec.first_seen_at or rec.connected_at),
        updatedAt=us_iso(max(changed)),
        org=rec.key.org,
        app=rec.key.app,
        state=rec.state,
        applicationVersion=rec.application_version,
        hostname=rec.hostname,
        language=rec.language,
        dbosVersion=rec.dbos_version,
        metadata=rec.metadata,
        connectedAt=us_iso(rec.connected_at),
        disconnectedAt=us_iso(rec.disconnected_at),
        deadAt=us_iso(rec.dead_at),
        relayInstance=rec.relay_instance,
        blockedReason=rec.blocked_reason,
        graceEndsAt=us_iso((grace_ends or {}).get(rec.key)),
    )


class RecoveryStarted(Shape):
    recoveryId: str
    newRun: bool = Field(
        description="Whether this request began the run; false: a run of this death was live already"
        " (waiting for a peer, an operator or its next attempt) and was woken to try again now."
    )


class ExecutorWorkflow(Shape):
    """One of an executor's workflows, as the executor lists them (Relay's own shape)."""

    workflowId: str
    status: str | None
    name: str | None
    queueName: str | None
    applicationVersion: str | None
    executorId: str | None
    createdAt: str | None
    updatedAt: str | None


@router.get("")
async def get_executors(
    org: str, app: str, ctx: Ctx, _: Caller, page: WholePage, state: ExecutorState | None = None
) -> list[Executor]:
    await app_or_404(ctx, org, app)
    executors = await ctx.executors.list_executors(org, app, state, page.limit, page.offset)
    grace_ends = await ctx.executors.grace_ends(executors)
    return [executor(e, grace_ends) for e in executors]


@router.get("/{executor_id}")
async def get_executor(org: str, app: str, executor_id: PathId, ctx: Ctx, _: Caller) -> Executor:
    rec = await ctx.executors.get(ExecutorKey(org, app, executor_id))
    if rec is None:
        raise ApiError(404, "not_found", f"no executor {executor_id!r} in {org}/{app}")
    return executor(rec, await ctx.executors.grace_ends([rec]))


@router.post("/{executor_id}/recover", status_code=202)
async def post_recover(
    org: str, app: str, executor_id: PathId, ctx: Ctx, who: Admin, body: RecoverRequest | None = None
) -> RecoveryStarted:
    """An operator's recovery: skips the rest of a grace period, or unblocks a waiting one."""
    body = body or RecoverRequest()
    key = ExecutorKey(org, app, executor_id)
    rid, new_run = await ctx.operator.recover(key, actor(who), body.to_latest_version)
    return RecoveryStarted(recoveryId=rid, newRun=new_run)


@router.get("/{executor_id}/workflows")
async def get_executor_workflows(
    org: str,
    app: str,
    executor_id: PathId,
    ctx: Ctx,
    _: Caller,
    status: Annotated[str | None, Query(json_schema_extra={"enum": list(WORKFLOW_STATUSES)})] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
) -> list[ExecutorWorkflow]:
    """The executor's own workflows, asked of it over its socket (``list_workflows``)."""
    if status is not None and status not in WORKFLOW_STATUSES:
        known = ", ".join(WORKFLOW_STATUSES)
        raise ApiError(422, "invalid_request", f"no workflow status {status}: one of {known}", ["query.status"])
    key = ExecutorKey(org, app, executor_id)
    # The app's own workflows (owned_by), as every other listing: an executor reads its whole system
    # database, which apps may share, and a key limited to this app reaches no other app's through it.
    body = ListWorkflowsBody(
        executor_id=executor_id,
        status=status,
        limit=limit,
        load_input=False,
        load_output=False,
        application_name=owned_by(app),
    )
    timeout = ctx.config.liveness.recovery_ack_timeout_secs
    try:
        reply = await ctx.router.ask(key, ListWorkflowsRequest(body=body), ListWorkflowsReply, timeout)
    except ExecutorNotConnected as exc:
        raise ApiError(409, "executor_not_connected", str(exc)) from exc
    except ExecutorTimeout as exc:
        raise ApiError(504, "executor_timeout", str(exc)) from exc
    except (ExecutorRefused, ExecutorBadReply) as exc:
        raise ApiError(502, "executor_error", str(exc)) from exc
    except RequestNotServed:
        raise  # the instance holding the socket failed, not the executor: the API's own answer
    except ExecutorRequestError as exc:
        raise ApiError(502, "executor_gone", str(exc)) from exc
    if reply.error_message:
        raise ApiError(502, "executor_error", clean_text(reply.error_message))
    return [
        ExecutorWorkflow(
            workflowId=w.workflow_id,
            status=w.status,
            name=w.workflow_name,
            queueName=w.queue_name,
            applicationVersion=w.application_version,
            executorId=w.executor_id,
            createdAt=ms_iso(w.created_at),
            updatedAt=ms_iso(w.updated_at),
        )
        for w in reply.output
    ]
