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
from starlette.exceptions import HTTPException as StarletteHTTPException

from relay.auth import KeyGrant
from relay.errors import DatabaseError, ExecutorNotConnected, ExecutorRequestError, ExecutorTimeout
from relay.lifecycle import ExecutorState
from relay.protocol import list_workflows
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


def app_json(app: AppRecord) -> dict[str, Any]:
    return {
        "org": app.org,
        "name": app.name,
        "executorTimeoutSecs": app.executor_timeout_secs,
        "recoverToLatestVersion": app.recover_to_latest_version,
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


Caller = Annotated[KeyGrant, Depends(caller)]
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
        reply = await rt.hub.request(key, list_workflows(**filters), rt.config.liveness.recovery_ack_timeout_secs)
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
    if await rt.db.ping():
        return JSONResponse({"status": "ready", "instance": rt.instance_id})
    return error_response(503, "database_unreachable", "the database does not answer")


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
