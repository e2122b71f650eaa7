"""The apps' workflow figures (``dbos_conductor_v1_*``): one durable job per window, for every app.

Every instance's engine starts, just after each clock-aligned window
(``metrics.appFiguresWindowSecs``, a minute by default) has ended, the job
``relay-app-figures:{window start in ms}``. DBOS runs an id once, so one
instance computes each window; if it dies in the middle, the instance that
adopts it (within ``instanceLeaseSecs``) resumes the job, and the next window's
job is started by the survivors anyway.

Its one step asks, for each app with a healthy executor, one of them for
``get_workflow_aggregates`` (created, dequeued and completed in the window;
ENQUEUED and PENDING now) and ``get_step_aggregates`` (completed in the
window), turns them into figures (:mod:`relay.core.appfigures`) and stores
them, where every instance's ``/metrics`` reads them. Running the step again
(after a crash) asks again and overwrites the same window: harmless.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from dbos import DBOS

from relay.core.appfigures import Aggregates, Row, StepRow, Window, counts, series
from relay.core.ids import owned_by
from relay.core.times import sdk_ms_time
from relay.errors import ExecutorRequestError
from relay_protocol import (
    GetStepAggregatesBody,
    GetStepAggregatesReply,
    GetStepAggregatesRequest,
    GetWorkflowAggregatesBody,
    GetWorkflowAggregatesReply,
    GetWorkflowAggregatesRequest,
    clean_text,
)
from workflows.services import ask_app, relay_step, services

log = logging.getLogger("relay.figures")

# Apps asked at once.
CONCURRENT_APPS = 16


def job_id(window: Window) -> str:
    return f"relay-app-figures:{window.start_ms}"


async def _workflows(org: str, app: str, spread: str, body: GetWorkflowAggregatesBody) -> list[Row]:
    _, reply = await ask_app(
        org, app, lambda: GetWorkflowAggregatesRequest(body=body), GetWorkflowAggregatesReply, spread=spread
    )
    return [Row(r.group, r.count, r.min_created_at, r.max_queue_wait_ms, r.max_total_latency_ms) for r in reply.output]


async def _steps(org: str, app: str, spread: str, body: GetStepAggregatesBody) -> list[StepRow]:
    _, reply = await ask_app(
        org, app, lambda: GetStepAggregatesRequest(body=body), GetStepAggregatesReply, spread=spread
    )
    return [StepRow(r.group, r.count, r.max_duration_ms) for r in reply.output]


async def aggregates(org: str, app: str, window: Window) -> Aggregates:
    """Ask the app's executors what the figures of ``window`` need (five requests)."""
    first, last = sdk_ms_time(window.start_ms), sdk_ms_time(window.last_ms)
    spread = f"{org}:{app}:{window.start_ms}"
    # The app's own (apps may share a system database): so counted whichever executor answers.
    mine = owned_by(app)
    by_name_queue = GetWorkflowAggregatesBody(
        group_by_name=True, group_by_queue_name=True, select_count=True, application_name=mine
    )

    async def ask(**body: Any) -> list[Row]:
        return await _workflows(org, app, spread, replace(by_name_queue, **body))

    started = await ask(start_time=first, end_time=last)
    dequeued = await ask(dequeued_after=first, dequeued_before=last)
    completed = await ask(
        group_by_status=True,
        select_max_queue_wait_ms=True,
        select_max_total_latency_ms=True,
        completed_after=first,
        completed_before=last,
    )
    live = await ask(group_by_status=True, select_min_created_at=True, status=["ENQUEUED", "PENDING"])
    steps = await _steps(
        org,
        app,
        spread,
        GetStepAggregatesBody(
            group_by_function_name=True,
            group_by_status=True,
            select_count=True,
            select_max_duration_ms=True,
            completed_after=first,
            completed_before=last,
            application_name=mine,
        ),
    )
    return Aggregates(started, dequeued, completed, live, steps)


async def _one(org: str, app: str, window: Window, gate: asyncio.Semaphore) -> str | None:
    """Compute and store one app's figures; the reason if it could not."""
    async with gate:
        try:
            found = await aggregates(org, app, window)
        except ExecutorRequestError as exc:
            log.info("app %s/%s: no figures for the window at %d: %s", org, app, window.start_ms, exc)
            return clean_text(str(exc), 300)
        await services().figures.save(org, app, window, series(found, window), counts(found))
        return None


def _failed(exc: Exception) -> dict[str, Any]:
    return {"error": clean_text(f"{type(exc).__name__}: {exc}", 500)}


@relay_step("relay.app_figures.compute", on_error=_failed)
async def compute(window_start_ms: int, window_secs: float) -> dict[str, Any]:
    svc = services()
    window = Window(window_start_ms, window_secs)
    apps = await svc.figures.apps_with_healthy_executors()
    gate = asyncio.Semaphore(CONCURRENT_APPS)
    results = await asyncio.gather(*(_one(org, app, window, gate) for org, app in apps))
    failed = {f"{org}/{app}": reason for (org, app), reason in zip(apps, results, strict=True) if reason}
    # A small checkpoint: the figures themselves are in the database.
    return {"apps": len(apps), "failed": dict(list(failed.items())[:20])}


@DBOS.workflow(name="relay.app_figures", max_recovery_attempts=None)
async def app_figures(window_start_ms: int, window_secs: float) -> dict[str, Any]:
    return await compute(window_start_ms, window_secs)
