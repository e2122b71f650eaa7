"""What operators and their tools poll: health, readiness, metrics, and the dashboard page."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, Response

from relay.api.common import Ctx, error_response

router = APIRouter()
DASHBOARD = Path(__file__).resolve().parents[1] / "static" / "dashboard.html"


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> str:
    """A single page that reads the API with the key the operator types in."""
    return DASHBOARD.read_text(encoding="utf-8")


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(ctx: Ctx) -> JSONResponse:
    if not await ctx.db.ping():
        return error_response(503, "database_unreachable", "the database does not answer")
    if not ctx.lease.held:
        why = "taken over by another instance" if ctx.lease.fenced else "not renewed in time"
        return error_response(503, "lease_not_held", f"instance {ctx.instance_id}: lease {why}")
    return JSONResponse({"status": "ready", "instance": ctx.instance_id, "leaseEpoch": ctx.lease.epoch})


@router.get("/metrics")
async def metrics(ctx: Ctx) -> Response:
    return Response(await ctx.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")
