"""The REST API (contract section 7): JSON, camelCase, bearer API keys.

Errors always have the shape ``{"error": {"code": "...", "message": "..."}}``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.auth import KeyGrant
from relay.errors import DatabaseError, ExecutorNotConnected, ExecutorRequestError, ExecutorTimeout
from relay.lifecycle import ExecutorState
from relay.protocol import list_workflows
from relay.recoveries import AuditEntry, RecoveryRow
from relay.registry import AppRecord, ExecutorKey, ExecutorRecord
from relay.runtime import Runtime


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


def error_response(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def iso(ts: datetime | None) -> str | None:
    if ts is None:
        return None
    return ts.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _epoch_ms_iso(value: object) -> str | None:
    """The SDK sends workflow times as epoch milliseconds in a string."""
    try:
        return iso(datetime.fromtimestamp(int(str(value)) / 1000, UTC))
    except (TypeError, ValueError, OverflowError):
        return None


def _settings(app: AppRecord) -> dict[str, Any]:
    return {"executorTimeoutSecs": app.executor_timeout_secs, "recoverToLatestVersion": app.recover_to_latest_version}


def app_json(app: AppRecord) -> dict[str, Any]:
    return {
        "org": app.org,
        "name": app.name,
        **_settings(app),
        "executors": {state.value: n for state, n in app.counts.items()},
    }


def executor_json(rec: ExecutorRecord) -> dict[str, Any]:
    return {
        "executorId": rec.key.executor_id,
        "org": rec.key.org,
        "app": rec.key.app,
        "state": rec.state.value,
        "applicationVersion": rec.application_version,
        "hostname": rec.hostname,
        "language": rec.language,
        "dbosVersion": rec.dbos_version,
        "metadata": rec.metadata,
        "connectedAt": iso(rec.connected_at),
        "disconnectedAt": iso(rec.disconnected_at),
        "deadAt": iso(rec.dead_at),
        "relayInstance": rec.relay_instance,
        "blockedReason": rec.blocked_reason,
    }


def runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def caller(request: Request, org: str) -> KeyGrant:
    """The API key's grant, checked against the org in the path."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    grant = runtime(request).keyring.lookup(token.strip(), "api") if scheme.lower() == "bearer" else None
    if grant is None:
        raise ApiError(401, "unauthorized", "a valid API key is required: Authorization: Bearer <apiKey>")
    if grant.org != org:
        raise ApiError(403, "forbidden", f"this API key has no access to org {org!r}")
    return grant


def admin(request: Request, org: str) -> KeyGrant:
    grant = caller(request, org)
    if grant.role != "admin":
        raise ApiError(403, "forbidden", "this API key is read-only (role viewer)")
    return grant


Caller = Annotated[KeyGrant, Depends(caller)]
Admin = Annotated[KeyGrant, Depends(admin)]


class AppSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=to_camel)

    executor_timeout_secs: float | None = Field(default=None, gt=0, le=7 * 24 * 3600)
    recover_to_latest_version: bool | None = None


class RecoverRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, alias_generator=to_camel)

    to_latest_version: bool = False


Rt = Annotated[Runtime, Depends(runtime)]

v2 = APIRouter(prefix="/v2/orgs/{org}")


async def _app_or_404(rt: Runtime, org: str, app: str) -> AppRecord:
    apps = await rt.registry.list_apps(org, app)
    if not apps:
        raise ApiError(404, "not_found", f"no app {app!r} in org {org!r}")
    return apps[0]


@v2.get("/apps")
async def get_apps(org: str, rt: Rt, _: Caller) -> list[dict[str, Any]]:
    return [app_json(a) for a in await rt.registry.list_apps(org)]


@v2.get("/apps/{app}")
async def get_app(org: str, app: str, rt: Rt, _: Caller) -> dict[str, Any]:
    return app_json(await _app_or_404(rt, org, app))


@v2.patch("/apps/{app}")
async def patch_app(org: str, app: str, settings: AppSettings, rt: Rt, who: Admin) -> dict[str, Any]:
    """Change an app's settings; a grace period already running keeps the value it started with."""
    changes = settings.model_dump(exclude_none=True)
    if not changes:
        raise ApiError(422, "invalid_request", "nothing to change: give executorTimeoutSecs or recoverToLatestVersion")
    before = await _app_or_404(rt, org, app)
    await rt.registry.update_app(org, app, changes)
    after = await _app_or_404(rt, org, app)
    await rt.recoveries.audit(
        org,
        app,
        AuditEntry(
            "settings.updated",
            f"api:{who.name}",
            detail={"before": _settings(before), "after": _settings(after)},
        ),
    )
    # A recovery waiting for an operator may now be allowed to go on.
    await rt.durable.wake_app(org, app, {"reason": "settings_updated"})
    return app_json(after)


@v2.post("/apps/{app}/executors/{executor_id}/recover", status_code=202)
async def post_recover(
    org: str, app: str, executor_id: str, rt: Rt, who: Admin, body: RecoverRequest | None = None
) -> dict[str, str]:
    """An operator's recovery: skips the rest of a grace period, or unblocks a waiting one."""
    body = body or RecoverRequest()
    key = ExecutorKey(org, app, executor_id)
    rec = await rt.registry.get_executor(key)
    if rec is None:
        raise ApiError(404, "not_found", f"no executor {executor_id!r} in {org}/{app}")
    if rec.state is ExecutorState.HEALTHY:
        raise ApiError(
            409, "executor_healthy", "the executor is connected; recovering it would re-run workflows it is running"
        )
    actor = f"api:{who.name}"
    if rec.state is ExecutorState.DISCONNECTED:
        dedupe = f"manual:{key}:{rec.epoch}:dead"
        if not await rt.recoveries.declare_dead(key, rec.epoch, actor, dedupe):
            raise ApiError(409, "state_changed", "the executor's state changed meanwhile; look again")
        await rt.durable.end_grace(key, rec.epoch, "operator recovery")
    rid = await rt.durable.start_recovery(key, rec.epoch, "operator")
    await rt.recoveries.audit(
        org,
        app,
        AuditEntry(
            "recovery.manual_requested",
            actor,
            executor_id,
            detail={"recoveryId": rid, **body.model_dump(by_alias=True)},
        ),
    )
    await rt.durable.wake(rid, {"reason": "operator", "toLatestVersion": body.to_latest_version})
    return {"recoveryId": rid}


def recovery_json(row: RecoveryRow) -> dict[str, Any]:
    return {
        "recoveryId": row.id,
        "executorId": row.executor_id,
        "applicationVersion": row.application_version,
        "trigger": row.trigger,
        "status": row.status,
        "error": row.error,
        "createdAt": iso(row.created_at),
        "updatedAt": iso(row.updated_at),
        "attempts": [
            {
                "attempt": a["attempt"],
                "peerExecutorId": a["peerExecutorId"],
                "mode": a["mode"],
                "outcome": a["outcome"],
                "error": a["error"],
                "at": _iso_text(a["at"]),
            }
            for a in row.attempts
        ],
    }


def _iso_text(value: str) -> str | None:
    try:
        return iso(datetime.fromisoformat(value))
    except ValueError:
        return None


@v2.get("/apps/{app}/recoveries")
async def get_recoveries(
    org: str, app: str, rt: Rt, _: Caller, executor_id: Annotated[str | None, Query(alias="executorId")] = None
) -> list[dict[str, Any]]:
    await _app_or_404(rt, org, app)
    return [recovery_json(r) for r in await rt.recoveries.get(org, app, executor_id=executor_id)]


@v2.get("/apps/{app}/recoveries/{recovery_id}")
async def get_recovery(org: str, app: str, recovery_id: str, rt: Rt, _: Caller) -> dict[str, Any]:
    rows = await rt.recoveries.get(org, app, rid=recovery_id)
    if not rows:
        raise ApiError(404, "not_found", f"no recovery {recovery_id!r} in {org}/{app}")
    return recovery_json(rows[0])


@v2.get("/audit")
async def get_audit(
    org: str,
    rt: Rt,
    _: Caller,
    app: str | None = None,
    executor_id: Annotated[str | None, Query(alias="executorId")] = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[dict[str, Any]]:
    rows = await rt.recoveries.list_audit(org, app, executor_id, since, limit)
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


@v2.get("/apps/{app}/executors")
async def get_executors(
    org: str, app: str, rt: Rt, _: Caller, state: ExecutorState | None = None
) -> list[dict[str, Any]]:
    await _app_or_404(rt, org, app)
    return [executor_json(e) for e in await rt.registry.list_executors(org, app, state)]


@v2.get("/apps/{app}/executors/{executor_id}")
async def get_executor(org: str, app: str, executor_id: str, rt: Rt, _: Caller) -> dict[str, Any]:
    rec = await rt.registry.get_executor(ExecutorKey(org, app, executor_id))
    if rec is None:
        raise ApiError(404, "not_found", f"no executor {executor_id!r} in {org}/{app}")
    return executor_json(rec)


@v2.get("/apps/{app}/executors/{executor_id}/workflows")
async def get_executor_workflows(
    org: str,
    app: str,
    executor_id: str,
    rt: Rt,
    _: Caller,
    status: Annotated[str | None, Query(pattern="^[A-Z_]+$")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> list[dict[str, Any]]:
    """The executor's own workflows, asked of it over its socket (``list_workflows``)."""
    key = ExecutorKey(org, app, executor_id)
    filters: dict[str, Any] = {"executor_id": executor_id, "limit": limit}
    if status:
        filters["status"] = status
    try:
        reply = await rt.router.request(key, list_workflows(**filters), rt.config.liveness.recovery_ack_timeout_secs)
    except ExecutorNotConnected as exc:
        raise ApiError(409, "executor_not_connected", str(exc)) from exc
    except ExecutorTimeout as exc:
        raise ApiError(504, "executor_timeout", str(exc)) from exc
    except ExecutorRequestError as exc:
        raise ApiError(502, "executor_gone", str(exc)) from exc
    if reply.error_message:
        raise ApiError(502, "executor_error", reply.error_message)
    rows = reply.body.get("output")
    if not isinstance(rows, list):
        raise ApiError(502, "executor_error", "list_workflows reply has no output list")
    return [
        {
            "workflowId": w.get("WorkflowUUID"),
            "status": w.get("Status"),
            "name": w.get("WorkflowName"),
            "queueName": w.get("QueueName"),
            "applicationVersion": w.get("ApplicationVersion"),
            "executorId": w.get("ExecutorID"),
            "createdAt": _epoch_ms_iso(w.get("CreatedAt")),
            "updatedAt": _epoch_ms_iso(w.get("UpdatedAt")),
        }
        for w in rows
        if isinstance(w, dict)
    ]


ops = APIRouter()
DASHBOARD = Path(__file__).with_name("static") / "dashboard.html"


@ops.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> str:
    """A single page that reads the API with the key the operator types in."""
    return DASHBOARD.read_text(encoding="utf-8")


@ops.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@ops.get("/readyz")
async def readyz(rt: Rt) -> JSONResponse:
    if not await rt.db.ping():
        return error_response(503, "database_unreachable", "the database does not answer")
    if not rt.lease.held:
        why = "taken over by another instance" if rt.lease.fenced else "not renewed in time"
        return error_response(503, "lease_not_held", f"instance {rt.instance_id}: lease {why}")
    return JSONResponse({"status": "ready", "instance": rt.instance_id, "leaseEpoch": rt.lease.epoch})


@ops.get("/metrics", response_class=PlainTextResponse)
async def metrics(rt: Rt) -> str:
    return await rt.metrics_text()


def build_api(rt: Runtime) -> FastAPI:
    api = FastAPI(title="Relay", version=rt.version, lifespan=rt.lifespan)
    api.state.runtime = rt
    api.include_router(ops)
    api.include_router(v2)

    @api.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        return error_response(422, "invalid_request", "; ".join(parts))

    @api.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, "http_error", str(exc.detail))

    @api.exception_handler(DatabaseError)
    async def _db(_: Request, exc: DatabaseError) -> JSONResponse:
        return error_response(503, "database_unavailable", str(exc))

    return api
