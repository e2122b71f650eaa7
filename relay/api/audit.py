"""The audit log of an org: Relay's own listing (``/audit``, oldest first) and Conductor's
(``/audit-logs``, newest first, in Conductor's shape), also at the path and with the parameters
of Conductor's audit log page (``/conductor/v1alpha1/api/{org}/audit-logs``, and without
``/conductor``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from relay.api.common import MAX_OFFSET, ApiError, Ctx, DecodedRoute, QueryName, QueryWorkflowId, given, permitted
from relay.api.shapes import Rfc3339, Shape
from relay.auth import KeyGrant, Permission
from relay.core.times import us_iso
from relay.store.audit import ACTIONS, AuditMatch

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}")
# dbos-docs audit-logs.md: "https://cloud.dbos.dev/conductor/v1alpha1/api/{org}/audit-logs", its base
# changed to Relay's (served with and without /conductor, as the v2 API is). Not in the OpenAPI
# document, as Conductor's v2 document does not have it.
v1alpha1_router = APIRouter(route_class=DecodedRoute, prefix="/v1alpha1/api/{org}", include_in_schema=False)


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
    action: Annotated[QueryName | None, Query(json_schema_extra={"enum": list(ACTIONS)})] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    sortDesc: bool = False,
    untilId: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
) -> list[AuditEntry]:
    """Oldest first (newest first with ``sortDesc=true``), filtered by app, executor, action and time;
    ``untilId`` leaves out entries after that one (pages read later with the first page's newest id
    as ``untilId`` are not shifted by entries written since)."""
    if who.apps is not None and (app is None or app not in who.apps):
        # A key scoped to apps reads the entries of one of its apps, never the org's whole log.
        raise ApiError(403, "forbidden", "a key scoped to apps must name one of its apps: ?app=...")
    if action is not None and action not in ACTIONS:
        # An exact action, as the log has them: a typo found nothing, which read as "nothing happened".
        message = f"no audit action {action}: one of {', '.join(ACTIONS)}"
        raise ApiError(422, "invalid_request", message, ["query.action"])
    rows = await ctx.audit.list_entries(org, app, executor_id, since, limit, offset, action, sortDesc, untilId)
    return [
        AuditEntry(
            id=r["id"],
            at=us_iso(r["at"]),
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


# -- Conductor's listing ---------------------------------------------------------------------------

# Where Relay's action and Conductor's operation name the same thing differently; the others are
# served under Relay's names (Conductor has no executor, recovery or retention operations).
CONDUCTOR_OPERATION = {
    "token.created": "token.create",
    "token.deleted": "token.revoke",
    "settings.updated": "application.update",
    "workflow.bulk_fork_from_failure": "workflow.fork_from_failure",
}
RELAY_ACTION = {v: k for k, v in CONDUCTOR_OPERATION.items()}
# The detail key that names the target of each kind of action (Conductor's target types).
NAMED_BY = {"schedule": "scheduleName", "alerting_rule": "ruleId", "token": "tokenName"}


class AuditSubject(Shape):
    # "api_key" (an API key, by its name), "executor" (an executor whose connection registered an app),
    # or "relay" (Relay itself, relay.yaml, the first run)
    type: str
    id: str
    display: str


class AuditTarget(Shape):
    type: str
    id: str


class AuditLogEntry(Shape):
    """Conductor's ``AuditLogEntry`` (its document's ``listAuditLogs``): ``target`` left out when no
    one thing is the target, ``details`` null when there are none. ``sourceIp`` is the address of the
    API request that made the entry, "" for an entry Relay or an executor's connection made, or one
    written before Relay recorded addresses."""

    id: str
    emitTime: str
    operation: str
    status: Literal["success", "failure"]
    subject: AuditSubject
    target: AuditTarget | None = given()  # not null in the document: the answer leaves it out
    sourceIp: str
    details: dict[str, Any] | None


class AuditPageEntry(Shape):
    """An entry in the shape of Conductor's audit log page (dbos-docs ``audit-logs.md``): snake_case,
    ``target`` and ``details`` left out when there are none."""

    id: str
    emit_time: str
    operation: str
    status: Literal["success", "failure"]
    subject: AuditSubject
    target: AuditTarget | None = None
    source_ip: str
    details: dict[str, Any] | None = None


class AuditLogPage(Shape):
    entries: list[AuditPageEntry]


def _subject(actor: str) -> AuditSubject:
    if actor.startswith("api:"):
        name = actor.removeprefix("api:")
        return AuditSubject(type="api_key", id=name, display=name)
    if actor.startswith("executor:"):
        # executor:<executorId>@<host:port> (relay.store.executors): the executor, not Relay, did it. The
        # actor whole as id and display, as ?subject= matches it.
        return AuditSubject(type="executor", id=actor, display=actor)
    return AuditSubject(type="relay", id=actor, display=actor)


def _target(row: dict[str, Any]) -> AuditTarget | None:
    action, detail = row["action"], row["detail"] or {}
    ids = detail.get("workflowIds")
    kind, _, _ = action.partition(".")
    if kind == "workflow":
        if isinstance(ids, list) and len(ids) == 1 and not action.startswith("workflow.bulk_"):
            return AuditTarget(type="workflow", id=str(ids[0]))
        return None
    if kind in NAMED_BY:
        key = NAMED_BY[kind]
        return AuditTarget(type=kind, id=str(detail[key])) if detail.get(key) is not None else None
    if row["executor_id"] and kind != "application":
        # (An app registered by an executor's connection names that executor too: its target is the app.)
        return AuditTarget(type="executor", id=row["executor_id"])
    if row["app"]:
        return AuditTarget(type="application", id=row["app"])
    return None


def conductor_entry(row: dict[str, Any]) -> AuditLogEntry:
    detail = dict(row["detail"] or {})
    status: Literal["success", "failure"] = "failure" if detail.get("result") == "failure" else "success"
    details: dict[str, Any] = {**detail}
    if row["app"]:
        details["application_name"] = row["app"]
    if row["action"].startswith("workflow.bulk_") and "workflowIds" in detail:
        details["workflow_ids"] = detail["workflowIds"]
    if row["peer_executor_id"]:
        details["peer_executor_id"] = row["peer_executor_id"]
    # audit-logs.md, Details: "`permissions`, `applications` | `token.create`" (null: every app), and
    # "`private_mode` | `application.create`" (Relay has no private mode: every app's is false).
    if row["action"] == "token.created" and "appNames" in detail:
        details["applications"] = detail["appNames"]
    if row["action"] == "application.create":
        details["private_mode"] = False
    target = _target(row)
    # The column is NOT NULL: its time is always there.
    emitted = us_iso(row["at"]) or ""
    return AuditLogEntry(
        id=str(row["id"]),
        emitTime=emitted,
        operation=CONDUCTOR_OPERATION.get(row["action"], row["action"]),
        status=status,
        subject=_subject(row["actor"]),
        # Set only when there is one: the answer leaves out the members left unset.
        **({"target": target} if target is not None else {}),
        sourceIp=row["source_ip"] or "",
        details=details or None,
    )


def _page_entry(entry: AuditLogEntry) -> AuditPageEntry:
    return AuditPageEntry(
        id=entry.id,
        emit_time=entry.emitTime,
        operation=entry.operation,
        status=entry.status,
        subject=entry.subject,
        target=entry.target,
        source_ip=entry.sourceIp,
        details=entry.details,
    )


@router.get("/audit-logs", response_model=list[AuditLogEntry], response_model_exclude_unset=True)
async def list_audit_logs(
    org: str,
    ctx: Ctx,
    who: Reader,
    startTime: Rfc3339 | None = None,
    endTime: Rfc3339 | None = None,
    operation: QueryName | None = None,
    subject: QueryName | None = None,
    target: QueryWorkflowId | None = None,  # a workflow id is the longest target
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> list[AuditLogEntry]:
    """Conductor's ``listAuditLogs``: a JSON array, newest first; ``startTime`` inclusive, ``endTime`` exclusive;
    ``operation`` by Conductor's name or Relay's; ``subject`` a key's name; ``target`` a workflow id,
    an app, an executor, a schedule, a rule's id or a key's name. A key scoped to apps reads the
    entries of its apps."""
    return await _audit_log(ctx, org, who, startTime, endTime, operation, subject, target, limit, offset)


@v1alpha1_router.get("/audit-logs", response_model=AuditLogPage, response_model_exclude_none=True)
async def list_audit_logs_v1alpha1(
    org: str,
    ctx: Ctx,
    who: Reader,
    start: Rfc3339 | None = None,
    end: Rfc3339 | None = None,
    operation: QueryName | None = None,
    subject: QueryName | None = None,
    target: QueryWorkflowId | None = None,  # a workflow id is the longest target
    page_size: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> AuditLogPage:
    """``/audit-logs`` with the names and the shape of Conductor's audit log page: ``start`` and
    ``end`` for ``startTime`` and ``endTime``, ``page_size`` for ``limit``; ``{"entries": [...]}``."""
    found = await _audit_log(ctx, org, who, start, end, operation, subject, target, page_size, offset)
    return AuditLogPage(entries=[_page_entry(e) for e in found])


async def _audit_log(
    ctx: Ctx,
    org: str,
    who: KeyGrant,
    start: datetime | None,
    end: datetime | None,
    operation: str | None,
    subject: str | None,
    target: str | None,
    limit: int,
    offset: int,
) -> list[AuditLogEntry]:
    actions = None if operation is None else sorted({operation, RELAY_ACTION.get(operation, operation)})
    match = AuditMatch(start, end, actions, subject, target, None if who.apps is None else sorted(who.apps))
    rows = await ctx.audit.find(org, match, limit, offset)
    return [conductor_entry(r) for r in rows]
