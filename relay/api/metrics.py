"""An app's metrics over a time range, as DBOS Conductor's ``GET .../apps/{app}/metrics`` serves them.

Conductor's ``Metric``: ``workflow_count`` (workflows created, by workflow
name) and ``step_count`` (steps completed, by step name) per time bucket, as
the SDK's ``get_metrics`` counts them, and ``recovery_count`` (recovery
requests sent to the app's executors, named ``recovery``), which Conductor
reports itself. Relay stores the counts of each window of the figures job
(``metrics.appFiguresWindowSecs``, the ``granularity``), for
``retention.appMetricsDays``; windows in which no executor answered have none.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from relay.api.apps import app_or_404
from relay.api.common import MAX_OFFSET, Ctx, DecodedRoute, permitted
from relay.api.shapes import Rfc3339, Shape
from relay.auth import KeyGrant, Permission
from relay.core.times import us_iso, utc
from relay.store.appfigures import granularity

router = APIRouter(route_class=DecodedRoute, prefix="/v2/orgs/{org}/apps/{app}")

DEFAULT_METRICS = 10_000
MAX_METRICS = 100_000


class Metric(Shape):
    """Conductor's ``Metric``: a count of one type and name in one time bucket."""

    appId: str
    metricType: str
    metricName: str
    value: int
    timeBucket: str
    granularity: int


async def metric_reader(request: Request, org: str) -> KeyGrant:
    return permitted(request, org, Permission.METRIC_READ)


@router.get("/metrics")
async def list_metrics(
    org: str,
    app: str,
    ctx: Ctx,
    _: Annotated[KeyGrant, Depends(metric_reader)],
    # RFC 3339 with its offset, as conductor-api.md gives time windows and Relay's other routes take
    # times: a plain datetime also took a number for one (seconds or milliseconds since 1970, as
    # pydantic guesses), and a time without its offset was refused with no error's location.
    startTime: Rfc3339,
    endTime: Rfc3339,
    limit: Annotated[int, Query(ge=1, le=MAX_METRICS)] = DEFAULT_METRICS,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> list[Metric]:
    """``Metric[]`` of ``[startTime, endTime)`` (none when it is empty), by time bucket, type and name."""
    startTime, endTime = utc(startTime), utc(endTime)
    await app_or_404(ctx, org, app)
    if endTime <= startTime:
        return []  # an empty range
    window = granularity(ctx.config.metrics.app_figures_window_secs)
    rows = await ctx.figures.metric_counts(org, app, startTime, endTime, window, limit, offset)
    return [
        Metric(
            appId=app,
            metricType=row["metric_type"],
            metricName=row["metric_name"],
            value=int(row["value"]),
            timeBucket=us_iso(row["time_bucket"]) or "",
            granularity=int(row["granularity"]),
        )
        for row in rows
    ]
